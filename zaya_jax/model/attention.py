"""Causal GQA softmax attention with packed-sequence masking (the plain-XLA reference path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """softmax(q kᵀ / √d + mask) v with query head i reading KV head i // (nq / nk).

    q: [B, S, nq, d]; k, v: [B, S, nk, d]; returns [B, S, nq, d] in q's dtype. Logits and
    softmax are fp32 whatever the compute dtype.
    """
    batch, seq, nq, dim = q.shape
    nk = k.shape[2]
    qg = q.reshape(batch, seq, nk, nq // nk, dim)
    logits = jnp.einsum("bsngd,btnd->bngst", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (dim ** -0.5)
    mask = jnp.tril(jnp.ones((seq, seq), bool))[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bngst,btnd->bsngd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, seq, nq, dim).astype(q.dtype)
