"""A checkpoint save on a full filesystem (a size-limited tmpfs): one `zaya: error:` line naming the
path, the step and the free space, exit status 5 (`exit_codes.STORAGE`: not restarted into the same
full disk), no background-thread tracebacks, the previous checkpoint kept, and the run resumes
once space is freed."""

import os
import subprocess
import uuid

import pytest

from paths import TINY
from zaya_process import zaya

RUN = ["--config.checkpoint.every_steps=10", "--config.train.compile_cache=off", "--config.eval.every_steps=0",
       "--config.train.progress=False", "--config.checkpoint.async_save=True"]


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
    assert full.returncode == 5, full.stderr[-3000:]
    assert len(lines) == 1, full.stderr[-3000:]
    assert lines[0].startswith(f"zaya: error: saving the checkpoint of step 20 to {workdir / 'checkpoints'} failed: "
                               "no space left on device (")
    assert "MiB free); the checkpoint of step 10 is kept" in lines[0]
    kept = os.listdir(workdir / "checkpoints")
    assert "10" in kept and "20" not in kept, kept

    os.remove(filler)
    again = zaya("train", f"--config={TINY}", f"--workdir={workdir}", "--config.train.steps=20", *RUN)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "20" in os.listdir(workdir / "checkpoints")
