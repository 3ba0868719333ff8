"""LASP-2: linear attention over a sequence split into one contiguous chunk per device.

Call inside `shard_map` over the sequence axis. Each device reduces its chunk to its memory
state (`kernels.linear_attention.chunk_state`, d_k × d_v per head), one all-gather hands every
device every chunk's state, and each combines those before its own (a masked, decayed prefix
sum that stops at document starts) with its chunk's own quadratic attention. The all-gather's
bytes do not depend on the sequence length; its transpose in the backward is one
reduce-scatter of the states' gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zaya_jax.kernels import linear_attention as la


def lasp2(q, k, v, segment_ids, chunk_ends, *, axis: str, log_decay=None):
    """This device's [B, C, nq, dv] output. q [B, C, nq, dk], k [B, C, nk, dk], v [B, C, nk, dv] and
    segment_ids [B, C] are its chunk; chunk_ends [B, W]: the segment id of every chunk's last token
    (the same on every device: layer-independent, so computed once per step, not gathered per layer)."""
    nq, length = q.shape[2], q.shape[1]
    own = la.chunk_state(k, v, segment_ids, log_decay, nq)
    states = jax.lax.all_gather(own, axis, axis=1)  # [B, W, nk, g, dk, dv]: the one collective
    rank = jax.lax.axis_index(axis)
    entering = jnp.take(la.entering_states(states, chunk_ends, log_decay, nq, length), rank, axis=1)
    previous_end = jnp.where(rank > 0, jnp.take(chunk_ends, rank - 1, axis=1), -1)
    out = la.intra_chunk(q, k, v, segment_ids, log_decay) + la.from_state(q, entering, segment_ids, previous_end,
                                                                         log_decay)
    return out.astype(q.dtype)
