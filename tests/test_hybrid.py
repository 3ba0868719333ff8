"""Hybrid ZAYA models (`model.layer_pattern`): the linear-attention layer against a token-by-token
recurrence written from its equations, the scan over the pattern's unit, documents kept apart, the per-layer interchange form,
and the config's refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zaya_jax.cli import main
from zaya_jax.config import HYBRID_FIELDS, preset, to_hf_dict
from zaya_jax.errors import ZayaError
from zaya_jax.model import Zaya
from zaya_jax.model import linear_attn
from zaya_jax.model.layer_stack import per_layer, repeating_unit
from zaya_jax.model.segments import sequence_info
from zaya_jax.model.state import build_model, expected_shapes, flat_arrays
from zaya_jax.train.checkpoints import check_compatible
from paths import TINY


CFG = preset("tiny", num_hidden_layers=6, layer_pattern="LLC", linear_decay="retention")
RNG = np.random.RandomState(0)
IDS = jnp.asarray(RNG.randint(0, CFG.vocab_size, (2, 32)))
SEGMENTS = jnp.asarray(np.repeat([[1, 1, 2, 3], [1, 2, 2, 2]], 8, axis=1))  # a document starts at 16 (a chunk edge)


def _layer(cfg):
    return linear_attn.LinearAttention(cfg, rngs=nnx.Rngs(1))


def _recurrence_torch(x, w, segments, feature_map, decay, eps):
    """The layer from its docstring's equations alone, in float64 torch, token by token:
    S_t = λ_h·S_{t−1} + φ(k_t)ᵀ v_t (zeroed where a document starts), o_t = q_t S_t with
    q = φ(x Wq)·d^-½ (query head h reading KV head h // (nq/nk)), λ_h = 1 − 2^(−5−h) for
    retention, then (RMSNorm_head(o) ⊙ w_norm) ⊙ silu(x Wg), then Wo."""
    import torch

    phi = {"elu1": lambda t: torch.nn.functional.elu(t) + 1, "silu": torch.nn.functional.silu,
           "identity": lambda t: t}[feature_map]
    batch, length, _ = x.shape
    nq, d = w["wq"].shape[1:]
    group = nq // w["wk"].shape[1]
    q = phi(torch.einsum("bsh,hnd->bsnd", x, w["wq"])) * d ** -0.5
    k = phi(torch.einsum("bsh,hnd->bsnd", x, w["wk"])).repeat_interleave(group, dim=2)
    v = torch.einsum("bsh,hnd->bsnd", x, w["wv"]).repeat_interleave(group, dim=2)
    lam = (1 - 2.0 ** (-5.0 - torch.arange(nq, dtype=torch.float64)) if decay == "retention"
           else torch.ones(nq, dtype=torch.float64))
    state = torch.zeros(batch, nq, d, d, dtype=torch.float64)
    outs = []
    for t in range(length):
        starts = torch.ones(batch, dtype=torch.bool) if t == 0 else segments[:, t] != segments[:, t - 1]
        state = torch.where(starts[:, None, None, None], 0.0, state)
        state = lam[None, :, None, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bnd,bnde->bne", q[:, t], state))
    o = torch.stack(outs, dim=1)  # [B, S, nq, d]
    o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * w["out_norm"]
    y = o * torch.nn.functional.silu(torch.einsum("bsh,hnd->bsnd", x, w["wg"]))
    return torch.einsum("bsnd,ndh->bsh", y, w["wo"])


@pytest.mark.parametrize("decay, feature_map", [("retention", "elu1"), ("none", "silu")])
def test_the_linear_layer_equals_a_token_by_token_recurrence_written_from_its_equations(decay, feature_map):
    """Values and gradients (every weight, and x) of the layer against `_recurrence_torch`, which
    reads only the raw weights. 80 tokens: two of the xla backend's 64-token chunks, with documents
    starting inside the first chunk, across the chunk edge and inside the second."""
    torch = pytest.importorskip("torch")
    cfg = CFG.replace(linear_decay=decay, linear_feature_map=feature_map)
    rng = np.random.RandomState(3)
    length, h = 80, cfg.hidden_size
    segments = np.ones((2, length), np.int32)
    segments[0, 23:], segments[0, 70:] = 2, 3  # document 2 spans the chunk edge at 64
    segments[1, 64:] = 2  # a document starting on the edge
    # Projections of size O(1) (weights ~ 1/sqrt(fan_in)) so the feature maps work off their linear part;
    # a random norm weight so a dropped one shows.
    raw = {name: rng.normal(size=shape) / np.sqrt(shape[0] if name != "wo" else shape[0] * shape[1])
           for name, shape in {"wq": (h, 4, 16), "wk": (h, 2, 16), "wv": (h, 2, 16), "wg": (h, 4, 16),
                               "wo": (4, 16, h)}.items()}
    raw["out_norm"] = 1 + 0.3 * rng.normal(size=(4, 16))
    x = rng.normal(size=(2, length, h))
    probe = rng.normal(size=(2, length, h))

    layer = _layer(cfg)
    for name, value in raw.items():
        getattr(layer, name).set_value(jnp.asarray(value, jnp.float32))
    graphdef, state = nnx.split(layer)
    seq = sequence_info(x.shape[:2], jnp.asarray(segments), None, max_lag=1)

    def loss(params, x):
        out = nnx.merge(graphdef, params)(x, seq)
        return jnp.sum(out * probe), out

    # One jit: the eager first call compiles each primitive on its own (~3x slower on CPU).
    (_, got), (got_w, got_x) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
        state, jnp.asarray(x, jnp.float32))
    got_w = nnx.to_pure_dict(got_w)

    w = {name: torch.tensor(value, requires_grad=True) for name, value in raw.items()}
    xt = torch.tensor(x, requires_grad=True)
    want = _recurrence_torch(xt, w, torch.tensor(segments), feature_map, decay, cfg.rms_norm_eps)
    (want * torch.tensor(probe)).sum().backward()
    want = want.detach().numpy()
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
    for name in raw:  # fp32 sums against float64 (measured ~5e-7): relative to each gradient's own size
        ref = w[name].grad.numpy()
        np.testing.assert_allclose(np.asarray(got_w[name]), ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=name)
    ref = xt.grad.numpy()
    np.testing.assert_allclose(np.asarray(got_x), ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg="x")


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
        return jnp.sum(hidden ** 2), choices.expert

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
