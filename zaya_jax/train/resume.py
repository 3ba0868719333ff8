"""Where a run starts: the newest complete checkpoint in the workdir (checked against this run's
config and layout, restored onto its mesh, data iterator included), or fresh parameters."""

from __future__ import annotations

import dataclasses

from zaya_jax.errors import ZayaError
from zaya_jax.train.checkpoints import RunCheckpoints, check_compatible
from zaya_jax.train.events import EventLog
from zaya_jax.train.program import Program


def resume_or_init(program: Program, checkpoints: RunCheckpoints, iterator, meta: dict, out, events: EventLog):
    """(state, first step): from the newest complete checkpoint if there is one, else fresh."""
    step = checkpoints.latest_step()
    if step is None:
        with events.span("init"):
            return program.init(), 0
    where = checkpoints.step_dir(step)
    if not program.exp.config.checkpoint.resume:
        raise ZayaError(f"{checkpoints.directory} already holds checkpoints (newest: step {step}) and "
                        "checkpoint.resume is False; use a fresh --workdir, or set checkpoint.resume=True")
    with events.span("restore", step=step):
        saved = checkpoints.read_meta(step)
        # Checkpoints from before the bad-step guard hold no guard: restore the rest, start it empty.
        guarded = any(path.startswith(".guard") for path in saved["state_shapes"])
        check_compatible(saved, meta if guarded else _without_guard(meta), where)
        same_data = saved["data"] == meta["data"]
        target = program.placed_abstract_state()
        state = checkpoints.restore(step, target if guarded else dataclasses.replace(target, guard=None),
                                    iterator if same_data else None)
        if not guarded:
            state = dataclasses.replace(state, guard=program.fresh_guard())
    resharded = "" if saved["process_count"] == meta["process_count"] else \
        f"; saved by {saved['process_count']} process(es), resharded over {meta['process_count']}"
    print(f"resumed from {where} (step {step}{resharded})", file=out, flush=True)
    if not same_data:
        print("  the data settings changed since that checkpoint: the data pipeline starts from the "
              "beginning of the new settings", file=out, flush=True)
    return state, step


def _without_guard(meta: dict) -> dict:
    return {**meta, "state_shapes": {k: v for k, v in meta["state_shapes"].items() if not k.startswith(".guard")}}
