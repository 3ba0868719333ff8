"""`zaya generate`: text in, text out from a model directory (its tokenizer found beside it), the
same tokens as `zaya_jax.generate`, streamed for one prompt; every bad input one line and exit 2."""

import json

import numpy as np
import pytest
from flax import nnx

import zaya_jax
from zaya_jax.checkpoint import orbax_store
from zaya_jax.cli import main
from zaya_jax.config import preset
from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.model.layer_stack import per_layer
from zaya_jax.model.state import flat_arrays
from zaya_jax.model.zaya import Zaya
from zaya_jax.train.export import write_tokenizer

CFG = preset("tiny", vocab_size=ByteTokenizer.vocab_size, num_hidden_layers=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random model saved as a training run saves it, with the run's `bytes` tokenizer beside it."""
    path = str(tmp_path_factory.mktemp("gen") / "model")
    arrays = {k: np.asarray(v) for k, v in per_layer(flat_arrays(Zaya(CFG, rngs=nnx.Rngs(3))), CFG.layer_kinds).items()}
    orbax_store.save_groups(path, CFG, [arrays])
    write_tokenizer("bytes", path)
    return path


def test_one_prompt_streams_the_tokens_that_generate_gives(model_dir, capsys):
    assert main(["generate", f"--model={model_dir}", "--prompt=def fib(n):", "--max-new-tokens=12", "--no-stop"]) == 0
    out, err = capsys.readouterr()
    tok = ByteTokenizer()
    want = zaya_jax.generate(zaya_jax.load(model_dir), [tok.encode("def fib(n):")], max_new_tokens=12)[0]
    assert out == "def fib(n):" + tok.decode(want) + "\n"
    assert err.startswith("zaya generate: 12 tokens for 1 prompt(s) in ") and "tokens/s" in err


def test_several_prompts_print_one_json_line_each(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"first"\n\n{"prompt": "second one"}\n')
    args = ["generate", f"--model={model_dir}", f"--prompts={prompts}", "--prompt=zeroth", "--max-new-tokens=5",
            "--temperature=0.7", "--top-k=20", "--seed=4", "--no-stop"]
    assert main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["zeroth", "first", "second one"]
    assert main(args) == 0  # the same seed, the same text
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows


@pytest.mark.parametrize("args, words", [
    (["--prompt="], "prompt 1 is empty (it encodes to no tokens)"),
    ([], "no prompt: pass --prompt TEXT or --prompts FILE.jsonl"),
    (["--prompt=x", "--max-new-tokens=0"], "--max-new-tokens must be a positive integer"),
    (["--prompt=x", "--temperature=nan"], "--temperature must be a finite number"),
    (["--prompt=x", "--temperature=1", "--top-p=0"], "--top-p must be in (0, 1]"),
    (["--prompt=x", "--top-k=3"], "set --temperature > 0"),
    (["--prompt=x", "--prompts=/no/such.jsonl"], "cannot read --prompts /no/such.jsonl"),
    (["--prompt=x", "--tokenizer=/no/tokenizer.json"], "tokenizer /no/tokenizer.json does not exist"),
    (["--prompt=x", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_inputs_are_one_line_and_exit_2(model_dir, capsys, args, words):
    assert main(["generate", f"--model={model_dir}", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zaya: error: ") and words in err[0], err


def test_a_missing_model_a_model_without_tokenizer_and_a_mismatched_one(model_dir, tmp_path, capsys):
    assert main(["generate", f"--model={tmp_path}/none", "--prompt=x"]) == 2
    bare = str(tmp_path / "bare")
    arrays = {k: np.asarray(v) for k, v in per_layer(flat_arrays(Zaya(CFG, rngs=nnx.Rngs(0))), CFG.layer_kinds).items()}
    orbax_store.save_groups(bare, CFG, [arrays])
    assert main(["generate", f"--model={bare}", "--prompt=x"]) == 2
    small = preset("tiny", vocab_size=64, num_hidden_layers=1, eos_token_id=2)  # ids inside the vocabulary
    narrow = str(tmp_path / "narrow")
    arrays = {k: np.asarray(v) for k, v in per_layer(flat_arrays(Zaya(small, rngs=nnx.Rngs(0))), small.layer_kinds).items()}
    orbax_store.save_groups(narrow, small, [arrays])
    write_tokenizer("bytes", narrow)
    assert main(["generate", f"--model={narrow}", "--prompt=x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err
    assert "--model" in err[0] and "does not exist" in err[0]
    assert "holds no tokenizer (tokenizer.json or tokenizer.txt); pass --tokenizer" in err[1]
    assert "the tokenizer has 259 ids but the model's vocabulary is 64" in err[2]
