"""HF ⇄ Orbax conversion: bit-identical round trip, transformers loads the export, bad inputs."""

import glob
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")  # the reference side; absent where no CPU torch wheel exists (Python 3.12 CI)
from hf_reference import hf_logits, hf_model
from zaya_process import zaya
from zaya_jax import load
from zaya_jax.cli import main
from zaya_jax.config import preset

CFG = preset("tiny", num_hidden_layers=3, num_experts=3, cca_time0=3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = hf_model(CFG, seed=7)
    with torch.no_grad():  # transformers 5.23 resets the skip bias to -1 on load; use that value
        for layer in model.model.layers:
            layer.mlp.gate.balancing_biases[-1] = -1.0
    path = str(tmp_path_factory.mktemp("hf") / "model")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    assert main(["convert", "from-hf", f"--hf={hf_dir[0]}", f"--out={ckpt}", "--quiet"]) == 0
    return ckpt


def read_dir(path):
    tensors = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_round_trip_is_bit_identical_and_loads_in_transformers(hf_dir, converted, tmp_path):
    out = str(tmp_path / "export")
    assert main(["convert", "to-hf", f"--ckpt={converted}", f"--out={out}", "--max-shard-size=200KB", "--quiet"]) == 0
    original, exported = read_dir(hf_dir[0]), read_dir(out)
    assert set(exported) == set(original) - {"lm_head.weight"}
    for name, tensor in exported.items():
        assert tensor.dtype == original[name].dtype and np.array_equal(tensor, original[name]), name
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1  # sharded above the threshold
    assert set(index["weight_map"]) == set(exported)

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 17))
    ref = hf_logits(hf_dir[1], ids)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), ref)
    ours = np.asarray(load(converted)(jnp.asarray(ids)))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_hf_fused_gate_up_holds_our_gate_then_up_bit_for_bit(hf_dir, converted):
    from zaya_jax.checkpoint import orbax_store
    from zaya_jax.model.state import expected_shapes

    keys = ["layers/1/moe/experts/gate", "layers/1/moe/experts/up"]
    gate, up = (orbax_store.load_arrays(converted, keys, expected_shapes(CFG))[k] for k in keys)  # [E, H, I]
    hf = read_dir(hf_dir[0])["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H], gate rows first
    inter = CFG.moe_intermediate_size
    assert np.array_equal(gate, hf[:, :inter].transpose(0, 2, 1))
    assert np.array_equal(up, hf[:, inter:].transpose(0, 2, 1))


def test_bfloat16_export(converted, tmp_path):
    out = str(tmp_path / "bf16")
    assert main(["convert", "to-hf", f"--ckpt={converted}", f"--out={out}", "--dtype=bfloat16", "--quiet"]) == 0
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    assert not os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.0.mlp.gate.balancing_biases").dtype == torch.float32
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"


def test_the_tokenizer_travels_with_the_checkpoint_both_ways(hf_dir, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    src = tmp_path / "hf"
    shutil.copytree(hf_dir[0], src)
    words = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "hello": 1, "world": 2, "[UNK]": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(src / "tokenizer.json"))
    assert main(["convert", "from-hf", f"--hf={src}", f"--out={tmp_path}/ckpt", "--quiet"]) == 0
    assert (tmp_path / "ckpt" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert main(["convert", "to-hf", f"--ckpt={tmp_path}/ckpt", f"--out={tmp_path}/out", "--quiet"]) == 0
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "out"))  # needs the tokenizer_config.json we write
    assert exported("hello world")["input_ids"] == [1, 2] and exported.eos_token_id == 0

    (tmp_path / "ckpt" / "tokenizer.json").unlink()
    (tmp_path / "ckpt" / "tokenizer.txt").write_text("bytes\n")  # a run trained on bytes
    capsys.readouterr()
    assert main(["convert", "to-hf", f"--ckpt={tmp_path}/ckpt", f"--out={tmp_path}/out2", "--quiet"]) == 0
    assert "bytes tokenizer, which has no Hugging Face form" in capsys.readouterr().err
    assert not (tmp_path / "out2" / "tokenizer.json").exists()


def test_load_reads_hf_directories_directly(hf_dir):
    ids = np.random.RandomState(1).randint(0, CFG.vocab_size, (1, 9))
    ref = hf_logits(hf_dir[1], ids)
    ours = np.asarray(load(hf_dir[0])(jnp.asarray(ids)))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_sharded_bf16_hf_checkpoint_imports_exactly(tmp_path, capsys):
    """The HF reading path as real ZAYA releases use it: bf16 tensors in several shards plus
    `model.safetensors.index.json`, written by transformers itself. Every imported array is HF's
    bf16 tensor widened to fp32 bit for bit; `zaya_jax.load` on the directory gives HF's logits."""
    from safetensors import safe_open
    from zaya_jax.checkpoint import hf_mapping, orbax_store
    from zaya_jax.model.state import expected_shapes

    model = hf_model(CFG, seed=11).to(torch.bfloat16)
    hf_dir = str(tmp_path / "hf_bf16")
    model.save_pretrained(hf_dir, max_shard_size="100KB")  # the tiny model is ~250 KB in bf16
    shards = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {os.path.basename(f) for f in shards}
    for shard in shards:  # the file really holds bf16, as safetensors itself reads it
        with safe_open(shard, "pt") as f:
            assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}, shard

    # Expected: HF's own in-memory tensors, widened to fp32 (exact), laid out by the mapping table.
    hf = {k: v.float().numpy() for k, v in model.state_dict().items()}
    shapes = expected_shapes(CFG)
    want = {}
    for group in hf_mapping.grouped_rules(CFG).values():
        want.update(hf_mapping.convert_group_to_ours(group, hf.__getitem__, shapes, "hf"))
    ckpt = str(tmp_path / "ckpt")
    capsys.readouterr()  # transformers' own progress bar
    assert main(["convert", "from-hf", f"--hf={hf_dir}", f"--out={ckpt}", "--quiet"]) == 0, capsys.readouterr().err
    got = orbax_store.load_arrays(ckpt, shapes, shapes)
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == np.float32 and np.array_equal(got[key], want[key]), key

    ids = np.random.RandomState(2).randint(0, CFG.vocab_size, (2, 11))
    ref = hf_logits(model.float(), ids)  # HF's forward in fp32 on the bf16-valued weights
    ours = np.asarray(load(hf_dir)(jnp.asarray(ids)))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


# ---------------------------------------------------------------------------------------------
# Bad inputs: one line on stderr naming the problem, exit code 2, nothing written.

def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def copy_hf(src, dst, edit=None):
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        if edit:
            data = edit(name, data)
        if data is not None:
            with open(os.path.join(dst, name), "wb") as f:
                f.write(data)
    return dst


def test_missing_directory(tmp_path, capsys):
    code, err = run_cli(["convert", "from-hf", f"--hf={tmp_path}/nope", f"--out={tmp_path}/ck", "--quiet"], capsys)
    assert code == 2 and "does not exist" in err and "nope" in err


def test_not_a_zaya_directory(tmp_path, capsys):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    code, err = run_cli(["convert", "from-hf", f"--hf={tmp_path}/junk", f"--out={tmp_path}/ck", "--quiet"], capsys)
    assert code == 2 and "no config.json" in err
    code, err = run_cli(["convert", "to-hf", f"--ckpt={tmp_path}/junk", f"--out={tmp_path}/o", "--quiet"], capsys)
    assert code == 2 and "not an Orbax checkpoint" in err
    assert not os.path.exists(tmp_path / "ck") and not os.path.exists(tmp_path / "o")


def test_other_model_type(hf_dir, tmp_path, capsys):
    def edit(name, data):
        if name == "config.json":
            cfg = json.loads(data)
            cfg["model_type"] = "llama"
            return json.dumps(cfg).encode()
        return data

    src = copy_hf(hf_dir[0], str(tmp_path / "llama"), edit)
    code, err = run_cli(["convert", "from-hf", f"--hf={src}", f"--out={tmp_path}/ck", "--quiet"], capsys)
    assert code == 2 and "'llama'" in err and "not 'zaya'" in err


def test_truncated_safetensors(hf_dir, tmp_path, capsys):
    src = copy_hf(hf_dir[0], str(tmp_path / "cut"),
                  lambda name, data: data[: len(data) - 1000] if name.endswith(".safetensors") else data)
    code, err = run_cli(["convert", "from-hf", f"--hf={src}", f"--out={tmp_path}/ck", "--quiet"], capsys)
    assert code == 2 and "truncated" in err and "model.safetensors" in err
    assert not os.path.exists(tmp_path / "ck")


def test_missing_and_misshaped_tensors_are_named(hf_dir, tmp_path, capsys):
    tensors = read_dir(hf_dir[0])
    from safetensors.numpy import save_file

    missing = dict(tensors)
    del missing["model.layers.1.self_attn.qk_norm.temp"]
    src = copy_hf(hf_dir[0], str(tmp_path / "missing"), lambda n, d: None if n.endswith(".safetensors") else d)
    save_file(missing, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    code, err = run_cli(["convert", "from-hf", f"--hf={src}", f"--out={tmp_path}/ck", "--quiet"], capsys)
    assert code == 2 and "missing tensor 'model.layers.1.self_attn.qk_norm.temp'" in err

    bad = dict(tensors)
    bad["model.layers.2.mlp.experts.down_proj"] = bad["model.layers.2.mlp.experts.down_proj"][:, :, :-1].copy()
    bad["model.extra.weight"] = np.zeros(3, np.float32)
    src = copy_hf(hf_dir[0], str(tmp_path / "shape"), lambda n, d: None if n.endswith(".safetensors") else d)
    save_file(bad, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    code, err = run_cli(["convert", "from-hf", f"--hf={src}", f"--out={tmp_path}/ck", "--quiet"], capsys)
    assert code == 2 and "'model.layers.2.mlp.experts.down_proj'" in err and "shape" in err

    del bad["model.layers.2.mlp.experts.down_proj"]
    bad["model.layers.2.mlp.experts.down_proj"] = tensors["model.layers.2.mlp.experts.down_proj"]
    save_file(bad, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    code, err = run_cli(["convert", "from-hf", f"--hf={src}", f"--out={tmp_path}/ck", "--quiet"], capsys)
    assert code == 2 and "unexpected tensor 'model.extra.weight'" in err
    assert not os.path.exists(tmp_path / "ck")


def test_existing_output_is_never_overwritten(hf_dir, converted, tmp_path, capsys):
    code, err = run_cli(["convert", "from-hf", f"--hf={hf_dir[0]}", f"--out={converted}", "--quiet"], capsys)
    assert code == 2 and "already exists" in err
    code, err = run_cli(["convert", "to-hf", f"--ckpt={converted}", f"--out={hf_dir[0]}", "--quiet"], capsys)
    assert code == 2 and "not empty" in err


def test_console_entry_point_exit_code(tmp_path):
    proc = zaya("convert", "to-hf", f"--ckpt={tmp_path}/none", f"--out={tmp_path}/o")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("zaya: error:")
    assert "Traceback" not in proc.stderr


def test_leftovers_of_a_killed_conversion_are_discarded(hf_dir, tmp_path):
    """A conversion killed mid-way leaves Orbax's partial-save directory; the next run starts clean."""
    from orbax.checkpoint.experimental import v1 as ocpv1

    out = str(tmp_path / "ckpt")
    ocpv1.partial.save(out, {"model": {"embedding": np.zeros((2, 2), np.float32)}})  # never finalized
    assert not os.path.exists(out)
    assert main(["convert", "from-hf", f"--hf={hf_dir[0]}", f"--out={out}", "--quiet"]) == 0
    assert not glob.glob(out + ".partial_save*")
    ids = jnp.asarray([[1, 2, 3]])
    ref = hf_logits(hf_dir[1], np.asarray(ids))
    assert np.abs(np.asarray(load(out)(ids)) - ref).max() <= 1e-4 * np.abs(ref).max()


def test_damaged_checkpoint(converted, tmp_path, capsys):
    import shutil

    broken = str(tmp_path / "broken")
    shutil.copytree(converted, broken)
    shutil.rmtree(os.path.join(broken, "state"))
    code, err = run_cli(["convert", "to-hf", f"--ckpt={broken}", f"--out={tmp_path}/o", "--quiet"], capsys)
    assert code == 2 and "damaged" in err and "broken" in err
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(tmp_path / "o.partial")


@pytest.mark.parametrize("damage", ["truncated", "emptied manifest"])
def test_a_damaged_checkpoint_through_the_cli_is_one_line_with_no_background_tracebacks(converted, tmp_path, damage):
    """Orbax's threads used to follow the error line with `Event loop is closed` tracebacks."""
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    files = [p for p in (broken / "state").rglob("*") if p.is_file() and
             (p.name == "manifest.ocdbt" if damage == "emptied manifest" else p.parent.name == "d")]
    assert files
    for path in files:
        path.write_bytes(path.read_bytes()[: 10 if damage == "truncated" else 0])
    result = zaya("convert", "to-hf", f"--ckpt={broken}", f"--out={tmp_path / 'o'}", "--quiet")
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("WARNING:absl")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("zaya: error: ") and str(broken) in lines[0] and "damaged" in lines[0]
    assert " at 0x" not in lines[0]
    assert not (tmp_path / "o").exists()


def test_bad_shard_size_flag(converted, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "to-hf", f"--ckpt={converted}", f"--out={tmp_path}/o", "--max-shard-size=5XB"])
    assert exit_info.value.code == 2
    assert "'5XB' is not a size like 5GB" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not os.path.exists(tmp_path / "o")
