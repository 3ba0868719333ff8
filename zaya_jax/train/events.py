"""The run's event log, `WORKDIR/events.jsonl`: what happened, when, in every attempt of a run.

One JSON object per line: `{"event": KIND, "time": wall seconds, "process": i, ...}`. Spans
(`startup`, `init`, `restore`, `data`, `compile`, `compile_wait`, `steps`, `eval`, `checkpoint`, `model_save`) are
written when they end, with `sec` their length, so each covers `[time - sec, time]`. Points:
`start` (an attempt began: its number, the previous attempt's cause), `checkpoint_commit` (a
save's background write finished), `bad_step`, `routing_overload` and `routing_recovered`
(`train/routing_watch.py`), `stop` and `end`. `rollback` is a span (reading
the checkpoint) that also undoes steps; `hang` is a span: the time without progress until the
watchdog fired. `train/goodput.py` turns
the lines into the time accounting.

Process 0 writes the run's course; a process that detects a fault itself (a hang) writes its own
line. Each line is a single `os.write` on a file opened with O_APPEND, so lines of different
processes never interleave, and a process killed mid-run loses at most the span it was in.

`ATTEMPT_ENV` is how a supervisor (`zaya launch --max-restarts`) tells each process which attempt
it is and why the previous one ended; `Attempt.from_environ` reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import time
from typing import Iterator

from zaya_jax.errors import StorageError, ZayaError
from zaya_jax.storage import free_space

EVENTS_NAME = "events.jsonl"
ATTEMPT_ENV = {"attempt": "ZAYA_ATTEMPT", "cause": "ZAYA_RESTART_CAUSE", "failed_at": "ZAYA_FAILED_AT",
               "launched_at": "ZAYA_LAUNCHED_AT"}


@dataclasses.dataclass(frozen=True)
class Attempt:
    """Which start of the run this process belongs to."""

    number: int = 0  # 0: started by a person or a scheduler; k > 0: the supervisor's k-th restart
    cause: str = ""  # why the previous attempt ended (the supervisor's words)
    failed_at: float | None = None  # wall time the supervisor saw that failure
    started_at: float = dataclasses.field(default_factory=time.time)  # when this attempt began

    @classmethod
    def from_environ(cls, environ, started_at: float) -> "Attempt":
        """The supervisor's settings, if any; `started_at` is this process's own start (the
        launcher's, when it says so, is earlier: the attempt began when it spawned us)."""
        def number(name, kind):
            text = environ.get(ATTEMPT_ENV[name], "")
            try:
                value = kind(text) if text else None
            except ValueError:
                value = math.nan
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ZayaError(f"{ATTEMPT_ENV[name]}={text!r} is not a finite number >= 0; it is set by zaya launch, "
                                "unset it when starting zaya train by hand")
            return value

        launched = number("launched_at", float)
        return cls(number("attempt", int) or 0, environ.get(ATTEMPT_ENV["cause"], ""), number("failed_at", float),
                   min(started_at, launched) if launched else started_at)


class EventLog:
    """Append-only writer of `events.jsonl` for one process (silent when disabled)."""

    def __init__(self, workdir: str, process: int = 0, enabled: bool = True):
        self.path = os.path.join(workdir, EVENTS_NAME)
        self.process, self.enabled = process, enabled
        self.listeners: list = []  # called with each event this process writes (the goodput ledger)

    def write(self, kind: str, at: float | None = None, **fields) -> dict:
        """One event at wall time `at` (default now)."""
        event = {"event": kind, "time": round(time.time() if at is None else at, 4), "process": self.process,
                 **fields}
        if self.enabled:
            self._append(json.dumps(event, allow_nan=False, default=float) + "\n")
            for listener in self.listeners:
                listener(event)
        return event

    def _append(self, line: str) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StorageError(f"cannot write {self.path}: no space left on device ({free_space(self.path)} "
                                   "free); free space and start the run again") from None
            raise ZayaError(f"cannot write {self.path} ({e.strerror}); choose a writable --workdir") from None

    @contextlib.contextmanager
    def span(self, kind: str, **fields) -> Iterator[dict]:
        """Time the block; write `kind` with its `sec` when it ends (fields may be added to the
        yielded dict inside the block). A block ended by an exception is not written."""
        began = time.time()
        extra: dict = {}
        yield extra
        self.write(kind, sec=round(time.time() - began, 4), **fields, **extra)


def read_events(workdir: str) -> list[dict]:
    """Every readable event of a run in time order (`read_log` says what was skipped)."""
    return read_log(workdir)[0]


def read_log(workdir: str) -> tuple[list[dict], list[int]]:
    """(every readable event of a run in time order, the numbers of the lines that were not one).
    A line is an event when it is UTF-8 JSON of an object with a string `event` and a finite
    number `time` (and `sec`, when it has one); a torn last line (a process killed mid-write) is
    one of the skipped. A log with no event in it is an error, not an empty run."""
    path = os.path.join(workdir, EVENTS_NAME)
    if not os.path.exists(path):
        raise ZayaError(f"{path} does not exist: {workdir} is not a zaya train workdir (or predates the event "
                        "log); give the --workdir of a run")
    if not os.path.isfile(path):
        raise ZayaError(f"{path} is not a file; the event log of a run is a file of JSON lines")
    events, skipped = [], []
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                event = _event(raw)
                if event is not None:
                    events.append(event)
                elif raw.strip():
                    skipped.append(number)
    except OSError as e:
        raise ZayaError(f"cannot read {path} ({e.strerror or e})") from None
    if not events:
        raise ZayaError(f"{path} has no readable event" + (f" ({len(skipped)} damaged line(s))" if skipped else "") +
                        "; it is not the event log of a run, or it was overwritten")
    return sorted(events, key=_begins), skipped


def _event(raw: bytes) -> dict | None:
    try:
        event = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None
    if not all(_finite(event.get(key, 0.0)) for key in ("time", "sec")) or "time" not in event:
        return None
    if any(key in event and not _whole(event[key]) for key in _WHOLE) or \
            any(key not in event for key in _NEEDS.get(event["event"], ())):
        return None
    return event


_WHOLE = ("attempt", "process", "first", "last", "step", "bad")  # counts: integers when present
_NEEDS = {"steps": ("first", "last", "sec"), "restore": ("step",), "rollback": ("step",)}  # what the ledger reads


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# `time` and `sec` are each rounded to 1e-4 s, so a span's computed begin may lie up to 1e-4 s
# before the attempt's `start` stamp it began at; a `start` sorts ahead of those spans.
_ROUNDING = 2e-4


def _begins(event: dict) -> float:
    begin = event["time"] - event.get("sec", 0.0)
    return begin - _ROUNDING if event["event"] == "start" else begin
