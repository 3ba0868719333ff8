"""The `xla` attention backend: `reference.attention` as dense XLA ops with a written-out backward.

Each KV head's query heads are one batched matmul: q is read as [B, nk, g, Sq, d] against k
[B, nk, Sk, d], so a GQA group shares its keys without repeating them and the logits need no
transpose between the matmuls. The forward keeps the fp32 probabilities; the backward is the
textbook softmax-attention gradient (dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O)), dQ = dS K,
dK = dSᵀ Q), five matmuls in the same layout. XLA's autodiff of the same forward (what
`jax.nn.dot_product_attention` gives) transposes the [.., Sq, Sk] tensors between its matmuls
and differentiates the mask and the max subtraction too: on CPU, where this is the default, the
written-out form is the faster one (`benchmarks/step_vs_eager.md`). The [Sq, Sk] logits are
materialised per head, as in every XLA form; the `pallas` kernel is the one that tiles them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zaya_jax.kernels import reference


def attention(q, k, v, segment_ids=None, *, causal=True, scale=None, kv_segment_ids=None, q_offset=None):
    """Same contract as `reference.attention` (q [B, Sq, nq, d], k/v [B, Sk, nk, d] → [B, Sq, nq, d])."""
    batch, q_len, _, dim = q.shape
    scale = dim ** -0.5 if scale is None else scale
    mask = reference.attention_mask(batch, q_len, k.shape[1], segment_ids, kv_segment_ids, causal,
                                    0 if q_offset is None else q_offset)
    return _attention(q, k, v, mask, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, mask, scale):
    return _forward(q, k, v, mask, scale)[0]


def _group_major(x, kv_heads: int):
    """[B, S, n, d] → [B, nk, n / nk, S, d]: a KV head's query heads side by side."""
    batch, length, heads, dim = x.shape
    return x.reshape(batch, length, kv_heads, heads // kv_heads, dim).transpose(0, 2, 3, 1, 4)


def _sequence_major(x):
    """[B, nk, g, S, d] → [B, S, nk · g, d]."""
    batch, kv_heads, g, length, dim = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(batch, length, kv_heads * g, dim)


def _forward(q, k, v, mask, scale):
    f32 = jnp.float32
    qg, kh, vh = _group_major(q, k.shape[2]), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    logits = jnp.einsum("bkgqd,bksd->bkgqs", qg, kh, preferred_element_type=f32) * scale
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(f32).min)
    probs = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = probs / probs.sum(axis=-1, keepdims=True)
    out = jnp.einsum("bkgqs,bksd->bkgqd", probs.astype(v.dtype), vh, preferred_element_type=f32)
    return _sequence_major(out).astype(q.dtype), (qg, kh, vh, probs, out)


def _backward(scale, residuals, dout):
    qg, kh, vh, probs, out = residuals
    f32, dt = jnp.float32, vh.dtype
    do = _group_major(dout, kh.shape[1])
    dv = jnp.einsum("bkgqs,bkgqd->bksd", probs.astype(dt), do.astype(dt), preferred_element_type=f32)
    dp = jnp.einsum("bkgqd,bksd->bkgqs", do.astype(dt), vh, preferred_element_type=f32)
    ds = (probs * (dp - jnp.sum(do.astype(f32) * out, axis=-1, keepdims=True)) * scale).astype(dt)
    dq = jnp.einsum("bkgqs,bksd->bkgqd", ds, kh, preferred_element_type=f32)
    dk = jnp.einsum("bkgqs,bkgqd->bksd", ds, qg, preferred_element_type=f32)
    return (_sequence_major(dq).astype(qg.dtype), dk.transpose(0, 2, 1, 3).astype(kh.dtype),
            dv.transpose(0, 2, 1, 3).astype(dt), None)


_attention.defvjp(_forward, _backward)
