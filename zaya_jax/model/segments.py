"""Packed-sequence metadata: positions and "same document as t-j" masks.

A packed row holds several documents, told apart by `segment_ids`. Every place where the model
looks back in time — the CCA convolution taps, the delayed value and attention — must stop at
the document boundary, so that a document gets the same result packed or alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SequenceInfo:
    segment_ids: jax.Array | None  # int32[B, S]; None = one document per row
    positions: jax.Array  # int32[B, S], RoPE positions
    lookback: tuple[jax.Array, ...]  # lookback[j]: bool[B, S], token t-j exists and is in t's document

    def same_doc(self, lag: int) -> jax.Array:
        return self.lookback[lag]


jax.tree_util.register_dataclass(SequenceInfo, data_fields=["segment_ids", "positions", "lookback"], meta_fields=[])


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Restart positions at 0 at each document start."""
    seq = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def sequence_info(
    shape: tuple[int, int], segment_ids: jax.Array | None, positions: jax.Array | None, max_lag: int,
    index: jax.Array | None = None,
) -> SequenceInfo:
    """Build the masks for lags 0..max_lag once per forward; every layer shares them.

    `index` (int32 [S], or [B, S] when rows hold different chunks) is each column's place in the
    whole sequence when the rows are a shard of it (with look-back rows in front); token t-j
    exists where index - j >= 0. Default 0..S-1. Positions derived from `segment_ids` assume the
    columns are in sequence order: a permuted (zigzag) batch carries its own.
    """
    batch, seq = shape
    idx = jnp.arange(seq, dtype=jnp.int32) if index is None else index
    if positions is None:
        positions = (
            positions_from_segments(segment_ids) if segment_ids is not None
            else jnp.broadcast_to(idx, (batch, seq))
        )
    lookback = []
    for lag in range(max_lag + 1):
        exists = jnp.broadcast_to(idx >= lag, (batch, seq))
        if segment_ids is not None and lag:
            exists = exists & (shift_right(segment_ids, lag) == segment_ids)
        lookback.append(exists)
    return SequenceInfo(segment_ids, positions.astype(jnp.int32), tuple(lookback))


def shift_right(x: jax.Array, lag: int, axis: int = 1) -> jax.Array:
    """x[t - lag] along `axis`, zero-filled at the start."""
    if lag == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (lag, 0)
    return jax.lax.slice_in_dim(jnp.pad(x, pad), 0, x.shape[axis], axis=axis)
