"""Experiment configs: the shipped files validate; bad keys, types and combinations are refused in words."""

import os
import textwrap

import pytest

from zaya_jax.errors import ZayaError
from zaya_jax.experiment import base_config, load_experiment
from zaya_jax.experiment.load import flatten, parse_override_args
from zaya_jax.parallel.mesh import check_layout, resolve_axis_sizes
from paths import EXPERIMENTS, TINY


STABLE_KEYS = ["train.steps", "train.seed", "train.global_batch_size", "train.seq_len", "train.log_every",
               "checkpoint.every_steps", "model.compute_dtype", "model.hidden_size", "model.num_experts",
               "mesh.data", "mesh.fsdp", "mesh.expert", "mesh.tsp", "mesh.tensor", "mesh.sequence"]


@pytest.mark.parametrize("name", ["tiny_cpu", "tiny_hybrid_cpu", "zaya1_routing_cpu", "zaya1_base_phase1",
                                  "zaya1_base_midtrain_32k"])
def test_shipped_experiments_validate_and_have_stable_keys(name):
    exp = load_experiment(os.path.join(EXPERIMENTS, f"{name}.py"))
    keys = flatten(exp.config.to_dict())
    for key in STABLE_KEYS:
        assert key in keys
    assert any(k.startswith("data.") for k in keys) and any(k.startswith("optim.") for k in keys)


def test_the_routing_experiment_has_zaya1s_routing_shape():
    exp = load_experiment(os.path.join(EXPERIMENTS, "zaya1_routing_cpu.py"))
    m, t = exp.model, exp.config.train
    assert (m.num_experts, m.num_experts_per_tok) == (16, 1) and t.global_batch_size * t.seq_len >= 8192


def test_published_recipes():
    p1 = load_experiment(os.path.join(EXPERIMENTS, "zaya1_base_phase1.py"))
    assert (p1.model.hidden_size, p1.model.num_hidden_layers, p1.model.vocab_size) == (2048, 40, 262272)
    assert p1.config.train.seq_len == 4096 and p1.config.train.global_batch_size == 4096
    assert p1.model.rope_theta == 1e4 and (p1.config.optim.lr, p1.config.optim.min_lr) == (6e-4, 2e-4)
    mid = load_experiment(os.path.join(EXPERIMENTS, "zaya1_base_midtrain_32k.py"))
    assert mid.config.train.seq_len == 32768 and mid.model.rope_theta == 1e6


def test_overrides_are_parsed_as_the_key_type():
    exp = load_experiment(TINY, ["--config.train.steps=7", "--config.optim.lr", "1e-3",
                                 "--config.train.progress=false", "--config.model.compute_dtype=bfloat16",
                                 "--config.model.eos_token_id=None", "--config.optim.warmup_steps=1"])
    assert exp.config.train.steps == 7 and exp.config.optim.lr == 1e-3
    assert exp.config.train.progress is False and exp.model.compute_dtype == "bfloat16"
    assert exp.model.eos_token_id is None


@pytest.mark.parametrize("overrides, words", [
    (["--config.train.stepz=5"], "unknown config key (did you mean train.steps?)"),
    (["--config.train.steps=ten"], "train.steps takes an integer, got 'ten'"),
    (["--config.train.progress=maybe"], "true/false"),
    (["--config.train.steps"], "has no value"),
    (["--steps=5"], "unrecognized argument"),
    (["--config.train.global_batch_size=10", "--config.train.grad_accum_steps=4"], "multiple of train.grad_accum_steps"),
    (["--config.mesh.tsp=0"], "mesh.tsp must be a positive size"),
    (["--config.mesh.data=-1", "--config.mesh.fsdp=-1"], "only one mesh axis may be -1"),
    (["--config.mesh.zigzag=maybe"], "true/false"),
    (["--config.train.remat=some"], "train.remat must be one of"),
    (["--config.model.num_attention_heads=3"], "model.num_attention_heads (3) must be a multiple"),
    (["--config.optim.min_lr=1.0"], "optim.min_lr"),
    (["--config.train.seq_len=100000"], "exceeds model.max_position_embeddings"),
    (["--config.model.vocab_size=100"], "too small for the byte tokenizer"),
    (["--config.train.hardware=tpu9"], "train.hardware must be"),
    (["--config.eval.prompts=['def f', '']"], "eval.prompts must be a list of non-empty texts"),
    (["--config.eval.prompts=['x']", "--config.eval.prompt_tokens=128"], "eval.prompt_tokens (128) must be below"),
    (["--config.eval.task_limit=-1"], "eval.task_limit must be >= 0"),
    (["--config.optim.muon_ns_dtype=fp8"], "optim.muon_ns_dtype must be one of auto, float32, bfloat16, got 'fp8'"),
    (["--config.optim.balancer=adam", "--config.optim.balance_lr=0.5"],
     "optim.balance_lr=0.5 is too large for optim.balancer=adam"),
    (["--config.optim.balancer=solve", "--config.optim.balance_lr=1.5"],
     "optim.balance_lr=1.5 is too large for optim.balancer=solve"),
    (["--config.optim.balance_lr=-1"], "optim.balance_lr must be >= 0"),
])
def test_bad_overrides_name_the_problem(overrides, words):
    with pytest.raises(ZayaError, match=None) as err:
        load_experiment(TINY, overrides)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def _write(tmp_path, body):
    path = tmp_path / "exp.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_bad_experiment_files(tmp_path):
    with pytest.raises(ZayaError, match="does not exist"):
        load_experiment(str(tmp_path / "nope.py"))
    with pytest.raises(ZayaError, match="defines no get_config"):
        load_experiment(_write(tmp_path, "x = 1\n"))
    with pytest.raises(ZayaError, match="unknown config key train.learning_rate"):
        load_experiment(_write(tmp_path, """
            from zaya_jax.experiment import base_config
            def get_config():
                c = base_config()
                c.unlock()
                c.train.learning_rate = 1.0
                return c
        """))
    with pytest.raises(ZayaError, match="train.steps must be an integer, got '10'"):
        load_experiment(_write(tmp_path, """
            from zaya_jax.experiment import base_config
            def get_config():
                c = base_config().to_dict()
                c["train"]["steps"] = "10"
                return c
        """))
    with pytest.raises(ZayaError, match="failed while building its config: ZeroDivisionError"):
        load_experiment(_write(tmp_path, "def get_config():\n    return 1 / 0\n"))


def test_mesh_resolution_and_layout_checks():
    base = dict(base_config().mesh)
    assert resolve_axis_sizes(base, 8)["data"] == 8
    assert resolve_axis_sizes(dict(base, data=2, fsdp=-1, expert=2), 8)["fsdp"] == 2
    with pytest.raises(ZayaError, match="needs 4 devices but this run has 8"):
        resolve_axis_sizes(dict(base, data=4), 8)
    with pytest.raises(ZayaError, match="does not divide 8"):
        resolve_axis_sizes(dict(base, data=-1, fsdp=3), 8)
    model = load_experiment(TINY).model
    with pytest.raises(ZayaError, match="does not split over the 8 data-parallel devices"):
        check_layout(resolve_axis_sizes(base, 8), model, micro_batch=12, seq_len=128)
    with pytest.raises(ZayaError, match="num_experts .4. is not divisible by mesh.expert .8."):
        check_layout(resolve_axis_sizes(dict(base, data=1, expert=8), 8), model, micro_batch=8, seq_len=128)


@pytest.mark.parametrize("layout, overrides, words", [
    (dict(tsp=2, tensor=4), {}, "mesh.tsp and mesh.tensor both split the heads"),
    (dict(tensor=4, data=2), {}, r"num_key_value_heads \(2\) is not divisible by mesh.tensor \(4\): CCA mixes"),
    (dict(tsp=8), dict(moe_intermediate_size=12), r"moe_intermediate_size \(12\) is not divisible by mesh.tensor x mesh.tsp \(8\)"),
    (dict(tsp=4, fsdp=2), dict(hidden_size=132, num_attention_heads=4), r"hidden_size \(132\) is not divisible by mesh.fsdp x mesh.tsp \(8\)"),
    (dict(sequence=8, zigzag=False), {}, r"train.seq_len \(100\) is not divisible by mesh.tsp x mesh.sequence \(8\)"),
    (dict(sequence=4, data=2), {}, r"train.seq_len \(100\) is not divisible by 2 x mesh.tsp x mesh.sequence \(8\): zigzag "
                           r".* or set mesh.zigzag=False"),
    (dict(tsp=4, sequence=2), {}, "train.seq_len / .* = 1 tokens per chunk is shorter than CCA's look-back of 2"),
    (dict(sequence=4, data=2), dict(attention_kernel="cudnn"), "model.attention_kernel=cudnn takes no causal offset"),
])
def test_impossible_layouts_are_refused_in_words(layout, overrides, words):
    sizes = resolve_axis_sizes({**dict(base_config().mesh), "data": 1, **layout}, 8)
    model = load_experiment(TINY).model.replace(**overrides)
    seq_len = 16 if "look-back" in words else 100 if "(100" in words else 128
    with pytest.raises(ZayaError, match="^mesh \\(.*\\): .*" + words):
        check_layout(sizes, model, micro_batch=8, seq_len=seq_len, zigzag=layout.get("zigzag", True))


def test_parse_override_args_forms():
    assert parse_override_args(["--config.a.b=1", "--config.c", "x=y"]) == [("a.b", "1"), ("c", "x=y")]


@pytest.mark.parametrize("balancer, lr", [("solve", 0.5), ("spread", 0.5), ("adam", 1e-3)])
def test_an_unset_balance_lr_is_the_balancers_own(balancer, lr):
    from zaya_jax.experiment.schema import balance_lr

    exp = load_experiment(TINY, [f"--config.optim.balancer={balancer}"])
    assert exp.config.optim.balance_lr is None and balance_lr(exp.config.optim) == lr
    assert balance_lr(load_experiment(TINY, [f"--config.optim.balancer={balancer}", "--config.optim.balance_lr=0"])
                      .config.optim) == 0.0
