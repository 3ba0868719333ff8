"""Rematerialisation policies for the per-block checkpointing of the training forward.

`none` keeps every activation for the backward; `full` keeps only each block's inputs and
recomputes the block in the backward (least memory); `dots` also keeps the outputs of the plain
matmuls (projections) and recomputes the rest (attention core, convs, norms, experts); `moe`
keeps the named MoE tensors — the tokens sorted by expert and the grouped matmuls' outputs
(`MOE_SAVED`, tagged in `model/moe.py`) — and recomputes the rest (attention, router, norms):
the experts' matmuls, most of a block's FLOPs, are not run twice.

The policy wraps the body of the layer scan (`model/layer_stack.py`). Inside a scan of one block
per iteration JAX needs no CSE barrier (`prevent_cse=False`, the cheaper program); unrolled
blocks (`scan=False`, or several per iteration) keep the barrier, without which XLA merges the
recomputation back into the forward and keeps everything (measured: no saving at all).
"""

from __future__ import annotations

from typing import Callable

import jax

MOE_SAVED = ("moe_dispatch", "moe_gate_up", "moe_down")

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "moe": jax.checkpoint_policies.save_only_these_names(*MOE_SAVED),
}


def without_weight_copies(fn: Callable) -> Callable:
    """`fn`, the experts' forward, with their weights' fsdp all-gather (`parallel/experts_schedule.py`),
    casts to the compute dtype and the fused [E, H, 2·I] gate/up made again in the backward and
    everything else kept. The grouped matmuls keep their weight operand for the backward: without
    this and without remat every layer's experts would leave a copy of their weights behind until
    the backward (the gathered layer, the fused gate/up), a whole extra set of expert weights over
    the layers. (The cast down below fp32 is made once per step, before the layer scan:
    `params.in_compute_dtype`.) A gather, a cast and a concatenation are cheap to redo; the CSE
    barrier stops XLA from merging them back into the forward's. Inside a remat policy's checkpoint
    it changes nothing the policy keeps."""
    return jax.checkpoint(fn, policy=_not_weight_copies)


def _not_weight_copies(prim, *avals, **params) -> bool:
    """Saveable: anything but a rank-3 cast, concatenation or all-gather, which in the experts'
    forward are their weights' ([E, ·, ·]; the tokens are only sorted, gathered and multiplied
    there, as rows)."""
    return not (prim.name in ("convert_element_type", "concatenate", "all_gather") and avals[0].ndim == 3)


def checkpointed(fn: Callable, policy: str, *, in_scan: bool) -> Callable:
    """`fn` under the named policy (unchanged for `none`)."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}; choose one of {sorted(REMAT_POLICIES)}")
    if REMAT_POLICIES[policy] is None:
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[policy], prevent_cse=not in_scan)
