"""Data-parallel replicas: each accumulates its own micro-batches' gradients, reduced once per step.

Under GSPMD alone, the gradient of a weight replicated over `data` is all-reduced inside the
micro-batch loop, once per micro-batch: XLA does not move a reduction out of a loop. Here the
accumulation runs in a `shard_map` manual over `data` only. Each replica differentiates its own
rows; the other mesh axes stay with GSPMD and the layer schedules, which see `data` as already
split and leave it alone (`batch_map.rows_held_whole`). The sums leave the loop unreduced and are
reduced once: summed over `data` (an all-reduce), or, for a leaf whose optimizer state is split
over `data` (ZeRO-1, `optim.shard_over_data`), reduce-scattered onto that split. The loss, the token
count and the balancer's route sums are summed with them.

Each gradient is reduced tile by tile, where it lies: inside a second `shard_map` manual over the
other mesh axes too, its spec the parameter's. Left to GSPMD, a collective over the manual `data`
on an operand split over an automatic axis (experts over `expert`, weights over `fsdp`) is preceded
by an all-gather of the whole operand: every device held every expert's gradient at the reduction
(8 CPU devices, `data 2 x expert 4`, 16 experts: a [4, 16, 160, 352] fp32 gather per expert weight,
the step's peak 1.6× the explorer's prediction).
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.batch_map import axes_in_context, axis_size, rows_held_whole, schedule_map
from zaya_jax.parallel.rules import spec_axes, split_over_data

AXIS = "data"


def reduce_once(accumulate: Callable, scatter: dict[str, int | None], specs: dict[str, P]) -> Callable:
    """`run(params, biases, batches) -> (grads, loss_sum, tokens, route_sums)`: `accumulate` (the step's
    micro-batch loop, same signature) on each data replica's rows of the [A, b, S] batches. A
    gradient whose path has a dimension in `scatter` comes back split over `data` on it; every
    other result comes back summed. `specs`: each parameter's PartitionSpec, where its gradient's
    tiles lie. Without a `data` axis to split, `accumulate` itself."""

    def run(params, biases, batches):
        if replicas() == 1:
            return accumulate(params, biases, batches)

        def local(params, biases, batches):
            with rows_held_whole((AXIS,)):
                grads, loss, tokens, counts = accumulate(params, biases, batches)
                grads = {k: _reduce(g, scatter.get(k), specs[k]) for k, g in grads.items()}
            return (grads, *jax.lax.psum((loss, tokens, counts), AXIS))

        grad_specs = {k: split_over_data(P(), scatter.get(k), params[k].ndim) for k in params}
        # check_vma=False: the gradients are taken inside, of the replica's own rows; with vma
        # checks JAX would sum them over `data` at every use of a weight (once per micro-batch).
        mapped = jax.shard_map(local, in_specs=(P(), P(), P(None, AXIS)), out_specs=(grad_specs, P(), P(), P()),
                               axis_names={AXIS}, check_vma=False)
        return mapped(params, biases, batches)

    return run


def replicas() -> int:
    """The data-parallel degree of the mesh the step is traced under (1: none)."""
    return axis_size(AXIS) if axes_in_context((AXIS,)) else 1


def _reduce(g, dim: int | None, spec: P):
    """One replica's gradient summed over `data` (split on `dim` for ZeRO-1), each device's own
    tiles of `spec` (see the module's docstring; `dim` is one `spec` leaves whole)."""

    def reduce(tile):
        if dim is None:
            return jax.lax.psum(tile, AXIS)
        return jax.lax.psum_scatter(tile, AXIS, scatter_dimension=dim, tiled=True)

    if g.ndim == 0 or AXIS in spec_axes(spec):
        return reduce(g)
    return schedule_map(reduce, in_specs=spec, out_specs=spec, check_vma=False)(g)

