"""A restarted run loads its compiled train step from the run's persistent compilation cache."""

import io
import os
import shutil

import jax
import pytest

from zaya_jax.experiment import load_experiment
from zaya_jax.train import compile_cache
from zaya_jax.train.loop import train
from paths import TINY

QUICK = ["--config.train.steps=2", "--config.train.global_batch_size=8", "--config.train.seq_len=32",
         "--config.model.num_hidden_layers=2",
         "--config.train.scan_unroll=1", "--config.eval.batches=1", "--config.train.progress=false"]


@pytest.fixture(autouse=True)
def own_cache_then_the_sessions(tmp_path, monkeypatch):
    """These runs keep their own caches (not the test session's, see conftest); afterwards this
    worker goes back to the session's, so later tests do not write into tmp_path."""
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    yield
    monkeypatch.undo()
    compile_cache.use("workdir", str(tmp_path / "unused"))


def _train(workdir, *overrides):
    out = io.StringIO()
    summary = train(load_experiment(TINY, QUICK + list(overrides)), str(workdir), devices=jax.devices()[:1], out=out)
    return summary, out.getvalue()


def test_a_restarted_run_loads_its_train_step_from_the_cache_and_trains_identically(tmp_path):
    workdir = tmp_path / "run"
    first, text = _train(workdir)
    assert not first["compile_cache_hit"] and f"compiled the train step (cached in {workdir}/compile_cache)" in text
    assert any(name.startswith("jit_train_step") for name in os.listdir(workdir / "compile_cache"))
    shutil.rmtree(workdir / "checkpoints")  # the same run again from the start: nothing to resume
    second, text = _train(workdir)
    assert second["compile_cache_hit"] and f"loaded the train step from the compilation cache {workdir}" in text
    assert (second["first_loss"], second["last_loss"]) == (first["first_loss"], first["last_loss"])


def test_the_cache_can_be_shared_or_turned_off(tmp_path):
    shared = tmp_path / "shared_cache"
    _, text = _train(tmp_path / "a", f"--config.train.compile_cache={shared}")
    assert os.listdir(shared) and not (tmp_path / "a" / "compile_cache").exists()
    summary, text = _train(tmp_path / "b", f"--config.train.compile_cache={shared}")
    assert summary["compile_cache_hit"]  # another run of the same step: its compile is reused
    summary, text = _train(tmp_path / "c", "--config.train.compile_cache=off")
    assert not summary["compile_cache_hit"] and not (tmp_path / "c" / "compile_cache").exists()
    assert "compiled the train step in" in text


def test_jax_compilation_cache_dir_takes_the_place_of_the_workdirs_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "jax_env_cache"))
    summary, text = _train(tmp_path / "run")
    assert f"(cached in {tmp_path / 'jax_env_cache'})" in text
    assert os.listdir(tmp_path / "jax_env_cache") and not (tmp_path / "run" / "compile_cache").exists()
    assert compile_cache.directory("off", str(tmp_path / "run")) is None  # off stays off
    assert compile_cache.directory(str(tmp_path / "mine"), "w") == str(tmp_path / "mine")  # a named one stays


def test_an_unwritable_cache_directory_is_one_sentence(tmp_path):
    from zaya_jax.errors import ZayaError

    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ZayaError, match=r"^train.compile_cache: cannot create .*file/cache .*name a writable directory"):
        _train(tmp_path / "run", f"--config.train.compile_cache={tmp_path / 'file' / 'cache'}")
