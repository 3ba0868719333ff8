"""The hang watchdog: a process that makes no progress for too long dumps its stacks and exits 3.

JAX's heartbeats catch a dead process; they do not catch a live one stuck in a collective whose
peer never arrives, in a filesystem call, or in a data reader. The training loop calls `beat()`
at every step; a daemon thread checks the time since the last beat against the limit of the
phase the loop is in: `fault.hang_timeout_sec` for steps, `fault.io_timeout_sec` inside
`allow(...)` (checkpoint restore and saves, the final model), none while compiling. When the limit
passes, the thread prints every Python thread's stack to stderr, hands the event to
`on_hang` (the event log), and ends the process with `exit_codes.HUNG`: the supervisor restarts
the job from its newest checkpoint. `os._exit`, because a normal exit would wait for the very
threads that hang.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from typing import Callable, Iterator

from zaya_jax import exit_codes


class Watchdog:
    """Context manager; `beat()` marks progress, `allow(sec, what)` a phase with its own limit."""

    def __init__(self, timeout_sec: float, on_hang: Callable[[float, str, float], None] = lambda *a: None,
                 process: int = 0, exit: Callable[[int], None] | None = None):
        self.timeout_sec, self.on_hang, self.process = float(timeout_sec), on_hang, process
        self._exit = exit or _exit_now
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._limit, self._what = self.timeout_sec, "a train step"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._watch, name="zaya-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self) -> None:
        with self._lock:
            self._last = time.monotonic()

    @contextlib.contextmanager
    def allow(self, seconds: float, what: str) -> Iterator[None]:
        """Inside the block the limit is `seconds` (0 = none) from its start; then back to steps."""
        with self._lock:
            saved = self._limit, self._what
            self._last, self._limit, self._what = time.monotonic(), float(seconds), what
        try:
            yield
        finally:
            with self._lock:
                self._last = time.monotonic()
                self._limit, self._what = saved

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_sec()):
            with self._lock:
                idle, limit, what = time.monotonic() - self._last, self._limit, self._what
            if limit and idle > limit:
                self._fire(idle, limit, what)
                return

    def _poll_sec(self) -> float:
        limits = [x for x in (self.timeout_sec, self._limit) if x]
        return min(1.0, min(limits) / 20) if limits else 1.0

    def _fire(self, idle: float, limit: float, what: str) -> None:
        # One write: the supervisor may kill this process as soon as another one exits, and the
        # line must not go out without the stacks it announces.
        print(f"zaya train: process {self.process} made no progress for {idle:.0f}s in {what} (limit {limit:g}s: "
              f"fault.hang_timeout_sec / fault.io_timeout_sec); every thread's stack follows; exiting with status "
              f"{exit_codes.HUNG} so the supervisor restarts the job\n{stacks()}", file=sys.stderr, flush=True)
        try:
            self.on_hang(idle, what, limit)
        finally:
            self._exit(exit_codes.HUNG)


def stacks() -> str:
    """Every Python thread's stack, innermost call last, each headed by the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _exit_now(code: int) -> None:
    import os

    sys.stdout.flush()
    os._exit(code)
