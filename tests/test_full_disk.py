"""Writes on a full filesystem. A checkpoint save on a full filesystem (a size-limited tmpfs): one `zaya: error:` line naming the
path, the step and the free space, exit status 5 (`exit_codes.STORAGE`: not restarted into the same
full disk), no background-thread tracebacks, the previous checkpoint kept, and the run resumes
once space is freed."""

import os
import re
import subprocess
import uuid

import pytest

from paths import TINY
from zaya_process import zaya

# The test session's compilation cache (tests/conftest.py), off the small filesystem: the three runs
# compile the step once.
RUN = ["--config.checkpoint.every_steps=10", f"--config.train.compile_cache={os.environ['JAX_COMPILATION_CACHE_DIR']}",
       "--config.eval.every_steps=0", "--config.train.progress=False", "--config.checkpoint.async_save=True"]


@pytest.fixture
def small_filesystem(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a size-limited tmpfs here ({made.stderr.strip() or 'mount failed'}): needs root "
                    "or CAP_SYS_ADMIN")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(folder, leave_bytes: int) -> str:
    filler = os.path.join(folder, f"filler-{uuid.uuid4().hex}")
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with open(filler, "wb") as f:
        f.truncate(0)
        chunk = b"\0" * (1 << 20)
        left = max(free - leave_bytes, 0)
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
    return filler


@pytest.mark.slow
def test_a_save_on_a_full_disk_is_one_line_exit_5_and_keeps_the_previous_checkpoint(small_filesystem):
    workdir = small_filesystem / "run"
    first = zaya("train", f"--config={TINY}", f"--workdir={workdir}", "--config.train.steps=10", *RUN)
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["10"]
    filler = _fill(str(small_filesystem), leave_bytes=64 * 1024)

    full = zaya("train", f"--config={TINY}", f"--workdir={workdir}", "--config.train.steps=20", *RUN)
    lines = [line for line in full.stderr.splitlines() if line.strip()]
    assert full.returncode == 5, _where(full.stderr)
    assert len(lines) == 1, _where(full.stderr)
    assert lines[0].startswith(f"zaya: error: saving the checkpoint of step 20 to {workdir / 'checkpoints'} failed: "
                               "no space left on device (")
    assert "MiB free); the checkpoint of step 10 is kept" in lines[0]
    kept = os.listdir(workdir / "checkpoints")
    assert "10" in kept and "20" not in kept, kept

    os.remove(filler)
    again = zaya("train", f"--config={TINY}", f"--workdir={workdir}", "--config.train.steps=20", *RUN)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "20" in os.listdir(workdir / "checkpoints")


def _where(stderr: str) -> str:
    """What a failed run said, its traceback's frames first: tensorstore's messages quote a spec of
    thousands of characters, which push the frames out of a plain tail."""
    frames = [line for line in stderr.splitlines() if line.startswith(("zaya:", "Traceback", "  File ", "During "))]
    return "\n".join(frames)[-3000:] + "\n...\n" + stderr[-1000:]


class _ManagerFailingOnce:
    """Orbax's manager after a save that ran out of space: the error surfaces at the wait, and (the
    path a CI run's traceback may have taken) once more at close."""

    def __init__(self, at: tuple[str, ...]):
        self.at = set(at)

    def _fail(self, where):
        if where in self.at:
            self.at.discard(where)
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "manifest.ocdbt": No space left on device')

    def wait_until_finished(self):
        self._fail("wait")

    def close(self):
        self._fail("close")

    def latest_step(self):
        return 10


def test_closing_after_a_failed_save_says_nothing_more_and_a_failure_only_at_close_is_said(tmp_path):
    from zaya_jax.errors import StorageError
    from zaya_jax.train.checkpoints import RunCheckpoints

    said = RunCheckpoints(str(tmp_path / "a"), keep=2)
    said._manager.close()
    said._manager = _ManagerFailingOnce(at=("wait", "close"))
    with pytest.raises(StorageError, match="no space left on device"):
        said.wait()
    said.close()  # the same failure again, from close: said already

    unsaid = RunCheckpoints(str(tmp_path / "b"), keep=2)
    unsaid._manager.close()
    unsaid._manager = _ManagerFailingOnce(at=("close",))
    with pytest.raises(StorageError, match="finishing the checkpoint writes in .* failed: no space left on device "
                                           r"\(.*\); the checkpoint of step 10 is kept"):
        unsaid.close()


def test_the_event_log_on_a_full_disk_is_a_storage_error(small_filesystem):
    from zaya_jax.errors import StorageError
    from zaya_jax.train.events import EventLog

    log = EventLog(str(small_filesystem))
    log.write("start", at=0.0, attempt=0)
    _fill(str(small_filesystem), leave_bytes=0)
    with pytest.raises(StorageError, match="events.jsonl: no space left on device") as error:
        for _ in range(10_000):  # the filesystem's last partial block may take a few lines
            log.write("steps", sec=1.0, first=0, last=1, bad=0, padding="x" * 4000)
    assert error.value.exit_code == 5


def test_a_storage_failure_inside_the_guard_is_one_storage_error_and_others_pass(tmp_path):
    import errno

    from zaya_jax import storage
    from zaya_jax.errors import StorageError

    with pytest.raises(StorageError, match=f"writing the final model to {tmp_path} failed: no space left on device "):
        with storage.guard(f"writing the final model to {tmp_path}", str(tmp_path)):
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "x": No space left on device [os_error_code=28]')
    with pytest.raises(StorageError, match="disk quota exceeded"):
        with storage.guard(f"writing the final model to {tmp_path}", str(tmp_path)):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
    with pytest.raises(ValueError, match="a shape mismatch"):
        with storage.guard(f"writing the final model to {tmp_path}", str(tmp_path)):
            raise ValueError("a shape mismatch")


def _metrics_on_a_full_disk(folder):
    """A metrics writer with one step written, then no space left."""
    from zaya_jax.train.metrics_writer import MetricsWriter

    writer = MetricsWriter(str(folder))
    writer.write(1, {"loss": 2.5})
    _fill(str(folder), leave_bytes=0)
    return writer


def _write_until_full(writer):
    """Steps of a few hundred bytes each until one fails: the filesystem's last partial blocks take
    a few; the one that fails stays in the file's buffer, as a step's line does on a real full disk."""
    for step in range(2, 10_000):
        writer.write(step, {"loss": 2.5, "note": "x" * 200})


def test_a_metrics_write_on_a_full_disk_is_one_storage_error_naming_the_step(small_filesystem):
    from zaya_jax.errors import StorageError

    writer = _metrics_on_a_full_disk(small_filesystem)
    with pytest.raises(StorageError) as error:
        _write_until_full(writer)
    assert re.fullmatch(rf"writing the metrics of step \d+ to {small_filesystem} failed: no space left on device "
                        r"\(0\.0 MiB free\); free space \(or choose another --workdir\) and start the run again",
                        str(error.value)), str(error.value)
    assert error.value.exit_code == 5
    with pytest.raises(StorageError, match=f"closing the metrics to {small_filesystem} failed"):
        writer.close()  # the failed line is still buffered: closing meets the full disk again
    writer.close()  # and is over: a second close does nothing


def test_closing_the_metrics_after_a_failure_keeps_that_failure(small_filesystem):
    """A CI run's checkpoint save failed on a full disk, then closing the metrics met the same disk
    and its error replaced the save's one line with a traceback (exit 1)."""
    from zaya_jax.errors import StorageError

    writer = _metrics_on_a_full_disk(small_filesystem)
    with pytest.raises(StorageError, match="writing the metrics of step"):
        with writer:
            _write_until_full(writer)
    assert writer._jsonl is None and writer._events is None
