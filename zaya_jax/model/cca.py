"""Compressed Convolutional Attention (CCA) as used by ZAYA1 — DESIGN.md §3, zaya1.md §1.3.

Query/key down-projections, two causal convolutions over `[q̃ ‖ k̃]` padded once (so the first
conv's bias reaches position 0 of the second), q/k mean residuals, fp32 QK L2-norm with a
per-KV-head linear temperature, partial rotate-half RoPE after the norm, values whose second
half comes from the previous token, causal GQA attention (the `model.attention_kernel` backend of
`zaya_jax.kernels.flash_attention`) and the output projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax import kernels
from zaya_jax.config import ModelConfig
from zaya_jax.model.params import constant, make_param, normal
from zaya_jax.model.segments import SequenceInfo, shift_right
from zaya_jax.parallel.batch_map import run_kernel


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
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    x_rot = x_rot * cos[:, :, None] + rotated * sin[:, :, None]
    return jnp.concatenate([x_rot, x_pass], axis=-1)


def l2_normalize(x: jax.Array, scale: float) -> jax.Array:
    """scale · x / max(‖x‖, eps) in fp32, eps = fp32 machine epsilon as in HF."""
    x = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    return x * (scale / jnp.maximum(norm, jnp.finfo(jnp.float32).eps))


class CCAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h, nq, nk, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        init = normal(cfg.initializer_range)
        self.wq = make_param(rngs, init, (h, nq, d), ("embed", "heads", "head_dim"))
        self.wk = make_param(rngs, init, (h, nk, d), ("embed", "kv_heads", "head_dim"))
        self.wv_current = make_param(rngs, init, (h, cfg.value_half), ("embed", "kv_half"))
        self.wv_delayed = make_param(rngs, init, (h, cfg.value_half), ("embed", "kv_half"))
        # Conv weights in tap-major layout: depthwise [t0, C], grouped [t1, heads, d_in, d_out].
        self.conv_depthwise = make_param(rngs, init, (cfg.cca_time0, cfg.qk_channels), ("conv_tap", "qk_channels"))
        self.conv_depthwise_bias = make_param(rngs, constant(0.0), (cfg.qk_channels,), ("qk_channels",))
        self.conv_grouped = make_param(
            rngs, init, (cfg.cca_time1, nq + nk, d, d), ("conv_tap", "qk_heads", "head_dim", "head_dim_out")
        )
        self.conv_grouped_bias = make_param(rngs, constant(0.0), (nq + nk, d), ("qk_heads", "head_dim"))
        # HF initialises the temperature to 0 as a load-time placeholder; 1 is the training init.
        self.temperature = make_param(rngs, constant(1.0), (nk,), ("kv_heads",))
        self.wo = make_param(rngs, init, (nq, d, h), ("heads", "head_dim", "embed"))

    def __call__(self, x: jax.Array, seq: SequenceInfo) -> jax.Array:
        cfg = self.cfg
        dt = x.dtype
        batch, length, _ = x.shape
        nq, nk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_lat = jnp.einsum("bsh,hnd->bsnd", x, self.wq[...].astype(dt))
        k_lat = jnp.einsum("bsh,hnd->bsnd", x, self.wk[...].astype(dt))

        mixed = self._convolve(jnp.concatenate([q_lat, k_lat], axis=2), seq)
        q_res, k_res = self._mean_residuals(q_lat, k_lat)
        q = mixed[:, :, :nq].astype(jnp.float32) + q_res
        k = mixed[:, :, nq:].astype(jnp.float32) + k_res

        q = l2_normalize(q, d ** 0.5)
        k = l2_normalize(k, d ** 0.5) * self.temperature[...][None, None, :, None]
        cos, sin = rope_tables(seq.positions, cfg.rotary_dim, cfg.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        v = self._values(x, seq).reshape(batch, length, nk, d)
        out = self._attend(q.astype(dt), k.astype(dt), v, seq.segment_ids)
        return jnp.einsum("bsnd,ndh->bsh", out, self.wo[...].astype(dt))

    def _attend(self, q, k, v, segment_ids):
        backend = self.cfg.attention_kernel

        def attend(q, k, v, segment_ids=None):
            return kernels.flash_attention(q, k, v, segment_ids=segment_ids, backend=backend)

        batched = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
        return run_kernel("attention", backend, attend, batched)

    def _mean_residuals(self, q_lat: jax.Array, k_lat: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q_res[i] = (q̃[i] + k̃[i // g]) / 2 and k_res[j] = mean of q_res over group j, in fp32."""
        g = self.cfg.kv_groups
        batch, length, nk, d = k_lat.shape
        q_res = (q_lat.astype(jnp.float32).reshape(batch, length, nk, g, d)
                 + k_lat.astype(jnp.float32)[:, :, :, None]) * 0.5
        return q_res.reshape(batch, length, nk * g, d), q_res.mean(axis=3)

    def _convolve(self, c: jax.Array, seq: SequenceInfo) -> jax.Array:
        """Two causal convs over c: [B, S, heads, d], as if left-padded once by (t0-1)+(t1-1) zeros.

        With one pad, the depthwise output at a padded (or previous-document) position is its
        bias alone, and that is what the grouped conv sees there.
        """
        dt = c.dtype
        batch, length, heads, d = c.shape
        flat = c.reshape(batch, length, heads * d)
        w0, b0 = self.conv_depthwise[...].astype(dt), self.conv_depthwise_bias[...].astype(dt)
        t0 = w0.shape[0]
        c1 = b0 + sum(
            w0[k] * _masked_lag(flat, t0 - 1 - k, seq) for k in range(t0)
        )
        c1 = c1.reshape(batch, length, heads, d)
        b0 = b0.reshape(heads, d)
        w1, b1 = self.conv_grouped[...].astype(dt), self.conv_grouped_bias[...].astype(dt)
        t1 = w1.shape[0]
        c2 = b1
        for k in range(t1):
            lag = t1 - 1 - k
            tap = jnp.where(seq.same_doc(lag)[:, :, None, None], shift_right(c1, lag), b0)
            c2 = c2 + jnp.einsum("bshi,hio->bsho", tap, w1[k])
        return c2

    def _values(self, x: jax.Array, seq: SequenceInfo) -> jax.Array:
        """[x_t Wvc ‖ x_{t-1} Wvd]; the delayed half is zero at each document start."""
        dt = x.dtype
        current = x @ self.wv_current[...].astype(dt)
        delayed = x @ self.wv_delayed[...].astype(dt)
        return jnp.concatenate([current, _masked_lag(delayed, 1, seq)], axis=-1)


def _masked_lag(x: jax.Array, lag: int, seq: SequenceInfo) -> jax.Array:
    """x[t - lag] where that token is in t's document, else 0. x: [B, S, ...]."""
    same = seq.same_doc(lag)
    mask = same.reshape(same.shape + (1,) * (x.ndim - 2))
    return jnp.where(mask, shift_right(x, lag), jnp.zeros((), x.dtype))
