"""Cutting a run of KV groups out of group-major weights: the one loop both attention mixers use.

CCA and linear attention keep every per-head weight with one axis whose entries come group by
group (each mixer's `GROUP_AXES`: the axis and how many entries one group owns), so the tensor-
and TSP-parallel schedules take a device's groups by slicing that axis.
"""

from __future__ import annotations

import jax


def select(w: dict, first, count: int, sizes: dict[str, tuple[int, int]], names=None) -> dict:
    """`w` with the entries `names` (default all) cut to KV groups [first, first + count);
    `sizes[name]` is (axis, entries per group). `first` may be traced; None entries stay None."""
    out = dict(w)
    for name in names or w:
        if out[name] is None:
            continue
        axis, size = sizes[name]
        out[name] = jax.lax.dynamic_slice_in_dim(w[name], first * size, count * size, axis=axis)
    return out
