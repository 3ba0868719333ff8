"""SIGTERM/SIGINT during training: finish the step, save a checkpoint, then exit.

Schedulers send SIGTERM before preempting a job, and people press Ctrl-C. Either one only sets a
flag that the loop reads between steps; the loop then saves and stops. The first signal restores
the previous handlers, so a second Ctrl-C stops at once (the save in progress is then a
temporary directory that the next run ignores).

With several processes the signal may reach some of them only, or at different steps, yet all
must save the same step. JAX's distributed runtime catches SIGTERM itself and agrees on a step
with the other processes (its preemption sync point); `reached(step)` asks it. SIGINT is turned
into a SIGTERM to this process, so Ctrl-C takes the same path.
"""

from __future__ import annotations

import os
import signal
import threading

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager; `reached(step)` says whether to save and stop after `step`."""

    def __init__(self, processes: int = 1):
        self.received: int | None = None
        self._agree = processes > 1
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # handlers can only live there
            # The runtime owns SIGTERM when processes must agree; only SIGINT is ours then.
            for sig in (signal.SIGINT,) if self._agree else _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self._restore()
        if self._agree:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.received = signum

    def reached(self, step: int) -> bool:
        """True when the loop should save after `step` and stop (every process: the same step)."""
        if self._agree:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.received = self.received or signal.SIGTERM
        return self.received is not None

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received else None
