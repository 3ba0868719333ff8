"""Hybrid ZAYA models (`model.layer_pattern`): the linear-attention layer against its quadratic
reference, the scan over the pattern's unit, documents kept apart, the per-layer interchange form,
and the config's refusals."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zaya_jax.cli import main
from zaya_jax.config import HYBRID_FIELDS, preset, to_hf_dict
from zaya_jax.errors import ZayaError
from zaya_jax.kernels import linear_attention as la
from zaya_jax.model import Zaya
from zaya_jax.model import linear_attn
from zaya_jax.model.layer_stack import per_layer, repeating_unit
from zaya_jax.model.segments import sequence_info
from zaya_jax.model.state import build_model, expected_shapes, flat_arrays
from zaya_jax.train.checkpoints import check_compatible

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "tiny_cpu.py")

CFG = preset("tiny", num_hidden_layers=6, layer_pattern="LLC", linear_decay="retention")
RNG = np.random.RandomState(0)
IDS = jnp.asarray(RNG.randint(0, CFG.vocab_size, (2, 32)))
SEGMENTS = jnp.asarray(np.repeat([[1, 1, 2, 3], [1, 2, 2, 2]], 8, axis=1))  # a document starts at 16 (a chunk edge)


def _layer(cfg):
    return linear_attn.LinearAttention(cfg, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("decay", ["none", "retention"])
@pytest.mark.parametrize("feature_map", ["elu1", "silu"])
def test_the_linear_layer_equals_its_quadratic_reference(decay, feature_map):
    cfg = CFG.replace(linear_decay=decay, linear_feature_map=feature_map)
    layer = _layer(cfg)
    x = jnp.asarray(RNG.normal(size=(2, 32, cfg.hidden_size)), jnp.float32)
    seq = sequence_info(x.shape[:2], SEGMENTS, None, max_lag=1)

    def by_reference(params, x):
        w = linear_attn.group_major(params, cfg, x.dtype)
        q, k, v = linear_attn.project(x, w, cfg)
        return linear_attn.output(la.reference(q, k, v, SEGMENTS, log_decay=w["log_decay"]), x, w, cfg)

    graphdef, state = nnx.split(layer)

    def by_layer(params, x):
        return nnx.merge(graphdef, params)(x, seq)

    params = layer.params()
    probe = jnp.asarray(RNG.normal(size=x.shape), jnp.float32)
    want, want_grads = jax.value_and_grad(lambda p, x: jnp.sum(by_reference(p, x) * probe), (0, 1))(params, x)
    got, got_grads = jax.value_and_grad(lambda p, x: jnp.sum(by_layer(p, x) * probe), (0, 1))(state, x)
    got_grads = ({name: g for name, g in nnx.to_pure_dict(got_grads[0]).items()}, got_grads[1])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for w, g in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-5)


def test_retention_decay_is_retnets_per_head_gamma():
    decay = np.exp(np.asarray(linear_attn.log_decay(CFG)))
    np.testing.assert_allclose(decay, 1 - 2.0 ** (-5 - np.arange(CFG.num_attention_heads)), rtol=1e-6)
    assert linear_attn.log_decay(CFG.replace(linear_decay="none")) is None


def test_the_stack_scans_over_the_patterns_unit_with_the_unrolled_values_and_gradients():
    assert repeating_unit(CFG.layer_kinds) == "LLC" and repeating_unit("CCCC") == "C"
    m = Zaya(CFG, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params, scan, unroll):
        hidden, choices = nnx.merge(graphdef, params, rest).hidden_states(IDS, SEGMENTS, scan=scan, unroll=unroll)
        return jnp.sum(hidden ** 2), choices

    run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(1, 2))
    (value, choices), grads = run(params, True, 1)
    assert choices.shape == (CFG.num_hidden_layers, *IDS.shape)
    for scan, unroll in ((False, 1), (True, 2)):
        (value_u, choices_u), grads_u = run(params, scan, unroll)
        np.testing.assert_allclose(value, value_u, rtol=1e-6)
        np.testing.assert_array_equal(choices, choices_u)
        for (path, g), (_, g_u) in zip(grads.flat_state(), grads_u.flat_state()):
            scale = float(np.abs(g.get_value()).max())  # fp32 sums in another order: relative to the array's size
            np.testing.assert_allclose(g.get_value(), g_u.get_value(), rtol=1e-4, atol=1e-4 * scale, err_msg=str(path))
    linear_grad = grads["layers"]["linear_attn"]["wq"].get_value()
    assert linear_grad.shape[0] == 4 and np.all(np.abs(linear_grad).sum(axis=(1, 2, 3)) > 0)  # every L layer learns


def test_a_packed_document_gets_what_it_gets_alone():
    m = Zaya(CFG, rngs=nnx.Rngs(0))
    packed = m(IDS, SEGMENTS)
    # Row 1 holds document 1 in columns 0..7, then document 2: run document 2 alone.
    alone = m(IDS[1:, 8:], jnp.ones((1, 24), jnp.int32))
    np.testing.assert_allclose(packed[1:, 8:], alone, rtol=2e-5, atol=2e-5)


def test_the_per_layer_form_names_each_layers_own_mixer_and_round_trips():
    m = Zaya(CFG, rngs=nnx.Rngs(0))
    names = expected_shapes(CFG)
    for i, kind in enumerate(CFG.layer_kinds):
        assert (f"layers/{i}/linear_attn/wq" in names) == (kind == "L")
        assert (f"layers/{i}/attn/wq" in names) == (kind == "C")
        assert f"layers/{i}/moe/router/down" in names
    arrays = per_layer(flat_arrays(m), CFG.layer_kinds)
    assert set(arrays) == set(names)
    np.testing.assert_array_equal(arrays["layers/3/linear_attn/wg"], flat_arrays(m)["layers/linear_attn/wg"][2])
    rebuilt = build_model(CFG, arrays)
    np.testing.assert_array_equal(rebuilt(IDS, SEGMENTS), m(IDS, SEGMENTS))


@pytest.mark.parametrize("change, words", [
    ({"layer_pattern": "LXC"}, "model.layer_pattern must be a non-empty string"),
    ({"layer_pattern": ""}, "model.layer_pattern must be a non-empty string"),
    ({"layer_pattern": "LLLC"}, "must be a multiple of the length of model.layer_pattern"),
    ({"linear_decay": "alibi"}, "model.linear_decay must be one of"),
    ({"linear_feature_map": "relu"}, "model.linear_feature_map must be one of"),
])
def test_bad_hybrid_settings_are_refused_in_words(change, words):
    with pytest.raises(ZayaError, match=words):
        CFG.replace(**change)


def test_a_hybrid_model_has_no_hugging_face_form():
    with pytest.raises(ZayaError, match="linear-attention layers, which Hugging Face's ZAYA does not have"):
        to_hf_dict(CFG)
    assert to_hf_dict(CFG.replace(layer_pattern="C"))["model_type"] == "zaya"


def test_zaya_jax_load_reads_a_hybrid_checkpoint_and_to_hf_refuses_it_in_one_line(tmp_path, capsys):
    import zaya_jax
    from zaya_jax.checkpoint import orbax_store

    m = Zaya(CFG, rngs=nnx.Rngs(0))
    arrays = {k: np.asarray(v) for k, v in per_layer(flat_arrays(m), CFG.layer_kinds).items()}
    ckpt = str(tmp_path / "hybrid")
    orbax_store.save_groups(ckpt, CFG, [arrays])
    loaded = zaya_jax.load(ckpt)
    assert loaded.cfg.layer_pattern == "LLC"
    np.testing.assert_array_equal(loaded(IDS, SEGMENTS), m(IDS, SEGMENTS))
    assert main(["convert", "to-hf", f"--ckpt={ckpt}", f"--out={tmp_path}/hf", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no linear-attention layers, so it has no HF form" in err[0], err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


@pytest.mark.parametrize("flag, words", [
    ("--config.model.layer_pattern=LXC", "model.layer_pattern must be a non-empty string"),
    ("--config.model.layer_pattern=LLL", "must be a multiple of the length of model.layer_pattern"),
    ("--config.model.linear_decay=alibi", "model.linear_decay must be one of"),
    ("--config.model.linear_kernel=fast", "linear_kernel"),
])
def test_zaya_train_refuses_a_bad_hybrid_setting_in_one_line_with_status_2(tmp_path, capsys, flag, words):
    code = main(["train", f"--config={TINY}", f"--workdir={tmp_path}/run", flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], (code, err)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_checkpoint_from_before_the_hybrid_fields_resumes_as_the_all_cca_model_it_is():
    """A run's checkpoint written before `model.layer_pattern` existed records no hybrid field: it is
    the all-CCA model (every field's default), so a default config resumes it and a hybrid refuses it."""
    before = {k: v for k, v in dataclasses.asdict(preset("tiny")).items() if k not in HYBRID_FIELDS}
    saved = {"model": before, "state_shapes": {}}
    check_compatible(saved, {"model": dataclasses.asdict(preset("tiny")), "state_shapes": {}}, "ckpt/300")
    hybrid = dataclasses.asdict(preset("tiny", layer_pattern="LC"))
    with pytest.raises(ZayaError, match=r"^checkpoint ckpt/300 holds a different model: model.layer_pattern is 'C' "
                                        r"there but 'LC' in this config"):
        check_compatible(saved, {"model": hybrid, "state_shapes": {}}, "ckpt/300")
