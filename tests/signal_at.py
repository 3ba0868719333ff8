"""Test helper: `zaya train ...` that sends itself a signal at a chosen moment, deterministically.

Usage: python tests/signal_at.py WHEN STEP SIGNAL <zaya train arguments>
  WHEN = logged  right after step STEP's metrics line is written (between checkpoints)
  WHEN = saving  while checkpoint STEP is being saved: its arrays, data state and metadata are
                 on disk, but Orbax has not yet renamed the temporary directory (the commit)
  SIGNAL = KILL, TERM or INT

Polling a subprocess from outside cannot hit a 30 ms step reliably; patching the two moments
in-process can.
"""

import os
import signal
import sys
import time

from orbax.checkpoint._src.path import atomicity

from zaya_jax.cli import main
from zaya_jax.train import metrics_writer

WHEN, STEP, SIGNAL = sys.argv[1], int(sys.argv[2]), getattr(signal, "SIG" + sys.argv[3])


def _send():
    os.kill(os.getpid(), SIGNAL)


def _saves_in_flight() -> bool:
    workdir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir="))
    directory = os.path.join(workdir, "checkpoints")
    return any("tmp" in name for name in os.listdir(directory)) if os.path.isdir(directory) else False


if WHEN == "saving":
    _finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def _finalize_with_signal(self):
        if self.get_final().name == str(STEP):
            _send()
        return await _finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = _finalize_with_signal
elif WHEN == "logged":
    _write = metrics_writer.MetricsWriter.write

    def _write_with_signal(self, step, record):
        _write(self, step, record)
        if step == STEP and "loss" in record:
            # Steps take milliseconds here but a background save takes longer: let the earlier
            # save commit first, as it would in a real run, so the kill lands between checkpoints.
            deadline = time.time() + 120
            while _saves_in_flight() and time.time() < deadline:
                time.sleep(0.01)
            _send()

    metrics_writer.MetricsWriter.write = _write_with_signal
else:
    sys.exit(f"unknown WHEN {WHEN!r}")
sys.exit(main(sys.argv[4:]))
