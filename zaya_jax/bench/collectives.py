"""Time each collective over each mesh axis and report bus bandwidth, as nccl-tests does.

For every axis of size n > 1, every op and every size S, one jitted `jax.shard_map` runs the op
over that axis alone (the other axes are independent groups running it at the same time, as in
training) on float32 data; after warm-up calls, each of the timed calls is waited on with
`block_until_ready` and the median is kept (a median shrugs off the odd slow call).

Sizes follow `explore/collectives.py`, which reads the records back: S is the gathered / reduced
array (all-gather: each member holds S/n and ends with S; reduce-scatter: holds S, keeps S/n;
all-reduce: S; all-to-all: each member sends and receives an S-byte buffer; permute: each member
sends S bytes to its ring neighbour). algbw = S / time and busbw = algbw · (n−1)/n (all-gather,
reduce-scatter, all-to-all), · 2(n−1)/n (all-reduce), · 1 (permute: the explorer prices it as
bytes / busbw). S is rounded to a whole float32 count divisible by n; records carry the S measured.

The tier comes from where the group's devices really are: "intra" when every group of the axis
sits inside one node, else "inter" (a group that spans nodes, even partly, crosses the network).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.errors import ZayaError
from zaya_jax.explore.collectives import GB, OPS

DTYPE = jnp.float32
ITEM = 4  # bytes per float32


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` over n members (the nccl-tests convention)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "permute":
        return 1.0
    return (n - 1) / n


def busbw_gb_per_s(op: str, n: int, nbytes: int, seconds: float) -> float:
    return nbytes / seconds * bus_factor(op, n) / GB


def tier_of(group_nodes: list[list[int]]) -> str:
    """'intra' if every group's members share one node, else 'inter'; group_nodes[g] = node of each member."""
    return "intra" if all(len(set(nodes)) == 1 for nodes in group_nodes) else "inter"


def axis_groups(mesh: Mesh, axis: str) -> list[list]:
    """The device groups that one collective over `axis` runs in (one per point of the other axes)."""
    grid = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1)
    return [list(row) for row in grid.reshape(-1, mesh.shape[axis])]


def per_shard(op: str, axis: str, n: int) -> Callable:
    """The op on one member's 1-D float32 buffer, for use inside `shard_map`."""
    if op == "all_gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    if op == "reduce_scatter":
        return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)
    if op == "all_reduce":
        return lambda x: jax.lax.psum(x, axis)
    if op == "all_to_all":
        return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
    if op == "permute":
        return lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])
    raise ZayaError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


def elements_for(nbytes: int, n: int) -> int:
    """float32 count of S: at least n, a multiple of n (each member holds or receives S/n)."""
    return max(n, nbytes // ITEM // n * n)


def compiled(mesh: Mesh, axis: str, op: str, elements: int):
    """(jitted op over `axis`, its input): every device holds a 1-D shard of the global array."""
    n = mesh.shape[axis]
    local = elements // n if op == "all_gather" else elements
    spec = P(mesh.axis_names)  # dim 0 split over every axis: one shard per device
    # Manual over every axis (size-1 ones too), as parallel/batch_map.schedule_map does, so that
    # nothing outside the collective is left for GSPMD to partition.
    fn = jax.jit(jax.shard_map(per_shard(op, axis, n), mesh=mesh, in_specs=spec, out_specs=spec,
                               axis_names=set(mesh.axis_names), check_vma=False))
    # Made on the devices (not device_put from the host) so multi-process runs need no host copy.
    x = jax.jit(lambda: jnp.ones((mesh.size * local,), DTYPE), out_shardings=NamedSharding(mesh, spec))()
    return fn, x


def time_op(mesh: Mesh, axis: str, op: str, nbytes: int, iters: int, warmup: int) -> tuple[int, float]:
    """(S measured in bytes, median seconds per call)."""
    elements = elements_for(nbytes, mesh.shape[axis])
    try:
        fn, x = compiled(mesh, axis, op, elements)
        for _ in range(warmup):
            fn(x).block_until_ready()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn(x).block_until_ready()
            times.append(time.perf_counter() - start)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" in str(e):
            raise ZayaError(f"{op} of {elements * ITEM} bytes over {axis} does not fit in device memory; "
                            "drop that size from --sizes") from None
        raise
    return elements * ITEM, statistics.median(times)


def record(op: str, axis: str, n: int, tier: str, nbytes: int, seconds: float) -> dict:
    """One line of the file `zaya mesh --collectives` reads (axis and time_us ride along; it ignores them)."""
    return {"tier": tier, "op": op, "group": n, "bytes": nbytes,
            "busbw_gb_per_s": busbw_gb_per_s(op, n, nbytes, seconds), "axis": axis, "time_us": seconds * 1e6}


def measure(mesh: Mesh, node_of: Callable, ops: tuple[str, ...], sizes: list[int], iters: int,
            warmup: int) -> Iterator[dict]:
    """Records for every axis of size > 1 (mesh order), op and size, as each is measured."""
    for axis in mesh.axis_names:
        n = mesh.shape[axis]
        if n == 1:
            continue
        tier = tier_of([[node_of(d) for d in group] for group in axis_groups(mesh, axis)])
        for op in ops:
            for nbytes in sizes:
                measured, seconds = time_op(mesh, axis, op, nbytes, iters, warmup)
                yield record(op, axis, n, tier, measured, seconds)
