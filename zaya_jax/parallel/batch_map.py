"""Run an opaque kernel shard by shard over the batch and sequence axes of the ambient mesh.

GSPMD cannot partition a Pallas kernel: on a GPU it is a custom call, and XLA would gather every
operand to every device and run the whole batch everywhere. `run_kernel` therefore wraps a
kernel whose backend resolves to `pallas` in `jax.shard_map`, so each device runs it on its own
rows; other backends stay with GSPMD. The mesh comes from the tracing context (`Program` traces
its steps under `use_abstract_mesh`); with no mesh, or one device on those axes, the kernel is
called directly. Operands are token-major, [B, S, ...]: B splits over the batch axes and S over
the sequence axes (`row_spec`), which is how the layouts keep activations.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
from jax.sharding import PartitionSpec as P

from zaya_jax.kernels import resolve
from zaya_jax.parallel.axes import BATCH_AXES, SEQUENCE_AXES
from zaya_jax.parallel.rules import entry_axes, spec_axes


def run_kernel(kernel: str, backend: str, fn, batched: tuple, replicated: tuple = ()):
    """fn(*batched, *replicated); `batched` arrays are [B, S, ...] and split on B and S.

    Only for kernels that act on each token row alone (the norm) or on whole sequences when the
    sequence axes are 1 (attention without a sequence layout; see `attention_schedule`).
    """
    if not is_pallas(kernel, backend):
        return fn(*batched, *replicated)
    axes = axes_in_context(BATCH_AXES + SEQUENCE_AXES)
    if not axes:
        return fn(*batched, *replicated)
    spec = row_spec()
    mapped = jax.shard_map(fn, in_specs=(spec,) * len(batched) + (P(),) * len(replicated), out_specs=spec,
                           axis_names=set(axes), check_vma=False)
    return mapped(*batched, *replicated)


def is_pallas(kernel: str, backend: str) -> bool:
    """Whether `kernel` runs as a Pallas kernel here (opaque to GSPMD; its outputs carry no vma types)."""
    return resolve(kernel, backend) == "pallas"


def tensor_groups(kv_heads: int):
    """This device's run of KV groups under `tensor`: (first, count); `first` is traced when split."""
    tensor = axis_size("tensor")
    groups = kv_heads // tensor
    return (0 if tensor == 1 else jax.lax.axis_index("tensor") * groups), groups


def schedule_map(fn, in_specs, out_specs, check_vma: bool):
    """`jax.shard_map` of a parallel schedule, manual over every axis of the ambient mesh.

    Manual over the split axes only, the size-1 axes would stay automatic, and then JAX gives
    the reducer of every psum a sharding annotation that XLA's CPU compiler turns into a `copy`
    and aborts on when it widens a bf16 all-reduce ("Invalid binary instruction opcode copy";
    jax 0.10). The size-1 axes are also named in every spec (on its first dimension: no data
    moves) so that, without vma checks, the backward does not sum cotangents over them (an
    all-reduce over one device). Every operand must have a dimension.
    """
    mesh = jax.sharding.get_abstract_mesh()
    free = tuple(a for a in mesh.axis_names if a not in _WHOLE.get())  # those are manual already
    idle = tuple(a for a in free if mesh.shape[a] == 1)
    name = lambda tree: jax.tree.map(lambda spec: _naming(spec, idle), tree, is_leaf=lambda x: isinstance(x, P))
    return jax.shard_map(fn, in_specs=name(in_specs), out_specs=name(out_specs),
                         axis_names=set(free), check_vma=check_vma)


def _naming(spec: P, idle: tuple[str, ...]) -> P:
    extra = tuple(a for a in idle if a not in spec_axes(spec))
    if not extra:
        return spec
    entries = list(spec) or [None]
    entries[0] = entry_axes(entries[0]) + extra
    return P(*entries)


# Axes over which an enclosing schedule already gave each device its own rows (the data
# replicas' micro-batch loop, `parallel/grad_reduction.py`): the layer schedules treat those rows as
# the whole batch and leave these axes alone.
_WHOLE: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("zaya_rows_held_whole", default=())


@contextlib.contextmanager
def rows_held_whole(axes: tuple[str, ...]) -> Iterator[None]:
    """While tracing inside: `axes` are not split axes to the layer schedules (see `_WHOLE`)."""
    token = _WHOLE.set(_WHOLE.get() + tuple(axes))
    try:
        yield
    finally:
        _WHOLE.reset(token)


def rows_held_whole_over() -> tuple[str, ...]:
    """The axes `rows_held_whole` names while tracing (empty outside it)."""
    return _WHOLE.get()


def axes_in_context(names=None) -> tuple[str, ...]:
    """The ambient mesh's axes (of `names`, default all) with more than one device, in mesh order,
    but for those whose rows are held whole (`rows_held_whole`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    whole = _WHOLE.get()
    return tuple(a for a in mesh.axis_names
                 if mesh.shape[a] > 1 and a not in whole and (names is None or a in names))


def axis_size(name: str) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or name not in mesh.axis_names else mesh.shape[name]


def row_spec() -> P:
    """[B, S, ...] activations: B over the batch axes, S over the sequence axes (in context)."""
    batch = axes_in_context(BATCH_AXES)
    seq = tuple(a for a in SEQUENCE_AXES if a in axes_in_context(SEQUENCE_AXES))
    return P(batch or None, seq or None)
