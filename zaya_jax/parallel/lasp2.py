"""LASP-2: linear attention over a sequence split across the devices of the sequence-like axes.

Call inside `shard_map` over those axes. Each device reduces each of its chunks (one, or two
under zigzag: `parallel/zigzag.py`) to its memory state (`kernels.linear_attention.chunk_state`,
d_k × d_v per head). One all-gather hands every device every chunk's state (and, a few integers,
every chunk's last segment id); each device combines the states before each of its chunks (a
masked, decayed prefix sum that stops at document starts) and runs the linear-attention kernel
(`kernels.ops.linear_attention`, the registry's backend) on its chunk from that entering state.
The all-gather's bytes do not depend on the sequence length; autodiff transposes it to one
reduce-scatter of the states' gradients in the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.kernels import linear_attention as la
from zaya_jax.kernels import ops
from zaya_jax.parallel import zigzag as zz


def lasp2(q, k, v, segment_ids, *, axis, devices: int, zigzag: bool, log_decay=None, backend=None):
    """This device's [B, L, nq, dv] output. q [B, L, nq, dk], k [B, L, nk, dk], v [B, L, nk, dv] and
    segment_ids [B, L] are its local rows: its chunks side by side, in `zigzag.chunks_of` order."""
    n = zz.chunks_per_device(zigzag)
    batch, nq = q.shape[0], q.shape[2]
    qc, kc, vc, sc = (zz.by_chunk(t, n) for t in (q, k, v, segment_ids))
    own = la.chunk_state(kc, vc, sc, log_decay, nq)
    own = own.reshape(n, batch, *own.shape[1:])
    ends = sc[:, -1].reshape(n, batch)
    states = jax.lax.all_gather(own, axis, axis=0, tiled=True)  # [D·n, B, nk, g, dk, dv]: the one collective
    all_ends = jax.lax.all_gather(ends, axis, axis=0, tiled=True)
    in_sequence = np.argsort(zz.chunk_order(devices, zigzag))  # gathered (device) order → sequence order
    states, all_ends = jnp.moveaxis(states[in_sequence], 0, 1), all_ends[in_sequence].T
    mine = jnp.stack(zz.chunks_of(jax.lax.axis_index(axis), devices, zigzag))  # [n] global chunk indices
    entering = la.entering_states(states, all_ends, log_decay, nq, qc.shape[1], rows=mine)  # [B, n, ...]
    previous_end = jnp.where(mine > 0, jnp.take(all_ends, jnp.maximum(mine - 1, 0), axis=1), -1)  # [B, n]
    out = ops.linear_attention(qc, kc, vc, sc, log_decay=log_decay, backend=backend,
                               initial_state=_chunk_major(entering), initial_segment=_chunk_major(previous_end))
    return zz.from_chunks(out, n)


def _chunk_major(x):
    """[B, n, ...] → [n·B, ...] (as `zigzag.by_chunk` orders the chunks)."""
    return jnp.moveaxis(x, 1, 0).reshape(-1, *x.shape[2:])
