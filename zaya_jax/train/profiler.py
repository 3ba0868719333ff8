"""The profiler window: a `jax.profiler` trace of a few train steps, written under the workdir.

`train.profile_steps=START:STOP` traces the steps numbered START to STOP - 1 (as `metrics.jsonl`
numbers them, from 1); the trace lands in `WORKDIR/profile/plugins/profile/<run>/` (under
`WORKDIR/profile/process_<i>/` for each process of a multi-process job), an `.xplane.pb` and a
`.trace.json.gz`, which TensorBoard's profile plugin and Perfetto (via `xprof`) open. Each
step inside the window is a `StepTraceAnnotation`, so the viewers split the trace by step. The
last traced step is waited for before the trace stops, so its device work is in it. Steps before
the window (compilation, the first steps' warm-up) stay out of it.
"""

from __future__ import annotations

import contextlib
import os

import jax


DIRECTORY = "profile"


class ProfileWindow:
    """`step(n)` wraps train step n: starts the trace before the window's first step, annotates
    the steps inside it, and `after(n, result)` stops it after the last one. `close()` stops a
    trace the run left open (it ended inside the window)."""

    def __init__(self, window: tuple[int, int] | None, workdir: str, events=None):
        self.window, self.events = window, events
        self.directory = os.path.join(workdir, DIRECTORY)
        if jax.process_count() > 1:  # the trace files are named by host: local processes would collide
            self.directory = os.path.join(self.directory, f"process_{jax.process_index()}")
        self.active = False

    def inside(self, step: int) -> bool:
        return self.window is not None and self.window[0] <= step < self.window[1]

    def step(self, step: int):
        """Context for running step `step` (1-based)."""
        if not self.inside(step):
            return contextlib.nullcontext()
        if not self.active:
            jax.profiler.start_trace(self.directory)
            self.active = True
            self._event("profile_start", step)
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, result) -> None:
        """After step `step`: at the window's last step, wait for its result and stop the trace."""
        if self.active and step == self.window[1] - 1:
            jax.block_until_ready(result)
            self._stop(step)

    def close(self, step: int) -> None:
        if self.active:
            self._stop(step)

    def _stop(self, step: int) -> None:
        jax.profiler.stop_trace()
        self.active = False
        self._event("profile_stop", step)

    def _event(self, name: str, step: int) -> None:
        if self.events is not None:
            self.events.write(name, step=step, directory=self.directory)
