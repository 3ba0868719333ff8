"""The logical → mesh sharding rules: the one table that decides where every array lives.

Parameters carry logical axis names (`embed`, `experts`, `mlp`, ...; see `model/params.py`);
activations use `batch` and `length`. A logical axis maps to a tuple of mesh axes; anything not
in the table is replicated. Mesh axes of size 1 are dropped, so one table serves every layout:

- data / fsdp / expert: each device reads its own sequences; fsdp shards the hidden dimension
  of every weight (ZeRO-3) but the experts', which it splits by expert after `expert` (E /
  (expert·fsdp) each; `parallel/experts_schedule.py` says why); expert owns E / expert experts.
- tensor (Megatron): query/KV heads and the experts' width are split; attention keeps whole
  KV groups per device; the tied embedding / LM head is split on its vocabulary, and the loss
  runs vocabulary-parallel (`train/loss.py`).
- tsp (folded tensor + sequence): the sequence is split, and every weight is stored 1/D —
  attention matrices on their hidden dimension (a bucket is all-gathered when used), the
  experts on their width (slices circulate in a ring).
- sequence (context parallel): the sequence is split; weights are not.

Rules are applied in table order: a mesh axis goes to the first of an array's dimensions that
claims it (the experts' `mlp` takes `tsp` before their `embed` can). A dimension takes the
longest run of its rule's axes that divides it, leaving the rest to later dimensions (experts
that do not divide over expert × fsdp leave fsdp to their hidden dimension).
"""

from __future__ import annotations

from typing import Iterable

from jax.sharding import Mesh, NamedSharding, PartitionSpec

RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "length": ("tsp", "sequence"),
    "experts": ("expert", "fsdp"),
    "mlp": ("tensor", "tsp"),
    "heads": ("tensor",),
    "vocab": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim_out": ("tsp",),
    "embed": ("fsdp", "tsp"),
    # Muon's whole matrices (one per layer, expert...) are independent: spread them over every device.
    "matrices": ("data", "fsdp", "expert", "tsp", "tensor", "sequence"),
}


def partition_spec(logical_axes: Iterable[str | None] | None, mesh: Mesh, shape=None) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes (replicated where a dim does not divide)."""
    if not logical_axes:
        return PartitionSpec()
    names = list(logical_axes)
    used: set[str] = set()
    spec: list = [None] * len(names)
    for rule, mesh_axes in RULES.items():
        for dim, name in enumerate(names):
            if name != rule:
                continue
            axes = tuple(a for a in mesh_axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
            if shape is not None:
                axes = _dividing_prefix(axes, mesh, shape[dim])
            used.update(axes)
            spec[dim] = spec_entry(axes)
    return PartitionSpec(*spec)


def _dividing_prefix(axes: tuple[str, ...], mesh: Mesh, length: int) -> tuple[str, ...]:
    """The longest leading run of `axes` whose sizes multiply to a divisor of `length`."""
    size = 1
    for n, a in enumerate(axes):
        size *= mesh.shape[a]
        if length % size:
            return axes[:n]
    return axes


def spec_entry(axes) -> str | tuple[str, ...] | None:
    """The PartitionSpec entry of a dimension split over `axes` (None, one axis name, or a tuple)."""
    axes = tuple(axes)
    return axes[0] if len(axes) == 1 else (axes or None)


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name, or a tuple of them)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def spec_axes(spec: PartitionSpec) -> set[str]:
    """Every mesh axis a PartitionSpec shards over."""
    return {a for entry in spec for a in entry_axes(entry)}


def keep_axes(spec: PartitionSpec, keep: Iterable[str]) -> PartitionSpec:
    """`spec` with only the mesh axes in `keep` (the others become replicated)."""
    keep = set(keep)
    out = []
    for entry in spec:
        axes = tuple(a for a in entry_axes(entry) if a in keep)
        out.append(spec_entry(axes))
    return PartitionSpec(*out)


def data_split_dim(spec: PartitionSpec, shape, mesh: Mesh) -> int | None:
    """ZeRO-1: the dimension of an array sharded as `spec` on which its optimizer state is also
    split over `data` (the first the spec leaves whole and `data` divides), or None."""
    size = mesh.shape.get("data", 1)
    if size == 1 or "data" in spec_axes(spec):
        return None
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return next((d for d, n in enumerate(shape) if entries[d] is None and n % size == 0), None)


def split_over_data(spec: PartitionSpec, dim: int | None, ndim: int) -> PartitionSpec:
    """`spec` with `data` added on `dim` (unchanged for None)."""
    if dim is None:
        return spec
    entries = list(spec) + [None] * (ndim - len(spec))
    entries[dim] = "data"
    return PartitionSpec(*entries)


def merged_spec(spec: PartitionSpec, shape, merged_shape) -> PartitionSpec:
    """The sharding an array of `shape` (sharded as `spec`) keeps when reshaped to `merged_shape`, whose
    dimensions each merge consecutive ones of `shape`: a merged dimension keeps the mesh axes of its
    most-major dimension longer than 1 when only that one is sharded (the tiles stay contiguous); one
    that would interleave them is left whole."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    out, dim = [], 0
    for size in merged_shape:
        group, elements = [], 1
        while dim < len(shape) and elements * shape[dim] <= size and (elements < size or shape[dim] == 1):
            elements *= shape[dim]
            group.append(dim)
            dim += 1
        if elements != size:
            raise ValueError(f"{tuple(merged_shape)} does not merge consecutive dimensions of {tuple(shape)}")
        long = [d for d in group if shape[d] > 1]
        sharded = [d for d in group if entries[d]]
        out.append(entries[long[0]] if long and sharded == [long[0]] else None)
    return PartitionSpec(*out)


def named_sharding(logical_axes, mesh: Mesh, shape=None) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes, mesh, shape))


def spread_axes(sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes Muon's whole matrices are spread over for Newton–Schulz: every axis of the
    `matrices` rule with more than one device (the batch is padded to a multiple of them)."""
    return tuple(a for a in RULES["matrices"] if sizes.get(a, 1) > 1)
