"""Training metrics on disk: one JSON line per record, plus TensorBoard scalars.

Owns the layout of a run's metrics under its workdir:

* `WORKDIR/metrics.jsonl` — one JSON object per `write` call, `{"step": N, ...record}`, flushed
  at once so a crashed process loses no line. Standard JSON only: NaN and ±inf (which JSON
  cannot hold) are written as `null`; numpy and jax scalars become numbers, arrays lists.
* `WORKDIR/tensorboard/` — TensorBoard event files (tensorboardX's format) with every scalar of the record (ints,
  floats and bools, the latter as 0/1) under its key; nested dicts give tags "outer/inner", and a
  flat list of numbers (the per-layer load entropy) one tag per entry, "name/0", "name/1", ...
  Nested lists and strings stay in the JSON only. NaN and inf are written as they are:
  TensorBoard shows them.

In a multi-process run only process 0 writes (`enabled=False` elsewhere): one file, one story.

Both files are written in the caller's thread (tensorboardX's `SummaryWriter` writes from a
thread of its own): a write that fails for the storage's reasons (a full disk) is one
`StorageError` line at the step that failed, and a failure while closing after another error does
not replace that error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any, Iterator

import numpy as np

from zaya_jax import storage
from zaya_jax.errors import StorageError, ZayaError


def _import_tensorboardx():
    """tensorboardX imports torch when it is installed, only to name torch tensors in its type
    hints (we pass numbers): a second of every start. Hidden for that one import, unless loaded."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this stands
    try:
        from tensorboardX import summary
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
    finally:
        if hide:
            del sys.modules["torch"]
    return EventsWriter, Event, summary


EventsWriter, Event, summary = _import_tensorboardx()

# tensorboardX warns at every NaN it writes; a skipped bad step writes one on purpose.
logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsWriter:
    """Append-only metrics sink for one run. Use as a context manager or call `close()`."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.workdir = workdir
        self.jsonl_path = os.path.join(workdir, JSONL_NAME)
        self.tensorboard_dir = os.path.join(workdir, TENSORBOARD_DIR)
        self._jsonl = None
        self._events = None
        self.enabled = enabled
        if not enabled:
            return
        try:
            os.makedirs(self.tensorboard_dir, exist_ok=True)
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
            # The process id keeps a restart within the same second from truncating the file
            # of the attempt before it (the name otherwise holds only the second and the host).
            self._events = EventsWriter(os.path.join(self.tensorboard_dir, "events"), f".{os.getpid()}")
        except OSError as e:
            self.close()
            raise ZayaError(
                f"cannot write metrics under {workdir} ({e.strerror or e}); choose a writable directory"
            ) from None

    def write(self, step: int, record: dict[str, Any]) -> None:
        """Append `{"step": step, **record}` to metrics.jsonl and its scalars to TensorBoard."""
        if not self.enabled:
            return
        if self._jsonl is None:
            raise ValueError("MetricsWriter.write after close()")
        step = _as_step(step)
        if "step" in record:
            raise ValueError("record must not hold a 'step' key; pass the step as the first argument")
        plain = _plain(record)
        line = json.dumps({"step": step, **_json_safe(plain)}, allow_nan=False)
        with self._storage(f"writing the metrics of step {step}"):
            self._jsonl.write(line + "\n")
            # flush() hands the line to the OS: a crashed process loses nothing. No fsync: it would
            # cost a disk round trip per step on network filesystems for the rarer machine crash.
            self._jsonl.flush()
            for tag, value in _scalars(plain):
                self._add(summary.scalar(tag, value), step)
            self._events.flush()

    def write_text(self, step: int, tag: str, text: str) -> None:
        """A text entry in TensorBoard's text tab (generated samples)."""
        if self.enabled and self._events is not None:
            step = _as_step(step)
            with self._storage(f"writing the text {tag!r} of step {step}"):
                self._add(summary.text(tag, text), step)
                self._events.flush()

    def _add(self, one: Any, step: int) -> None:
        self._events.write_event(Event(summary=one, step=step, wall_time=time.time()))

    def _storage(self, doing: str):
        return storage.guard(f"{doing} to {self.workdir}", self.workdir)

    def close(self) -> None:
        """Flush and close both sinks; safe to call twice, and after a failed write."""
        jsonl, events, self._jsonl, self._events = self._jsonl, self._events, None, None
        with self._storage("closing the metrics"):
            try:
                if jsonl is not None:
                    jsonl.close()
            finally:
                if events is not None:
                    events.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            self.close()
        except StorageError:
            if error is None:
                raise
            # else the run is already leaving with an error of its own (often the same full disk): that one is said


def _as_step(step) -> int:
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"step must be an integer, got {step!r}")
    return int(step)


def _plain(value: Any) -> Any:
    """numpy/jax values → Python numbers and lists (device arrays are pulled to the host)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__array__"):
        # tolist() turns any 0-d array into a Python scalar; recurse to reject complex and objects.
        return _plain(np.asarray(value).tolist())
    raise TypeError(f"cannot write a {type(value).__name__} as a metric: {value!r}")


def _json_safe(value: Any) -> Any:
    """Replace NaN and ±inf by None: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every number in `record`, nested dicts joined with "/"."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _scalars(value, tag + "/")
        elif isinstance(value, (bool, int, float)):
            yield tag, float(value)
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            yield from ((f"{tag}/{i}", float(v)) for i, v in enumerate(value))  # per layer: one curve each
