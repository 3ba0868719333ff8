"""Where a run starts: the newest complete checkpoint in the workdir (checked against this run's
config and layout, restored onto its mesh, data iterator included), or fresh parameters."""

from __future__ import annotations

import dataclasses
import os

import jax

from zaya_jax.errors import ZayaError
from zaya_jax.train.checkpoints import RunCheckpoints, check_compatible, newest_meta, run_meta
from zaya_jax.train.events import EventLog
from zaya_jax.train.program import Program


def resume_or_init(program: Program, checkpoints: RunCheckpoints, iterator, meta: dict, out, events: EventLog):
    """(state, first step): from the newest complete checkpoint if there is one, else fresh."""
    step = checkpoints.latest_step()
    if step is None:
        with events.span("init"):
            return program.init(), 0
    where = checkpoints.step_dir(step)
    with events.span("restore", step=step):
        saved, guarded = _checked_meta(program, checkpoints, step, meta)
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


def check_resumable(program: Program, workdir: str) -> None:
    """Before the run writes to its workdir: the newest checkpoint there, if any, is one this run
    may resume (checkpoint.resume, and the same model, state shapes and seed). Read from the
    files, with no Orbax manager: nothing here waits for the job's other processes."""
    newest = newest_meta(os.path.join(workdir, "checkpoints"))
    if newest is None:
        return
    step, where, saved = newest
    _refuse_unless_resuming(program, os.path.dirname(where), step)
    _check(saved, run_meta(program.exp, program.abstract_state(), jax.process_count()), where)


def _checked_meta(program: Program, checkpoints: RunCheckpoints, step: int, meta: dict) -> tuple[dict, bool]:
    """(the checkpoint's metadata, whether it holds the bad-step guard), once it is checked against
    this run; checkpoints from before the guard are restored without it, the guard starts empty."""
    _refuse_unless_resuming(program, checkpoints.directory, step)
    saved = checkpoints.read_meta(step)
    return saved, _check(saved, meta, checkpoints.step_dir(step))


def _check(saved: dict, meta: dict, where: str) -> bool:
    """Whether the checkpoint holds the bad-step guard, once it is checked against this run."""
    guarded = any(path.startswith(".guard") for path in saved["state_shapes"])
    check_compatible(saved, meta if guarded else _without_guard(meta), where)
    return guarded


def _refuse_unless_resuming(program: Program, directory: str, step: int) -> None:
    if not program.exp.config.checkpoint.resume:
        raise ZayaError(f"{directory} already holds checkpoints (newest: step {step}) and "
                        "checkpoint.resume is False; use a fresh --workdir, or set checkpoint.resume=True")


def _without_guard(meta: dict) -> dict:
    return {**meta, "state_shapes": {k: v for k, v in meta["state_shapes"].items() if not k.startswith(".guard")}}
