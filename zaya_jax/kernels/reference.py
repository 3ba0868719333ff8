"""Plain-jnp references of the three hot-path kernels: the semantics every backend must match.

They are written for clarity, not speed: attention materialises the [S, S] logits, the grouped
matmul runs every row through every group's weight and keeps its own. Gradients come from
autodiff, which makes them the reference for the hand-written backward kernels too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q, k, v, segment_ids=None, *, causal=True, scale=None):
    """softmax(q kᵀ · scale + mask) v with query head i reading KV head i // (nq / nk).

    q: [B, S, nq, d]; k, v: [B, S, nk, d]; segment_ids: int32 [B, S] or None (a query sees only
    keys of its own segment). Returns [B, S, nq, d] in q's dtype; logits and softmax in fp32.
    """
    batch, seq, nq, dim = q.shape
    nk = k.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    qg = q.reshape(batch, seq, nk, nq // nk, dim)
    logits = jnp.einsum("bsngd,btnd->bngst", qg, k, preferred_element_type=jnp.float32) * scale
    mask = attention_mask(batch, seq, segment_ids, causal)
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bngst,btnd->bsngd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, seq, nq, dim).astype(q.dtype)


def attention_mask(batch: int, seq: int, segment_ids, causal: bool) -> jax.Array:
    """Boolean [B, S, S] (query, key): causal and/or same-segment."""
    mask = jnp.ones((1, seq, seq), bool)
    if causal:
        mask = jnp.tril(mask)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return jnp.broadcast_to(mask, (batch, seq, seq))


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
