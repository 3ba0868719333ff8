"""The logical → mesh sharding rules: the one table that decides where every array lives.

Parameters carry logical axis names (`embed`, `experts`, `vocab`, ...; see `model/params.py`);
activations use `batch`. A logical axis maps to a tuple of mesh axes; anything not in the table
is replicated. Mesh axes of size 1 are dropped, so one table serves every layout of this family.
"""

from __future__ import annotations

from typing import Iterable

from jax.sharding import Mesh, NamedSharding, PartitionSpec

RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),  # each data-parallel device reads its own sequences
    "embed": ("fsdp",),  # FSDP: shard the hidden dimension of every weight
    "experts": ("expert",),  # expert parallelism: each device owns E / expert experts
}


def partition_spec(logical_axes: Iterable[str | None] | None, mesh: Mesh, shape=None) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes (replicated where a dim does not divide)."""
    if not logical_axes:
        return PartitionSpec()
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        axes = tuple(a for a in RULES.get(name, ()) if mesh.shape[a] > 1 and a not in used)
        size = 1
        for a in axes:
            size *= mesh.shape[a]
        if shape is not None and shape[dim] % size:
            axes = ()
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)


def named_sharding(logical_axes, mesh: Mesh, shape=None) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes, mesh, shape))
