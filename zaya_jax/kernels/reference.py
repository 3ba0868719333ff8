"""Plain-jnp references of the three hot-path kernels: the semantics every backend must match.

They are written for clarity, not speed: attention materialises the [S, S] logits, the grouped
matmul runs every row through every group's weight and keeps its own. Gradients come from
autodiff, which makes them the reference for the hand-written backward kernels too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q, k, v, segment_ids=None, *, causal=True, scale=None, kv_segment_ids=None, q_offset=0):
    """softmax(q kᵀ · scale + mask) v with query head i reading KV head i // (nq / nk).

    q: [B, Sq, nq, d]; k, v: [B, Sk, nk, d]; segment_ids: int32 [B, Sq] or None (a query sees only
    keys of its own segment; the keys' ids are `kv_segment_ids`, default the same array). Query i
    sits at sequence index `q_offset + i` (an int or a traced scalar) among keys 0..Sk-1: the form
    a sequence shard's local queries take against all-gathered keys. Returns [B, Sq, nq, d] in q's
    dtype; logits and softmax in fp32.
    """
    batch, q_len, nq, dim = q.shape
    nk = k.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    qg = q.reshape(batch, q_len, nk, nq // nk, dim)
    logits = jnp.einsum("bsngd,btnd->bngst", qg, k, preferred_element_type=jnp.float32) * scale
    mask = attention_mask(batch, q_len, k.shape[1], segment_ids, kv_segment_ids, causal, q_offset)
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bngst,btnd->bsngd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, q_len, nq, dim).astype(q.dtype)


def attention_mask(batch: int, q_len: int, k_len: int, segment_ids, kv_segment_ids=None, causal: bool = True,
                   q_offset=0) -> jax.Array:
    """Boolean [B, Sq, Sk] (query, key): causal (key index ≤ q_offset + query index) and/or same-segment."""
    mask = jnp.ones((1, q_len, k_len), bool)
    if causal:
        mask = mask & (jnp.arange(k_len)[None, None, :] <= q_offset + jnp.arange(q_len)[None, :, None])
    if segment_ids is not None:
        keys = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (segment_ids[:, :, None] == keys[:, None, :])
    return jnp.broadcast_to(mask, (batch, q_len, k_len))


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """out[r] = lhs[r] @ rhs[g(r)] where rows are sorted by group; rows past the groups are 0.

    lhs: [M, K]; rhs: [G, K, N]; group_sizes: int32 [G] with sum ≤ M. Returns [M, N].
    """
    out_dtype = preferred_element_type or lhs.dtype
    row_group = row_groups(group_sizes, lhs.shape[0])
    every = jnp.einsum("mk,gkn->gmn", lhs, rhs, preferred_element_type=jnp.float32)
    onehot = row_group[None, :] == jnp.arange(rhs.shape[0])[:, None]
    return jnp.einsum("gmn,gm->mn", every, onehot.astype(jnp.float32)).astype(out_dtype)


def grouped_matmul_transposed(lhs, dout, group_sizes, num_groups: int, *, preferred_element_type=None):
    """The weight gradient of `grouped_matmul`: out[g] = lhs[rows of g]ᵀ @ dout[rows of g], [G, K, N]."""
    out_dtype = preferred_element_type or lhs.dtype
    row_group = row_groups(group_sizes, lhs.shape[0])
    onehot = (row_group[None, :] == jnp.arange(num_groups)[:, None]).astype(lhs.dtype)
    return jnp.einsum("gm,mk,mn->gkn", onehot, lhs, dout, preferred_element_type=jnp.float32).astype(out_dtype)


def row_groups(group_sizes, num_rows: int) -> jax.Array:
    """The group of each row, int32 [M]; rows past sum(group_sizes) get G (no group)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(num_rows), side="right").astype(jnp.int32)


def rms_norm(x, weight, *, eps, out_dtype=None):
    """HF ZayaRMSNorm: fp32 statistics, weight applied, result in `out_dtype` (default x's)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(out_dtype or x.dtype)
