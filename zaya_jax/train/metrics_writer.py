"""Training metrics on disk: one JSON line per record, plus TensorBoard scalars.

Owns the layout of a run's metrics under its workdir:

* `WORKDIR/metrics.jsonl` — one JSON object per `write` call, `{"step": N, ...record}`, flushed
  at once so a crashed process loses no line. Standard JSON only: NaN and ±inf (which JSON
  cannot hold) are written as `null`; numpy and jax scalars become numbers, arrays lists.
* `WORKDIR/tensorboard/` — tensorboardX event files with every scalar of the record (ints,
  floats and bools, the latter as 0/1) under its key; nested dicts give tags "outer/inner", and a
  flat list of numbers (the per-layer load entropy) one tag per entry, "name/0", "name/1", ...
  Nested lists and strings stay in the JSON only. NaN and inf are written as they are:
  TensorBoard shows them.

In a multi-process run only process 0 writes (`enabled=False` elsewhere): one file, one story.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any, Iterator

import numpy as np

from zaya_jax.errors import ZayaError


def _import_summary_writer():
    """tensorboardX imports torch when it is installed, only to name torch tensors in its type
    hints (we pass numbers): a second of every start. Hidden for that one import, unless loaded."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this stands
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


SummaryWriter = _import_summary_writer()

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
        self._tb = None
        self.enabled = enabled
        if not enabled:
            return
        try:
            # Create everything here so an unwritable workdir fails now, with its name, rather
            # than inside tensorboardX's background writer thread.
            os.makedirs(self.tensorboard_dir, exist_ok=True)
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
            self._tb = SummaryWriter(logdir=self.tensorboard_dir)
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
        self._jsonl.write(line + "\n")
        # flush() hands the line to the OS: a crashed process loses nothing. No fsync: it would
        # cost a disk round trip per step on network filesystems for the rarer machine crash.
        self._jsonl.flush()
        for tag, value in _scalars(plain):
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def write_text(self, step: int, tag: str, text: str) -> None:
        """A text entry in TensorBoard's text tab (generated samples)."""
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, text, _as_step(step))
            self._tb.flush()

    def close(self) -> None:
        """Flush and close both sinks; safe to call twice."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
