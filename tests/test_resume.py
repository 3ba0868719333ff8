"""Durable runs: exact resume after SIGKILL (between checkpoints and during a save), SIGTERM saves,
resharded resume on other layouts and device counts, and bad checkpoints as one-line errors."""

import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest
from run_outputs import losses as _losses

from zaya_jax.errors import ZayaError
from zaya_jax.experiment import load_experiment
from zaya_jax.train.loop import train
from zaya_process import zaya
from paths import ROOT, TINY

STEPS = 12
RUN = ["--config.train.steps=12", "--config.optim.warmup_steps=2", "--config.train.log_every=1",
       "--config.train.global_batch_size=8", "--config.train.seq_len=32", "--config.model.num_hidden_layers=2",
       "--config.train.scan_unroll=1",
       "--config.eval.batches=1", "--config.train.progress=false", "--config.checkpoint.every_steps=4",
       "--config.checkpoint.keep=3"]


def _train(workdir, *extra, module=("-m", "zaya_jax")):
    return zaya("train", f"--config={TINY}", f"--workdir={workdir}", *RUN, *extra, module=module)


def _signal_at(when, step, sig):
    return (os.path.join(ROOT, "tests", "signal_at.py"), when, str(step), sig)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = _train(workdir)
    assert result.returncode == 0, result.stderr
    return _losses(workdir)


def _assert_bit_identical_from(workdir, step, uninterrupted):
    resumed = _losses(workdir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for s in range(step + 1, STEPS + 1):
        assert resumed[s] == uninterrupted[s], (s, resumed[s], uninterrupted[s])  # bit-identical


def test_sigkill_between_checkpoints_resumes_bit_identically(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    killed = _train(workdir, module=_signal_at("logged", 7, "KILL"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(_losses(workdir)) == list(range(1, 8))  # got to step 7; the last checkpoint is step 4
    result = _train(workdir)
    assert result.returncode == 0, result.stderr
    assert "(step 4)" in result.stdout
    _assert_bit_identical_from(workdir, 4, uninterrupted)


def test_sigkill_during_a_save_falls_back_to_the_previous_checkpoint(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    killed = _train(workdir, module=_signal_at("saving", 8, "KILL"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    leftovers = os.listdir(workdir / "checkpoints")
    assert "4" in leftovers and "8" not in leftovers and any("tmp" in name for name in leftovers)
    result = _train(workdir)
    assert result.returncode == 0, result.stderr
    assert "(step 4)" in result.stdout
    assert not any("tmp" in name for name in os.listdir(workdir / "checkpoints"))  # cleaned up
    _assert_bit_identical_from(workdir, 4, uninterrupted)


@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_sigterm_and_sigint_save_then_the_same_command_finishes_the_run(tmp_path, uninterrupted, sig):
    workdir = tmp_path / "run"
    stopped = _train(workdir, module=_signal_at("logged", 6, sig))
    assert stopped.returncode == 128 + getattr(signal, "SIG" + sig), stopped.stderr
    assert f"stopped by SIG{sig} after step 6" in stopped.stdout
    assert "6" in os.listdir(workdir / "checkpoints")
    result = _train(workdir)
    assert result.returncode == 0, result.stderr
    assert "(step 6)" in result.stdout
    _assert_bit_identical_from(workdir, 6, uninterrupted)
    saves = [json.loads(line) for line in open(workdir / "metrics.jsonl") if "checkpoint_" in line]
    assert {r["step"] for r in saves if "checkpoint_blocking_sec" in r} == {4, 6, 8, 12}
    assert {r["step"] for r in saves if "checkpoint_background_sec" in r} == {4, 6, 8, 12}


# ---- resharded resume (in process, 8 fake devices) -----------------------------------------
def _exp(steps, *extra, **mesh):
    # One schedule for both lengths: the cosine would otherwise follow train.steps.
    overrides = RUN + [f"--config.train.steps={steps}", "--config.optim.decay_steps=8", "--config.mesh.data=1", *extra]
    overrides += [f"--config.mesh.{axis}={size}" for axis, size in mesh.items()]
    return load_experiment(TINY, overrides)


@pytest.fixture(scope="module")
def saved_on_data8(tmp_path_factory):
    """A run trained 4 steps on data=8 (checkpoint at step 4), and the same run trained 8 steps."""
    base = tmp_path_factory.mktemp("data8")
    full = base / "full"
    train(_exp(8, data=8), str(full), devices=jax.devices()[:8], out=open(os.devnull, "w"))
    half = base / "half"
    train(_exp(4, data=8), str(half), devices=jax.devices()[:8], out=open(os.devnull, "w"))
    return half, _losses(full)


@pytest.mark.parametrize("mesh, devices", [(dict(fsdp=4, expert=2), 8), (dict(data=4), 4),
                                           (dict(expert=2, fsdp=2), 4), (dict(data=1), 1)], ids=str)
def test_resharded_resume_trains_like_the_uninterrupted_run(tmp_path, saved_on_data8, mesh, devices):
    half, full = saved_on_data8
    workdir = tmp_path / "run"
    shutil.copytree(half, workdir)
    summary = train(_exp(8, **mesh), str(workdir), devices=jax.devices()[:devices], out=open(os.devnull, "w"))
    assert summary["start_step"] == 4
    resumed = _losses(workdir)
    np.testing.assert_allclose([resumed[s] for s in range(5, 9)], [full[s] for s in range(5, 9)], rtol=2e-5)


def test_zero1_state_resumes_with_zero1_off_and_back_on(tmp_path, saved_on_data8):
    # Saved with the optimizer state split over data=8 (ZeRO-1, the default); steps 5-6 run with
    # it whole on data=4, steps 7-8 split again over data=8: the losses are the uninterrupted run's.
    half, full = saved_on_data8
    workdir = tmp_path / "run"
    shutil.copytree(half, workdir)
    off = "--config.optim.shard_over_data=false"
    train(_exp(6, off, data=4), str(workdir), devices=jax.devices()[:4], out=open(os.devnull, "w"))
    summary = train(_exp(8, data=8), str(workdir), devices=jax.devices()[:8], out=open(os.devnull, "w"))
    assert summary["start_step"] == 6
    resumed = _losses(workdir)
    np.testing.assert_allclose([resumed[s] for s in range(5, 9)], [full[s] for s in range(5, 9)], rtol=2e-5)


def test_run_saved_under_tsp_resumes_under_expert_x_data(tmp_path, saved_on_data8):
    # Across layout families: TSP stores weights split on their hidden dim and the experts on
    # their width; expert x data splits the experts themselves. Orbax reshards on restore.
    _, full = saved_on_data8
    workdir = tmp_path / "run"
    train(_exp(4, tsp=8), str(workdir), devices=jax.devices()[:8], out=open(os.devnull, "w"))
    summary = train(_exp(8, expert=4, data=2), str(workdir), devices=jax.devices()[:8], out=open(os.devnull, "w"))
    assert summary["start_step"] == 4
    resumed = _losses(workdir)
    np.testing.assert_allclose([resumed[s] for s in range(1, 9)], [full[s] for s in range(1, 9)], rtol=2e-5)


# ---- bad checkpoints --------------------------------------------------------------------------
def _listing(path):
    return sorted((root, tuple(sorted(files))) for root, _, files in os.walk(path))


def test_damaged_checkpoint_is_one_error_and_nothing_is_touched(tmp_path, saved_on_data8):
    half, _ = saved_on_data8
    workdir = tmp_path / "run"
    shutil.copytree(half, workdir)
    state_dir = workdir / "checkpoints" / "4" / "state"
    victim = max((p for p in state_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated mid-file
    before = _listing(workdir / "checkpoints")
    with pytest.raises(ZayaError, match="could not be read") as err:
        train(_exp(8, data=8), str(workdir), devices=jax.devices()[:8], out=open(os.devnull, "w"))
    assert str(workdir / "checkpoints" / "4") in str(err.value) and "\n" not in str(err.value)
    assert _listing(workdir / "checkpoints") == before


def test_checkpoint_of_another_model_shape_or_balancer_is_refused(tmp_path, saved_on_data8):
    half, _ = saved_on_data8
    workdir = tmp_path / "run"
    shutil.copytree(half, workdir)
    before = _listing(workdir / "checkpoints")
    exp = load_experiment(TINY, RUN + ["--config.train.steps=8", "--config.model.hidden_size=64"])
    with pytest.raises(ZayaError, match="different model: model.hidden_size is 128 there but 64"):
        train(exp, str(workdir), devices=jax.devices()[:1], out=open(os.devnull, "w"))
    # Saved under solve (the default), resumed under spread: the balancer's state is another shape.
    exp = load_experiment(TINY, RUN + ["--config.train.steps=8", "--config.optim.balancer=spread"])
    with pytest.raises(ZayaError, match="trained with another balancer .*--config.optim.balancer=spread"):
        train(exp, str(workdir), devices=jax.devices()[:1], out=open(os.devnull, "w"))
    exp = load_experiment(TINY, RUN + ["--config.train.steps=8", "--config.checkpoint.resume=false"])
    with pytest.raises(ZayaError, match="checkpoint.resume is False"):
        train(exp, str(workdir), devices=jax.devices()[:1], out=open(os.devnull, "w"))
    assert _listing(workdir / "checkpoints") == before


def test_partial_checkpoint_without_metadata_is_refused(tmp_path, saved_on_data8):
    half, _ = saved_on_data8
    workdir = tmp_path / "run"
    shutil.copytree(half, workdir)
    shutil.rmtree(workdir / "checkpoints" / "4" / "meta")
    with pytest.raises(ZayaError, match="checkpoints/4") as err:
        train(_exp(8, data=8), str(workdir), devices=jax.devices()[:8], out=open(os.devnull, "w"))
    assert "\n" not in str(err.value)
