"""Muon's distributed Newton–Schulz: whole matrices spread over the devices, a few at a time.

A weight reads as a batch of independent matrices (one per layer, per expert...). Orthogonalising
them where they are stored would make every device gather and repeat the whole batch; instead the
batch is padded with zero matrices to a multiple of the device count and laid out with whole
matrices spread over every device (`rules.spread_axes`), so each device runs only its share:
one of ZAYA1-base's 640 expert matrices per weight on 1,024 GPUs, not all 640. Its share is then taken
in passes of at most `PASS_ELEMENTS` per device (a `lax.map`), so the iterations' temporaries
stay those of a few matrices whatever the depth: 40 layers are more passes, not more memory.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.parallel.rules import spread_axes

# Matrix elements per device per pass: 16M fp32 (64 MiB) is 4 of ZAYA1-base's [2048 x 2048]
# expert matrices, or 32 of its [2048 x 256] attention ones: enough to keep a GPU busy.
PASS_ELEMENTS = 1 << 24


def spread_matrices(mesh: Mesh, pass_elements: int = PASS_ELEMENTS):
    """`run(fn, batch)`: `fn` (a batched map of [k, m, n] matrices, each on its own) over a
    [matrices, m, n] batch, spread over `mesh`'s devices and taken in passes."""
    sizes = dict(mesh.shape)
    axes = spread_axes(sizes)
    devices = math.prod(sizes[a] for a in axes)
    entry = axes[0] if len(axes) == 1 else (axes or None)

    def place(x, dim):
        spec = P(*[entry if d == dim else None for d in range(x.ndim)])
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def run(fn: Callable[[jax.Array], jax.Array], batch: jax.Array) -> jax.Array:
        count, rows, cols = batch.shape
        mine = share(count, sizes)  # matrices per device; the last devices' extra are zeros
        if mine * devices != count:  # (Newton–Schulz of zeros is zeros, and they are cut off)
            batch = jnp.pad(batch, ((0, mine * devices - count), (0, 0), (0, 0)))
        batch = place(batch, 0)
        per_pass = _largest_divisor(mine, max(1, pass_elements // (rows * cols)))
        passes = mine // per_pass
        if passes == 1:
            return place(fn(batch), 0)[:count]
        # Device d holds matrices [d * mine, (d + 1) * mine): pass p takes each device's p-th group.
        grouped = jnp.moveaxis(place(batch.reshape(devices, passes, per_pass, rows, cols), 0), 1, 0)

        def one_pass(group):  # [devices, per_pass, m, n], whole matrices on each device
            out = fn(place(group.reshape(devices * per_pass, rows, cols), 0))
            return place(out.reshape(devices, per_pass, rows, cols), 0)

        done = jax.lax.map(one_pass, place(grouped, 1))
        return place(jnp.moveaxis(done, 0, 1).reshape(-1, rows, cols), 0)[:count]

    return run


def share(count: int, sizes: dict[str, int]) -> int:
    """How many of `count` matrices each device orthogonalises (the explorer prices this)."""
    return -(-count // math.prod(sizes[a] for a in spread_axes(sizes)))


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)
