"""Logit parity with transformers' ZayaForCausalLM (fp32), including packed rows."""

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")  # the reference side; absent where no CPU torch wheel exists (Python 3.12 CI)
from hf_reference import hf_logits, hf_model, hf_state
from zaya_jax.checkpoint import hf_mapping
from zaya_jax.config import ModelConfig, preset
from zaya_jax.model.state import build_model, expected_shapes

CONFIGS = {
    # g = 1, smallest kernels, 2 layers
    "g1": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=4, cca_time0=2, cca_time1=2),
    # g = 2, longer depthwise kernel, odd expert count, 3 layers
    "g2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=3, cca_time0=3, cca_time1=2,
               num_hidden_layers=3, moe_intermediate_size=48),
    # g = 4 as in ZAYA1, long grouped kernel, full-width RoPE
    "g4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8, cca_time0=2, cca_time1=4,
               partial_rotary_factor=1.0),
    # one KV head: the current/delayed value halves split a single head; kernel-1 depthwise conv
    "nk1": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=2, cca_time0=1, cca_time1=3,
                num_hidden_layers=3),
}
SHAPES = {"g1": (2, 13), "g2": (3, 19), "g4": (2, 11), "nk1": (2, 23)}


def convert_state(cfg: ModelConfig, state: dict) -> dict:
    shapes = expected_shapes(cfg)
    arrays = {}
    for group in hf_mapping.grouped_rules(cfg).values():
        arrays.update(hf_mapping.convert_group_to_ours(group, state.__getitem__, shapes, "hf"))
    return arrays


def pair(name: str, seed: int = 0):
    cfg = preset("tiny", **CONFIGS[name])
    hf = hf_model(cfg, seed)
    return cfg, hf, build_model(cfg, convert_state(cfg, hf_state(hf)))


def assert_close_logits(ours, ref, rel=1e-4):
    scale = float(np.abs(ref).max())
    err = float(np.abs(np.asarray(ours) - ref).max())
    assert err <= rel * scale, f"max |Δlogit| {err:.3g} > {rel} × logit scale {scale:.3g}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_hf(name):
    cfg, hf, ours = pair(name)
    ids = np.random.RandomState(1).randint(0, cfg.vocab_size, SHAPES[name])
    assert_close_logits(ours(jnp.asarray(ids)), hf_logits(hf, ids))


def test_random_init_exercises_router_paths():
    """The randomised biases must make the skip class and bias-changed choices actually happen."""
    cfg, hf, ours = pair("g4")
    ids = np.random.RandomState(2).randint(0, cfg.vocab_size, (4, 32))
    _, routing = ours.hidden_states(jnp.asarray(ids))
    choices = np.asarray(routing.expert)
    assert (choices == cfg.num_experts).any(), "skip class never chosen"
    assert len(np.unique(choices)) > 3
    assert_close_logits(ours(jnp.asarray(ids)), hf_logits(hf, ids))


def test_packed_row_matches_documents_alone():
    """Two documents in one row: each gets the logits HF gives it alone (attention, convs, delayed v)."""
    cfg, hf, ours = pair("g2", seed=3)
    rng = np.random.RandomState(4)
    doc_a, doc_b = rng.randint(0, cfg.vocab_size, 9), rng.randint(0, cfg.vocab_size, 14)
    row = np.concatenate([doc_a, doc_b])[None]
    segments = np.concatenate([np.full(9, 1), np.full(14, 2)])[None]
    packed = np.asarray(ours(jnp.asarray(row), segment_ids=jnp.asarray(segments)))
    assert_close_logits(packed[:, :9], hf_logits(hf, doc_a[None]))
    assert_close_logits(packed[:, 9:], hf_logits(hf, doc_b[None]))


def test_explicit_positions_equal_derived_positions():
    cfg, _, ours = pair("g1")
    ids = jnp.asarray(np.random.RandomState(5).randint(0, cfg.vocab_size, (1, 12)))
    segments = jnp.asarray([[1] * 5 + [2] * 7])
    positions = jnp.asarray([list(range(5)) + list(range(7))])
    a = ours(ids, segment_ids=segments)
    b = ours(ids, segment_ids=segments, positions=positions)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_policy_tracks_float32():
    """`compute_dtype=bfloat16` really computes in bf16 (the logits move off fp32's), and only as far
    as bf16's precision explains."""
    cfg, _, ours = pair("g4")
    ids = jnp.asarray(np.random.RandomState(6).randint(0, cfg.vocab_size, (2, 16)))
    hidden, ref_routing = ours.hidden_states(ids)
    ref = np.asarray(ours.logits(hidden))
    ours.cfg = ours.cfg.replace(compute_dtype="bfloat16")
    hidden, low_routing = ours.hidden_states(ids)
    low = ours.logits(hidden)
    assert low.dtype == jnp.float32  # the LM head is an fp32 island
    # A flipped expert choice is a discrete jump no roundoff bound covers; this input has none.
    np.testing.assert_array_equal(np.asarray(low_routing.expert), np.asarray(ref_routing.expert))
    scale = float(np.abs(ref).max())
    err = float(np.abs(np.asarray(low) - ref).max())
    u = 2.0 ** -8  # bf16's unit roundoff: 8 significant bits, each rounding off by at most 2^-8 relative
    # (a) bf16 was used: fp32's own rounding (2^-24, a few ulps after reordered sums) moves logits by
    # ~1e-7 of their scale; bf16 rounding in every block moves them by a fair part of u (measured 0.7u).
    # u/16 sits an order of magnitude under the latter and three over the former.
    assert err > u / 16 * scale, f"max |Δlogit| {err:.3g}: bf16 logits are fp32's ({scale=:.3g})"
    # (b) no more than bf16 explains. Each block rounds its norm output, its weights, the projections'
    # and experts' outputs and the attention weights to bf16: ~8 roundings a block, 16 on this 2-layer
    # model's deepest path. First-order relative errors add, like a random walk for independent
    # roundings: ~sqrt(16)·u = 4u of the logit scale (16u only if every rounding lined up; 10% of the
    # scale, a far looser bound, is 26u). Measured: 0.7u.
    assert err <= 4 * u * scale, f"max |Δlogit| {err:.3g} > 4·2^-8 × logit scale {scale:.3g}"
