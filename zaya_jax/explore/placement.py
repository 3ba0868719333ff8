"""Layouts of N devices over the six mesh axes, and which links each axis's collectives cross.

`layouts(n)` lists every way to write n as data·fsdp·expert·tsp·tensor·sequence. `spans` places
a layout on nodes of G devices the way `parallel/mesh.build_mesh` does (`axes.PLACEMENT`, the
innermost axis varying fastest inside a node) and says, per axis, how many of its group's
members share a node (`intra`) and how many nodes the group spans (`inter`).
"""

from __future__ import annotations

import dataclasses
import math

from zaya_jax.parallel.axes import MESH_AXES, PLACEMENT


@dataclasses.dataclass(frozen=True)
class Span:
    """An axis group of `intra · inter` devices: `intra` per node, on `inter` nodes."""

    intra: int
    inter: int

    @property
    def size(self) -> int:
        return self.intra * self.inter


def _factorizations(n: int, slots: int):
    if slots == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, slots - 1):
                yield (d,) + rest


def layouts(num_devices: int) -> list[dict[str, int]]:
    """Every assignment of axis sizes whose product is `num_devices` (divisibility checked later)."""
    return [dict(zip(MESH_AXES, sizes)) for sizes in _factorizations(num_devices, len(MESH_AXES))]


def spans(sizes: dict[str, int], gpus_per_node: int) -> dict[str, Span]:
    """Per axis: members per node and nodes spanned, for `build_mesh`'s placement."""
    out, stride = {}, 1
    for axis in reversed(PLACEMENT):
        n = sizes[axis]
        if n == 1:
            out[axis] = Span(1, 1)
            continue
        if stride * n <= gpus_per_node:
            out[axis] = Span(n, 1)
        elif stride >= gpus_per_node or gpus_per_node % stride or n % (gpus_per_node // stride):
            out[axis] = Span(1, n)  # one member per node (or an uneven split: price it as such)
        else:
            inside = gpus_per_node // stride
            out[axis] = Span(inside, n // inside)
        stride *= n
    return out


def describe(sizes: dict[str, int]) -> str:
    """'tsp 8 x data 128' style, in mesh order; 'one device' when every axis is 1."""
    used = [f"{a} {s}" for a, s in sizes.items() if s > 1]
    return " x ".join(used) or "one device"


def total(sizes: dict[str, int]) -> int:
    return math.prod(sizes.values())
