"""Muon's distributed Newton–Schulz: whole matrices spread over the devices, a few at a time.

A weight reads as a batch of independent matrices (one per layer, per expert...). Orthogonalising
them where they are stored would make every device gather and repeat the whole batch; instead each
device orthogonalises only its share of whole matrices: one of ZAYA1-base's 640 expert matrices per
weight on 1,024 GPUs, not all 640. Its share is taken in passes of at most `PASS_ELEMENTS` per
device (a `lax.map`), so the iterations' temporaries stay those of a few matrices whatever the
depth: 40 layers are more passes, not more memory.

The matrices start where the weight's optimizer state lives (split over fsdp, tsp, expert, ZeRO-1's
data...; `rules.merged_spec` of the stacked weight). Inside one `shard_map` over every mesh axis,
each device starts from its own block of the batch, in row or column slices where an axis splits
inside the matrices. It pads that block with copies of its last matrix to a multiple of those
axes' devices (their results are dropped), then one `all_to_all` per such axis, the minor one of a
dimension first, deals the block out as whole matrices. The axes the state is replicated over (the
`rest`) then just take their part, padded per device, never per block. The results go back the same
way: gathered over the rest (or, when that part is mostly padding, summed there from zero-filled
places, so no device holds more than its block), then the all-to-alls in reverse.

Left to GSPMD, with sharding constraints on each step, this moved the padded batch: at a 1-matrix
weight on `data 2 x expert 4`, every device held a quarter of eight matrices (seven of them zeros)
before its all-to-all, 20x its share of the state.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from zaya_jax.parallel.rules import entry_axes, merged_spec, spec_entry, spread_axes

# Matrix elements per device per pass: 256M (1 GiB of fp32 input) is 64 of ZAYA1-base's [2048 x 2048]
# expert matrices: each pass is one batched product per Newton–Schulz iteration, so fewer, larger
# passes launch fewer kernels (16 layers' experts in 4 passes per weight), at ~5 such GiB of temporaries.
PASS_ELEMENTS = 1 << 28


def spread_matrices(mesh: Mesh, held: dict | None = None, pass_elements: int = PASS_ELEMENTS):
    """`run(fn, mats, key=None)`: `fn` (a batched map of [k, m, n] matrices, each on its own) over
    the matrices of `mats` ([*batch, m, n]), spread over `mesh`'s devices and taken in passes.
    `held` maps a weight's key to (PartitionSpec, shape): where its optimizer state lives, which
    is where its matrices come from and go back to."""
    sizes = dict(mesh.shape)
    held = held or {}

    def run(fn: Callable[[jax.Array], jax.Array], mats: jax.Array, key: str | None = None) -> jax.Array:
        where = [entry_axes(e) for e in merged_spec(*held[key], mats.shape)] if key in held else [()] * mats.ndim
        spec = P(*map(spec_entry, where))
        here = functools.partial(_orthogonalise_here, fn, where, sizes, pass_elements)
        # Traced under the program's abstract mesh (which may name other devices: a GPU lowering
        # on this host), shard_map must be given that one.
        ambient = jax.sharding.get_abstract_mesh()
        on = mesh if ambient.empty else ambient
        return jax.shard_map(here, mesh=on, in_specs=spec, out_specs=spec, check_vma=False)(mats)

    return run


def _orthogonalise_here(fn, where: list[tuple[str, ...]], sizes: dict[str, int], pass_elements: int, block):
    """One device's part of `run`: `block` is its [*batch, m, n] tile of the matrices (`where`)."""
    *_, m, n = block.shape
    moves = _moves(where)
    x = block.reshape(-1, m, n)
    count = x.shape[0]
    padded = _round_up(count, math.prod(sizes[a] for _, a in moves))
    # Padded with copies of the last matrix, not zeros: XLA's CSE merges a zero operand of the
    # all-to-all with a zero of another layout and its verifier then rejects the all-to-all (jax 0.10,
    # CPU). The copies are cut off on the way back like zeros would be.
    x = jnp.pad(x, ((0, padded - count), (0, 0), (0, 0)), mode="edge")
    for dim, axis in moves:  # whole matrices: each axis's slices of a matrix meet on one device
        x = jax.lax.all_to_all(x, axis, split_axis=0, concat_axis=dim, tiled=True)
    rest = tuple(a for a in spread_axes(sizes) if a not in {axis for e in where for axis in e})  # the state's replicas
    out = _rest_share(fn, x, rest, math.prod(sizes[a] for a in rest), pass_elements)
    for dim, axis in reversed(moves):
        out = jax.lax.all_to_all(out, axis, split_axis=dim, concat_axis=0, tiled=True)
    return out[:count].reshape(block.shape)


def _moves(where: list[tuple[str, ...]]) -> list[tuple[int, str]]:
    """(matrix dim, mesh axis) for each axis that splits inside the matrices ([M, m, n]'s dims 1
    and 2), the minor one of a dimension first: its slices join into the major one's."""
    return [(dim, axis) for dim, axes in ((1, where[-2]), (2, where[-1])) for axis in reversed(axes)]


def _rest_share(fn, whole, rest: tuple[str, ...], devices: int, pass_elements: int):
    """`fn` over the [B, m, n] whole matrices every device of the `rest` axes holds alike: each takes
    its run of ceil(B / devices) (zeros past the end), and the results come back to all of them."""
    if not rest:
        return _passes(fn, whole, pass_elements)
    count = whole.shape[0]
    per = -(-count // devices)
    first = jax.lax.axis_index(rest) * per
    mine = _placed(whole, jnp.arange(per) + first, count)
    out = _passes(fn, mine, pass_elements)
    if gathers_back(count, devices):
        return jax.lax.all_gather(out, rest, tiled=True)[:count]
    # Mostly padding: each device puts its results in their places of a zero [B, m, n] and the
    # devices sum them (adding zeros is exact), so none holds `devices` x `per` matrices.
    return jax.lax.psum(_placed(out, jnp.arange(count) - first, per), rest)


def gathers_back(count: int, devices: int) -> bool:
    """Whether the results of `count` matrices spread over `devices` replicas come back by an
    all-gather of ceil(count / devices) each, or, when that moves more than the all-reduce of
    `count` would (twice the bytes), by summing zero-filled places (the explorer prices which)."""
    return devices * -(-count // devices) <= 2 * count


def _placed(x, index, size: int):
    """x[index] where 0 <= index < size, zero matrices elsewhere."""
    inside = (index >= 0) & (index < size)
    return jnp.where(inside[:, None, None], jnp.take(x, jnp.clip(index, 0, size - 1), axis=0), 0)


def _passes(fn, batch, pass_elements: int):
    """`fn` over this device's [k, m, n] matrices, in passes of at most `pass_elements`."""
    count, rows, cols = batch.shape
    per_pass = _largest_divisor(count, max(1, pass_elements // (rows * cols)))
    if per_pass == count:
        return fn(batch)
    out = jax.lax.map(fn, batch.reshape(count // per_pass, per_pass, rows, cols))
    return out.reshape(count, rows, cols)


def share(count: int, sizes: dict[str, int]) -> int:
    """How many of `count` matrices each device orthogonalises (the explorer prices this)."""
    return -(-count // math.prod(sizes[a] for a in spread_axes(sizes)))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)
