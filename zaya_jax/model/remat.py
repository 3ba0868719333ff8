"""Rematerialisation policies for the per-block checkpointing of the training forward.

`none` keeps every activation for the backward; `full` keeps only each block's inputs and
recomputes the block in the backward (least memory); `dots` also keeps the outputs of the plain
matmuls (projections) and recomputes the rest (attention core, convs, norms, experts).
"""

from __future__ import annotations

import jax
from flax import nnx

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def block_runner(policy: str, dtype, layout):
    """`run(block, h, router_state, seq)` under the named policy, laid out by `layout`."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}; choose one of {sorted(REMAT_POLICIES)}")

    def run(block, h, router_state, seq):
        return block(h, router_state, seq, dtype, layout)

    if REMAT_POLICIES[policy] is None:
        return run
    return nnx.remat(run, policy=REMAT_POLICIES[policy], prevent_cse=False)
