"""Run an opaque kernel shard by shard over the batch axes of the ambient mesh.

GSPMD cannot partition a Pallas kernel: on a GPU it is a custom call, and XLA would gather every
operand to every device and run the whole batch everywhere. `run_kernel` therefore wraps a
kernel whose backend resolves to `pallas` in `jax.shard_map` over the mesh's batch axes (data,
fsdp, expert), so each device runs it on its own rows; other backends stay with GSPMD. The mesh
comes from the tracing context (`Program` traces its steps under `use_abstract_mesh`); with no
mesh, or one device on the batch axes, the kernel is called directly.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from zaya_jax.kernels import resolve
from zaya_jax.parallel.axes import BATCH_AXES


def run_kernel(kernel: str, backend: str, fn, batched: tuple, replicated: tuple = ()):
    """fn(*batched, *replicated); `batched` arrays split on their leading (row) axis."""
    if resolve(kernel, backend) != "pallas":
        return fn(*batched, *replicated)
    return over_batch(fn, batched, replicated)


def batch_axes_in_context() -> tuple[str, ...]:
    """The ambient mesh's batch axes with more than one device, in mesh order."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)


def over_batch(fn, batched: tuple, replicated: tuple = ()):
    axes = batch_axes_in_context()
    if not axes:
        return fn(*batched, *replicated)
    spec = P(axes)
    mapped = jax.shard_map(fn, in_specs=(spec,) * len(batched) + (P(),) * len(replicated), out_specs=spec,
                           axis_names=set(axes), check_vma=False)
    return mapped(*batched, *replicated)
