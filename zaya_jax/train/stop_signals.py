"""SIGTERM/SIGINT during training: finish the step, save a checkpoint, then exit.

Schedulers send SIGTERM before preempting a job, and people press Ctrl-C. Either one only sets a
flag that the loop reads between steps; the loop then saves and stops. The first signal restores
the previous handlers, so a second Ctrl-C stops at once (the save in progress is then a
temporary directory that the next run ignores).
"""

from __future__ import annotations

import signal
import threading

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager; `.received` is the first signal's number, or None."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # handlers can only live there
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received else None
