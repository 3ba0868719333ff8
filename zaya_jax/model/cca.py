"""Compressed Convolutional Attention (CCA) as used by ZAYA1 (the ZAYA1 technical report; HF's
`ZayaForCausalLM` is the reference implementation the tests compare against).

Query/key down-projections, two causal convolutions over `[q̃ ‖ k̃]` padded once (so the first
conv's bias reaches position 0 of the second), q/k mean residuals, fp32 QK L2-norm with a
per-KV-head linear temperature, partial rotate-half RoPE after the norm, values whose second
half comes from the previous token, causal GQA attention (the `model.attention_kernel` backend of
`zaya_jax.kernels.flash_attention`) and the output projection.

The math is written over *any whole set of KV groups*: `group_major` lays the weights out with
one group axis per array, `select_groups` cuts a run of groups from it, and `project` computes
q, k, v for those groups. One bucket holding every group is the single-device layer; the
tensor- and TSP-parallel schedules (`parallel/attention_schedule.py`, reached through the `Schedule`
the program hands the model) run the same functions on their groups. (CCA's mean residuals mix
a group's query heads, so groups are never split.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax import kernels
from zaya_jax.config import ModelConfig
from zaya_jax.model import kv_groups
from zaya_jax.model.params import constant, make_param, normal
from zaya_jax.model.segments import SequenceInfo, shift_right
from zaya_jax.model.schedule import LOCAL, Schedule


def rope_tables(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, S, rotary_dim] in fp32, rotate-half layout (frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on the first `rotary_dim` channels of each head; x: [B, S, n, d]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    # [-x2, x1] as a reversal of the two halves, not a concatenate of slices: XLA's ROCm Triton
    # fusion emitter fails on that concatenate where the forward is not differentiated.
    halves = x_rot.reshape(*x_rot.shape[:-1], 2, rot // 2)
    sign = jnp.asarray([[-1.0], [1.0]], x.dtype)
    rotated = (jnp.flip(halves, axis=-2) * sign).reshape(x_rot.shape)
    x_rot = x_rot * cos[:, :, None] + rotated * sin[:, :, None]
    return jnp.concatenate([x_rot, x_pass], axis=-1)


def l2_normalize(x: jax.Array, scale: float) -> jax.Array:
    """scale · x / max(‖x‖, eps) in fp32, eps = fp32 machine epsilon as in HF."""
    x = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    return x * (scale / jnp.maximum(norm, jnp.finfo(jnp.float32).eps))


def look_back(cfg: ModelConfig) -> int:
    """CCA's look-back: the tokens before t that the layer reads at t (the two convolutions in
    series, and at least the delayed value's one); a sequence shard borrows this many rows."""
    return max(cfg.cca_time0 - 1 + cfg.cca_time1 - 1, 1)


def max_lag(cfg: ModelConfig) -> int:
    """The longest single shift the layer takes, ≤ the look-back (the lags its "same document" masks cover)."""
    return max(cfg.cca_time0, cfg.cca_time1, 2) - 1


# The layer's parameters and their logical axes (conv weights are tap-major: depthwise [t0, C],
# grouped [t1, heads, d_in, d_out], heads = [q heads ‖ k heads]).
PARAM_AXES = {
    "wq": ("embed", "heads", "head_dim"), "wk": ("embed", "kv_heads", "head_dim"),
    "wv_current": ("embed", "kv_half"), "wv_delayed": ("embed", "kv_half"),
    "conv_depthwise": ("conv_tap", "qk_channels"), "conv_depthwise_bias": ("qk_channels",),
    "conv_grouped": ("conv_tap", "qk_heads", "head_dim", "head_dim_out"), "conv_grouped_bias": ("qk_heads", "head_dim"),
    "temperature": ("kv_heads",), "wo": ("heads", "head_dim", "embed"),
}
# Group-major weights: entry -> (axis holding the KV groups, entries per group as (g, d) -> int),
# g = query heads per KV group, d = head_dim.
GROUP_AXES = {
    "wq": (1, lambda g, d: g), "wk": (1, lambda g, d: 1), "wv": (1, lambda g, d: d),
    "dw_q": (1, lambda g, d: g * d), "dw_k": (1, lambda g, d: d),
    "db_q": (0, lambda g, d: g * d), "db_k": (0, lambda g, d: d),
    "cg_q": (1, lambda g, d: g), "cg_k": (1, lambda g, d: 1),
    "cgb_q": (0, lambda g, d: g), "cgb_k": (0, lambda g, d: 1),
    "temperature": (0, lambda g, d: 1), "wo": (0, lambda g, d: g),
}
# The parameter each group-major entry is cut from (wv also takes wv_delayed, laid out alike).
SOURCE = {"wq": "wq", "wk": "wk", "wv": "wv_current", "dw_q": "conv_depthwise", "dw_k": "conv_depthwise",
          "db_q": "conv_depthwise_bias", "db_k": "conv_depthwise_bias", "cg_q": "conv_grouped",
          "cg_k": "conv_grouped", "cgb_q": "conv_grouped_bias", "cgb_k": "conv_grouped_bias",
          "temperature": "temperature", "wo": "wo"}


class CCAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h, nq, nk, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        shapes = {"wq": (h, nq, d), "wk": (h, nk, d), "wv_current": (h, cfg.value_half),
                  "wv_delayed": (h, cfg.value_half), "conv_depthwise": (cfg.cca_time0, cfg.qk_channels),
                  "conv_depthwise_bias": (cfg.qk_channels,), "conv_grouped": (cfg.cca_time1, nq + nk, d, d),
                  "conv_grouped_bias": (nq + nk, d), "temperature": (nk,), "wo": (nq, d, h)}
        # HF initialises the temperature to 0 as a load-time placeholder; 1 is the training init.
        inits = {"conv_depthwise_bias": constant(0.0), "conv_grouped_bias": constant(0.0), "temperature": constant(1.0)}
        for name, axes in PARAM_AXES.items():
            setattr(self, name, make_param(rngs, inits.get(name, normal(cfg.initializer_range)), shapes[name], axes))

    def params(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in PARAM_AXES}

    def __call__(self, x: jax.Array, seq: SequenceInfo, schedule: Schedule = LOCAL) -> jax.Array:
        out = schedule.attention(self.params(), x, seq, self.cfg)
        if out is not None:
            return out
        w = group_major(self.params(), self.cfg, x.dtype)
        q, k, v = project(x, w, seq, self.cfg, first_group=0)
        out = self._attend(q, k, v, seq.segment_ids, schedule)
        return jnp.einsum("bsnd,ndh->bsh", out, w["wo"])

    def _attend(self, q, k, v, segment_ids, schedule: Schedule):
        backend = self.cfg.attention_kernel

        def attend(q, k, v, segment_ids=None):
            return kernels.flash_attention(q, k, v, segment_ids=segment_ids, backend=backend)

        batched = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
        return schedule.run_kernel("attention", backend, attend, batched)


def group_major(p: dict[str, jax.Array], cfg: ModelConfig, dtype) -> dict[str, jax.Array]:
    """The layer's weights as `GROUP_AXES` entries, cast to `dtype` (the temperature stays fp32).

    wq/wk/wo/temperature may already be a run of groups; the rest must be whole (they are cut
    by the full head counts of `cfg`).
    """
    nq, d = cfg.num_attention_heads, cfg.head_dim
    depthwise, grouped = p["conv_depthwise"], p["conv_grouped"]
    w = {
        "wq": p["wq"], "wk": p["wk"], "wo": p["wo"],
        "wv": jnp.concatenate([p["wv_current"], p["wv_delayed"]], axis=1),
        "dw_q": depthwise[:, :nq * d], "dw_k": depthwise[:, nq * d:],
        "db_q": p["conv_depthwise_bias"][:nq * d], "db_k": p["conv_depthwise_bias"][nq * d:],
        "cg_q": grouped[:, :nq], "cg_k": grouped[:, nq:],
        "cgb_q": p["conv_grouped_bias"][:nq], "cgb_k": p["conv_grouped_bias"][nq:],
    }
    w = {k: v.astype(dtype) for k, v in w.items()}
    w["temperature"] = p["temperature"].astype(jnp.float32)
    return w


def select_groups(w: dict[str, jax.Array], first, count: int, cfg: ModelConfig, names=None) -> dict[str, jax.Array]:
    """KV groups [first, first + count) of the group-major entries `names` (default all);
    `first` may be traced (a device's rank)."""
    g, d = cfg.kv_groups, cfg.head_dim
    if isinstance(first, int) and first == 0 and count == w["wk"].shape[1] and names is None:
        return w  # every group this array holds
    return kv_groups.select(w, first, count, {n: (axis, width(g, d)) for n, (axis, width) in GROUP_AXES.items()},
                            names)


def project(x: jax.Array, w: dict[str, jax.Array], seq: SequenceInfo, cfg: ModelConfig, first_group, drop: int = 0):
    """q, k [B, S, n, d] in x's dtype and v [B, S, nk, d] for the KV groups `w` holds, the first
    of which is group `first_group` of the layer (it decides which value columns are delayed).

    The first `drop` rows are context only (a sequence shard's look-back rows): they feed the convolutions
    and the delayed values and are cut before the norms.
    """
    dt = x.dtype
    d = cfg.head_dim
    q_lat = jnp.einsum("bsh,hnd->bsnd", x, w["wq"])
    k_lat = jnp.einsum("bsh,hnd->bsnd", x, w["wk"])
    q_res, k_res = _mean_residuals(q_lat, k_lat, cfg.kv_groups)
    # One pass of both convolutions over [q̃ ‖ k̃]: per channel and per head, so the q and k
    # weight slices simply sit side by side again.
    taps = [jnp.concatenate([w[f"{name}_q"], w[f"{name}_k"]], axis=GROUP_AXES[f"{name}_q"][0])
            for name in ("dw", "db", "cg", "cgb")]
    mixed = _convolve(jnp.concatenate([q_lat, k_lat], axis=2), *taps, seq).astype(jnp.float32)
    nq = q_lat.shape[2]
    q, k = mixed[:, :, :nq] + q_res, mixed[:, :, nq:] + k_res
    v = _values(x, w["wv"], seq, first_group * d, cfg.value_half)
    q, k, v = q[:, drop:], k[:, drop:], v[:, drop:]

    q = l2_normalize(q, d ** 0.5)
    k = l2_normalize(k, d ** 0.5) * w["temperature"][None, None, :, None]
    cos, sin = rope_tables(seq.positions[:, drop:], cfg.rotary_dim, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q.astype(dt), k.astype(dt), v.reshape(v.shape[:2] + (-1, d))


def _mean_residuals(q_lat: jax.Array, k_lat: jax.Array, g: int) -> tuple[jax.Array, jax.Array]:
    """q_res[i] = (q̃[i] + k̃[i // g]) / 2 and k_res[j] = mean of q_res over group j, in fp32."""
    batch, length, nk, d = k_lat.shape
    q_res = (q_lat.astype(jnp.float32).reshape(batch, length, nk, g, d)
             + k_lat.astype(jnp.float32)[:, :, :, None]) * 0.5
    return q_res.reshape(batch, length, nk * g, d), q_res.mean(axis=3)


def _convolve(c: jax.Array, w0, b0, w1, b1, seq: SequenceInfo) -> jax.Array:
    """Two causal convs over c: [B, S, heads, d], as if left-padded once by (t0-1)+(t1-1) zeros.

    The depthwise conv is per channel and the grouped one per head, so q and k heads are
    convolved separately with their own slices of the layer's `[q̃ ‖ k̃]` conv weights. With one
    pad, the depthwise output at a padded (or previous-document) position is its bias alone,
    and that is what the grouped conv sees there.
    """
    batch, length, heads, d = c.shape
    flat = c.reshape(batch, length, heads * d)
    t0 = w0.shape[0]
    c1 = b0 + sum(w0[k] * _masked_lag(flat, t0 - 1 - k, seq) for k in range(t0))
    c1 = c1.reshape(batch, length, heads, d)
    b0 = b0.reshape(heads, d)
    t1 = w1.shape[0]
    c2 = b1
    for k in range(t1):
        lag = t1 - 1 - k
        tap = jnp.where(seq.same_doc(lag)[:, :, None, None], shift_right(c1, lag), b0)
        c2 = c2 + jnp.einsum("bshi,hio->bsho", tap, w1[k])
    return c2


def _values(x: jax.Array, wv: jax.Array, seq: SequenceInfo, first_column, value_half: int) -> jax.Array:
    """Columns of [x_t Wvc ‖ x_{t-1} Wvd] starting at `first_column`: those at or past `value_half`
    are delayed, and zero at each document start."""
    v = x @ wv
    if isinstance(first_column, int):  # static: lag only the delayed columns
        split = min(max(value_half - first_column, 0), v.shape[-1])
        return jnp.concatenate([v[..., :split], _masked_lag(v[..., split:], 1, seq)], axis=-1)
    delayed = first_column + jnp.arange(v.shape[-1]) >= value_half
    return jnp.where(delayed, _masked_lag(v, 1, seq), v)


def _masked_lag(x: jax.Array, lag: int, seq: SequenceInfo) -> jax.Array:
    """x[t - lag] where that token is in t's document, else 0. x: [B, S, ...]."""
    same = seq.same_doc(lag)
    mask = same.reshape(same.shape + (1,) * (x.ndim - 2))
    return jnp.where(mask, shift_right(x, lag), jnp.zeros((), x.dtype))
