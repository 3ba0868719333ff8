"""Muon's distributed Newton–Schulz: whole matrices spread over the devices, a few at a time.

A weight reads as a batch of independent matrices (one per layer, per expert...). Orthogonalising
them where they are stored would make every device gather and repeat the whole batch; instead the
batch is padded with zero matrices to a multiple of the device count and laid out with whole
matrices spread over every device (`rules.spread_axes`), so each device runs only its share:
one of ZAYA1-base's 640 expert matrices per weight on 1,024 GPUs, not all 640. Its share is then taken
in passes of at most `PASS_ELEMENTS` per device (a `lax.map`), so the iterations' temporaries
stay those of a few matrices whatever the depth: 40 layers are more passes, not more memory.

A weight's matrices start where its optimizer state lives (split over fsdp, tsp, expert, ZeRO-1's
data...). Left to itself, GSPMD reads the reshape into the spread batch as a new sharding of the
stacked weight it cannot reach by exchanging tiles, and gathers the whole weight on every device
(an "involuntary full rematerialization": ZAYA1-base's experts are 10 GiB a weight in fp32). So
the matrices are first pinned where the state is (`rules.merged_spec`); the device factors of
their batch dimensions lead the matrix index, so each device's matrices are one block of it
(`_Front`); then the mesh axes that split inside the matrices move onto the index one at a time,
an all-to-all each, and axes the state is replicated over just slice (`_route`). The results go
back the same way.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.parallel.rules import entry_axes, merged_spec, spec_entry, spread_axes

# Matrix elements per device per pass: 16M fp32 (64 MiB) is 4 of ZAYA1-base's [2048 x 2048]
# expert matrices, or 32 of its [2048 x 256] attention ones: enough to keep a GPU busy.
PASS_ELEMENTS = 1 << 24


def spread_matrices(mesh: Mesh, held: dict | None = None, pass_elements: int = PASS_ELEMENTS):
    """`run(fn, mats, key=None)`: `fn` (a batched map of [k, m, n] matrices, each on its own) over
    the matrices of `mats` ([*batch, m, n]), spread over `mesh`'s devices and taken in passes.
    `held` maps a weight's key to (PartitionSpec, shape): where its optimizer state lives, which
    is where its matrices come from and go back to."""
    sizes = dict(mesh.shape)
    axes = spread_axes(sizes)
    devices = math.prod(sizes[a] for a in axes)
    held = held or {}

    def pin(x, entries):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*map(spec_entry, entries))))

    def run(fn: Callable[[jax.Array], jax.Array], mats: jax.Array, key: str | None = None) -> jax.Array:
        where = [entry_axes(e) for e in merged_spec(*held[key], mats.shape)] if key in held else [()] * mats.ndim
        front = _Front(mats.shape, [math.prod(sizes[a] for a in e) for e in where[:-2]], devices)
        route = _route(where, axes)
        batch = pin(front(pin(mats, where)), route[0])
        for spec in route[1:]:  # one mesh axis at a time onto the matrix index: an all-to-all each
            batch = pin(batch, spec)
        out = _passes(fn, batch, lambda x, dim: pin(x, [route[-1][0] if d == dim else () for d in range(x.ndim)]),
                      devices, pass_elements)
        for spec in reversed(route[:-1]):
            out = pin(out, spec)
        return pin(front.undo(out), where)

    return run


def _route(where: list[tuple[str, ...]], axes: tuple[str, ...]) -> list[list[tuple[str, ...]]]:
    """The [M, m, n] specs from where the matrices are held (the batch dims' axes on the index, the
    matrix dims' own) to every mesh axis on the index: one axis moves per step, the minor one of a
    dimension first (it splits off as a block); axes the state is replicated over come last (each
    device just takes its part)."""
    spec = [[a for e in where[:-2] for a in e], list(where[-2]), list(where[-1])]
    route = [[tuple(e) for e in spec]]
    for dim in (1, 2):
        for axis in reversed(list(spec[dim])):
            spec[dim].remove(axis)
            spec[0].append(axis)
            route.append([tuple(e) for e in spec])
    rest = [a for a in axes if a not in spec[0]]
    if rest:
        route.append([tuple(spec[0] + rest), (), ()])
    return route


class _Front:
    """[*batch, m, n] ⇄ [M, m, n] with each device's matrices one block of M: every batch dim is
    split into (its devices, the rest) and the device factors lead; the rest is padded with zero
    matrices to a multiple of the devices left over (Newton–Schulz of zeros is zeros; they are cut
    off on the way back)."""

    def __init__(self, shape, split: list[int], devices: int):
        self.shape, batch = tuple(shape), len(split)
        self.factored = [f for d in range(batch) for f in (split[d], shape[d] // split[d])] + list(shape[-2:])
        self.order = [2 * d for d in range(batch)] + [2 * d + 1 for d in range(batch)] + [2 * batch, 2 * batch + 1]
        self.lead = math.prod(split)
        self.count = math.prod(shape[:batch]) // self.lead
        per = devices // self.lead
        self.padded = -(-self.count // per) * per

    def __call__(self, mats):
        x = jnp.transpose(mats.reshape(self.factored), self.order).reshape(self.lead, self.count, *self.shape[-2:])
        if self.padded != self.count:
            x = jnp.pad(x, ((0, 0), (0, self.padded - self.count), (0, 0), (0, 0)))
        return x.reshape(-1, *self.shape[-2:])

    def undo(self, out):
        x = out.reshape(self.lead, self.padded, *self.shape[-2:])[:, :self.count]
        moved = [self.factored[i] for i in self.order]
        return jnp.transpose(x.reshape(moved), _inverse(self.order)).reshape(self.shape)


def _passes(fn, batch, place, devices: int, pass_elements: int):
    """`fn` over a [M, m, n] batch spread on its first dim (`place(x, dim)` pins dim `dim` of x
    there): each device its own block of M / devices matrices, in passes of at most `pass_elements`."""
    count, rows, cols = batch.shape
    mine = count // devices
    per_pass = _largest_divisor(mine, max(1, pass_elements // (rows * cols)))
    passes = mine // per_pass
    if passes == 1:
        return place(fn(place(batch, 0)), 0)
    # Device d holds matrices [d * mine, (d + 1) * mine): pass p takes each device's p-th group.
    grouped = jnp.moveaxis(place(batch.reshape(devices, passes, per_pass, rows, cols), 0), 1, 0)

    def one_pass(group):  # [devices, per_pass, m, n], whole matrices on each device
        out = fn(place(group.reshape(devices * per_pass, rows, cols), 0))
        return place(out.reshape(devices, per_pass, rows, cols), 0)

    done = jax.lax.map(one_pass, place(grouped, 1))
    return place(jnp.moveaxis(done, 0, 1).reshape(-1, rows, cols), 0)


def share(count: int, sizes: dict[str, int]) -> int:
    """How many of `count` matrices each device orthogonalises (the explorer prices this)."""
    return -(-count // math.prod(sizes[a] for a in spread_axes(sizes)))


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _inverse(order: list[int]) -> list[int]:
    return sorted(range(len(order)), key=order.__getitem__)
