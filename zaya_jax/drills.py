"""Fault drills: faults a run injects into itself on purpose, to prove that it survives them.

`fault.drill` holds `;`-separated drills, each `KIND:key=value,...` (`process` defaults to 0,
`step` to 1, `attempt` to 0; steps count like `train.steps`, the first step is 1):

* `hang:process=P,step=S,sec=T` — process P sleeps T seconds inside step S, before dispatching it:
  the others wait for it in the step's collectives; the hang watchdog's drill.
* `nan:process=P,step=S,steps=N` — process P's rows of steps S..S+N-1 carry a NaN (in the loss
  mask), so those steps' loss and gradients are NaN: the bad-step guard's drill.
* `kill:process=P,step=S` — process P sends itself SIGKILL at step S (`kill -9` of one rank).
* `crash:process=P,step=S` — process P fails with an error at step S.

A drill acts in one attempt of the run (`attempt=K`, default 0: the first), so the supervisor's
restart shows the recovery instead of repeating the fault; `attempt=1` drills the restarted job.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time

import numpy as np

from zaya_jax.errors import ZayaError

KINDS = ("hang", "nan", "kill", "crash")
_KEYS = {"process": int, "step": int, "sec": float, "steps": int, "attempt": int}
_OWN_KEYS = {"hang": ("sec",), "nan": ("steps",), "kill": (), "crash": ()}  # beyond process, step, attempt


@dataclasses.dataclass(frozen=True)
class Drill:
    kind: str
    process: int = 0
    step: int = 1
    sec: float = 60.0  # hang only
    steps: int = 1  # nan only: consecutive steps
    attempt: int = 0  # the attempt it acts in


def parse(text: str) -> list[Drill]:
    """The drills of a `fault.drill` value; one-line errors."""
    drills = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, rest = part.partition(":")
        if kind.strip() not in KINDS:
            raise ZayaError(f"fault.drill {part!r}: the kind must be one of {', '.join(KINDS)}, e.g. "
                            "'hang:process=1,step=5,sec=600'")
        fields = {}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            key, _, value = item.partition("=")
            allowed = ("process", "step", "attempt") + _OWN_KEYS[kind.strip()]
            if key.strip() not in allowed:
                raise ZayaError(f"fault.drill {part!r}: {key.strip()!r} is not a key of a {kind.strip()} drill; "
                                f"its keys are {', '.join(allowed)}")
            try:
                fields[key.strip()] = _KEYS[key.strip()](value)
            except ValueError:
                raise ZayaError(f"fault.drill {part!r}: {key.strip()}={value!r} is not a number") from None
        drill = Drill(kind.strip(), **fields)
        if min(drill.process, drill.attempt) < 0 or min(drill.step, drill.steps) < 1 or \
                not (math.isfinite(drill.sec) and drill.sec >= 0):
            raise ZayaError(f"fault.drill {part!r}: process, attempt and sec must be finite and >= 0, step and "
                            "steps >= 1")
        drills.append(drill)
    return drills


def check_job(drills: list[Drill], processes: int, steps: int) -> None:
    """Refuse a drill that cannot fire in this job: aimed at a process it does not have, or at a
    step after its last."""
    for d in drills:
        if d.process >= processes:
            raise ZayaError(f"fault.drill {d.kind} aims at process {d.process}, and this job has {processes} "
                            f"(0..{processes - 1}); it would never fire", every_process=True)
        if d.step > steps:
            raise ZayaError(f"fault.drill {d.kind} acts at step {d.step}, after the run's last (train.steps = "
                            f"{steps}); it would never fire", every_process=True)


class Drills:
    """The drills this process runs; `apply(step, batch)` before each step is placed."""

    def __init__(self, drills: list[Drill], process: int, attempt: int):
        self.drills = [d for d in drills if d.process == process and d.attempt == attempt]

    def apply(self, step: int, batch: dict) -> dict:
        for d in self.drills:
            if d.kind == "nan" and d.step <= step < d.step + d.steps:
                batch = dict(batch, loss_mask=batch["loss_mask"].copy())
                batch["loss_mask"].flat[0] = np.nan
            elif d.step == step:
                self._act(d)
        return batch

    @staticmethod
    def _act(d: Drill) -> None:
        print(f"zaya train: fault drill: {d.kind} at step {d.step}", file=sys.stderr, flush=True)
        if d.kind == "hang":
            time.sleep(d.sec)
        elif d.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif d.kind == "crash":
            raise RuntimeError(f"fault drill: crash at step {d.step}")
