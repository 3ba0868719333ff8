"""Refusals through the real CLI (issue: hardening): one `zaya: error:` line, exit status 2, and
nothing new on disk — no workdir, no event log, no compilation cache — for bad data, a bad
tokenizer, drills that cannot fire, and a process 0 that cannot host the coordinator."""

import os
import socket

import pytest

from paths import TINY
from zaya_process import zaya, zaya_env


def _refused(result, needle: str) -> None:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert lines and lines[-1].startswith("zaya: error: ") and needle in lines[-1], lines[-3:]
    assert not any("Traceback" in line or "Check failure" in line for line in lines), result.stderr[-2000:]


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "binary.jsonl").write_bytes(b"\x00\x01\x02\xffnot json\n")
    (tmp_path / "late_garbage.jsonl").write_bytes(b'{"text": "fine"}\n' * 50 + b"plain text\n" + b'{"text": "x"}\n')
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "schema.jsonl").write_text('{"content": "text under another field"}\n')
    return tmp_path


@pytest.mark.parametrize("override, needle", [
    ("--config.data.source={tmp}/missing.jsonl", "does not exist"),
    ("--config.data.source={tmp}/binary.jsonl", "binary.jsonl line 1 does not start a JSON object"),
    ("--config.data.source={tmp}/late_garbage.jsonl", "late_garbage.jsonl line 51 does not start a JSON object"),
    ("--config.data.source={tmp}/empty_dir", "has no .txt, .jsonl, .parquet or .arrayrecord files"),
    ("--config.data.source={tmp}/schema.jsonl", "schema.jsonl line 1"),
    ("--config.data.tokenizer={tmp}/missing_tokenizer.json", "does not exist"),
    ("--config.fault.drill=kill:process=1,step=3", "aims at process 1, and this job has 1"),
    ("--config.fault.drill=crash:step=400", "after the run's last (train.steps = 300)"),
    ("--config.fault.drill=kill:process=0,step=3,sec=5", "'sec' is not a key of a kill drill"),
    ("--config.fault.drill=hang:step=3,sec=inf", "must be finite"),
    ("--config.fault.drill=hang:step=3,sec=nan", "must be finite"),
], ids=["missing source", "binary file", "plain text on line 51", "empty directory", "another schema", "missing tokenizer",
        "drill at a missing process", "drill after the last step", "key of another kind", "infinite hang",
        "nan hang"])
def test_a_refused_run_writes_nothing(inputs, override, needle):
    workdir = inputs / "run"
    result = zaya("train", f"--config={TINY}", f"--workdir={workdir}", override.format(tmp=inputs))
    _refused(result, needle)
    assert not workdir.exists()


def test_process_0_that_cannot_host_the_coordinator_is_one_line(tmp_path):
    env = zaya_env(JAX_COORDINATOR_ADDRESS="nohost.invalid:8476", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0")
    result = zaya("train", f"--config={TINY}", f"--workdir={tmp_path / 'run'}", env=env)
    _refused(result, "process 0 cannot host the coordinator at nohost.invalid:8476: the host 'nohost.invalid' "
                     "does not resolve")
    with socket.socket() as taken:  # a port another program holds
        taken.bind(("localhost", 0))
        taken.listen()
        address = f"localhost:{taken.getsockname()[1]}"
        env = zaya_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0")
        result = zaya("train", f"--config={TINY}", f"--workdir={tmp_path / 'run'}", env=env)
    _refused(result, f"process 0 cannot host the coordinator at {address}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, needle", [
    ("--config.optim.lr=inf", "optim.lr must be a finite number, got inf"),
    ("--config.optim.weight_decay=nan", "optim.weight_decay must be a finite number, got nan"),
    ("--config.fault.spike_sigmas=inf", "fault.spike_sigmas must be a finite number"),
    ("--config.model.initializer_range=nan", "model.initializer_range must be a finite number"),
    ("--config.model.initializer_range=-1", "model.initializer_range must be >= 0"),
    ("--config.model.pad_token_id=-5", "model.pad_token_id must be a token id in 0..271"),
    ("--config.model.eos_token_id=9999", "model.eos_token_id must be a token id in 0..271"),
], ids=["infinite lr", "nan weight decay", "infinite spike sigmas", "nan init range", "negative init range",
        "negative pad id", "eos past the vocabulary"])
def test_numbers_in_the_config_must_be_finite_and_in_range(tmp_path, override, needle):
    result = zaya("train", f"--config={TINY}", f"--workdir={tmp_path / 'run'}", override)
    _refused(result, needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env, needle", [
    ({"XLA_FLAGS": "--xla_backend_optimization_level=0 --no_such_xla_flag=1"},
     "XLA_FLAGS holds a flag this XLA does not know: --no_such_xla_flag=1"),
    ({"JAX_PLATFORMS": "no_such_platform"},
     "JAX_PLATFORMS='no_such_platform': Unable to initialize backend 'no_such_platform'"),
], ids=["unknown XLA flag", "unknown platform"])
def test_a_start_up_environment_jax_cannot_start_with_is_one_line(tmp_path, env, needle):
    """XLA aborts the process (a C++ fatal error) on an unknown flag; JAX raises from deep inside."""
    result = zaya("train", f"--config={TINY}", f"--workdir={tmp_path / 'run'}", env=zaya_env(**env))
    _refused(result, needle)
    assert not (tmp_path / "run").exists()


def _listing(path):
    return sorted((root, tuple(sorted(files))) for root, _, files in os.walk(path))


def test_a_resume_this_run_cannot_make_is_refused_before_the_workdir_is_written(tmp_path):
    """A checkpoint of another model: refused before the event log gets a `start`, before compiling.
    Then a damaged one (its Orbax manifest emptied), found when its state is read: one line, no
    background tracebacks, the checkpoints untouched."""
    workdir = tmp_path / "run"
    first = zaya("train", f"--config={TINY}", f"--workdir={workdir}", "--config.train.steps=1",
                 "--config.eval.every_steps=0", "--config.train.progress=False", "--config.model.num_hidden_layers=1")
    assert first.returncode == 0, first.stderr[-2000:]
    before, log = _listing(workdir), (workdir / "events.jsonl").read_bytes()
    result = zaya("train", f"--config={TINY}", f"--workdir={workdir}", "--config.train.steps=2",
                  "--config.eval.every_steps=0", "--config.model.num_hidden_layers=2")
    _refused(result, "different model")
    assert _listing(workdir) == before and (workdir / "events.jsonl").read_bytes() == log

    (workdir / "checkpoints" / "1" / "state" / "manifest.ocdbt").write_bytes(b"")  # emptied by a bad copy
    before = _listing(workdir / "checkpoints")
    result = zaya("train", f"--config={TINY}", f"--workdir={workdir}", "--config.train.steps=2",
                  "--config.eval.every_steps=0", "--config.model.num_hidden_layers=1")
    _refused(result, "checkpoint " + str(workdir / "checkpoints" / "1") + " could not be read")
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr[-3000:]
    assert _listing(workdir / "checkpoints") == before  # found when the state is read: nothing in it moved
