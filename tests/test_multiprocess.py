"""Several CPU processes on JAX's distributed runtime (gloo), started by `zaya launch`.

Each run is a real job: N processes with K fake CPU devices each, compared against one process
holding the same devices (the same mesh and global batch): the test's own, which trains
in-process. What is bit-identical and what is not: the first step's loss (the same parameters,
the same rows), the data lanes' positions (which documents were read) and a checkpoint restored
into another process count. The gradients are summed across processes by gloo's ring
all-reduce, in another order than XLA's all-reduce inside one process, so from the second step
on the parameters differ in their last bits (about 1e-9 on the Adam moments after two steps) and
the losses agree to about 1e-6, not exactly.
"""

import glob
import io
import json
import os
import re
import shutil
import signal
import time

import jax
import numpy as np
import pytest

from zaya_jax.checkpoint import orbax_store
from zaya_jax.experiment import load_experiment
from zaya_jax.train.loop import train
from paths import TINY
from zaya_process import zaya, zaya_env, zaya_started


SHORT = ["--config.train.log_every=1", "--config.train.progress=False",
         "--config.train.seq_len=64", "--config.train.global_batch_size=8", "--config.train.scan_unroll=1",
         "--config.optim.decay_steps=8"]  # the schedule must not depend on train.steps: runs stop and resume


def _train_args(workdir, steps, *extra):
    return ["train", "--config=experiments/tiny_cpu.py", f"--workdir={workdir}", f"--config.train.steps={steps}",
            *SHORT, *extra]


def _one(workdir, devices, steps, *extra) -> str:
    """The same run in one process, the test's own (no distributed job): its console output."""
    out = io.StringIO()
    exp = load_experiment(TINY, [f"--config.train.steps={steps}", *SHORT, *extra])
    train(exp, str(workdir), devices=jax.devices()[:devices], out=out)
    return out.getvalue()


def _launch(workdir, processes, devices, steps, *extra, launch=(), env=None):
    done = zaya("launch", "-n", str(processes), "--cpu-devices", str(devices), *launch, "--",
                *_train_args(workdir, steps, *extra), devices=None, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _said(done) -> str:
    """A finished launch's stdout and stderr (where JAX's logs go)."""
    return done.stdout + done.stderr


def _records(workdir, key):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


def _lanes(workdir, step):
    """Every lane's saved data state at `step`, merged over the processes' files."""
    merged = {}
    for path in glob.glob(os.path.join(workdir, "checkpoints", str(step), "data", "process_*.json")):
        with open(path) as f:
            merged.update(json.load(f)["lanes"])
    return merged


def _same_losses(got: dict, expected: dict, exact_first: bool = True) -> None:
    assert got.keys() == expected.keys() and got
    first = min(got)
    if exact_first:  # the same weights and documents: only the replicas' loss sum may add up in another order
        np.testing.assert_allclose(got[first], expected[first], rtol=2e-7)  # ~1 fp32 ulp
    np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(got)], rtol=1e-5)


def _model(workdir):
    path = os.path.join(workdir, "model")
    shapes = orbax_store.stored_shapes(path)
    return orbax_store.load_arrays(path, shapes, shapes)


def _launch_nodes(workdir, nodes, per_node, devices, steps, *extra):
    """`nodes` launchers on this machine, each a node of `per_node` processes: what the
    Kubernetes template runs in every pod. Returns node 0's output."""
    address = f"localhost:{_free_port()}"
    launchers = [zaya_started(
        "launch", "-n", str(per_node), "--cpu-devices", str(devices), "--nodes", str(nodes), "--node-rank",
        str(rank), "--coordinator-address", address, "--", *_train_args(workdir, steps, *extra), env=zaya_env(None))
        for rank in range(nodes)]
    outputs = [launcher.communicate(timeout=600) for launcher in launchers]
    assert all(launcher.returncode == 0 for launcher in launchers), outputs[0][1][-3000:] + outputs[1][1][-3000:]
    return outputs[0][0]


@pytest.mark.parametrize("nodes,per_node,devices,mesh,across", [
    (1, 2, 2, ["--config.mesh.sequence=2", "--config.mesh.fsdp=2", "--config.mesh.data=1"], "sequence"),
    (2, 2, 1, ["--config.mesh.tsp=2", "--config.mesh.data=-1"], "data"),
], ids=["2 processes, sequence across them", "4 processes on 2 nodes, tsp"])
def test_processes_train_to_the_same_losses_as_one_process(tmp_path, nodes, per_node, devices, mesh, across):
    one, many = tmp_path / "one", tmp_path / "many"
    extra = [*mesh, "--config.eval.batches=1", "--config.eval.batch_size=4"]
    processes = nodes * per_node
    _one(one, processes * devices, 3, *extra)
    out = _launch_nodes(many, nodes, per_node, devices, 3, *extra)
    _same_losses(_records(many, "loss"), _records(one, "loss"))
    _same_losses(_records(many, "eval_loss"), _records(one, "eval_loss"), exact_first=False)
    # Process 0 speaks: one banner and one summary, the others only their start-up.
    assert out.count("zaya train:") == 1 and out.count("done: loss") == 1
    assert all(line.startswith("[0]") for line in out.splitlines() if "done: loss" in line)
    # One node: sequence spans the two processes (they read the same rows). Two nodes: the
    # mesh keeps tsp inside a node and puts data across the nodes.
    assert f"cluster {processes} processes on {nodes} node(s); axes across nodes: " + \
        ("none" if nodes == 1 else across) in out


def test_a_checkpoint_reshards_over_1_2_and_4_processes_with_no_document_repeated_or_skipped(tmp_path):
    """Saved by 2 processes, restored by 1 and by 4 bit for bit; then resumed by 1 and by 4, and saved
    by 1 resumed by 2: every run ends where the uninterrupted run does, having read exactly its
    documents (each data lane at the same position of the document stream)."""
    steps, half = 4, 2
    whole = tmp_path / "whole"  # uninterrupted: one process, 4 devices
    _one(whole, 4, steps, f"--config.checkpoint.every_steps={half}", "--config.checkpoint.keep=3")
    saved_by_two = tmp_path / "two"
    _launch(saved_by_two, 2, 2, half)
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(os.listdir(saved_by_two / "checkpoints" / str(half) / "data"))
    assert _lanes(saved_by_two, half) == _lanes(whole, half)
    _same_losses(_records(saved_by_two, "loss"), {s: v for s, v in _records(whole, "loss").items() if s <= half})

    # Restored by 1 and by 4: nothing left to train, the restored state is saved as is.
    for name, restore in {"1": lambda w: _one(w, 4, half), "4": lambda w: _launch(w, 4, 1, half).stdout}.items():
        workdir = tmp_path / f"restored_by_{name}"
        shutil.copytree(saved_by_two, workdir, ignore=shutil.ignore_patterns("model"))
        assert "already trained to step 2" in restore(workdir)
        _same_model(_model(workdir), _model(saved_by_two), exact=True, name=f"restored by {name}")

    # JAX logs each persistent-cache hit: the 2-process step "two" compiled is a hit in both processes
    # (on CPU each process's key is its own, and each wrote its entry).
    hits = zaya_env(None, JAX_DEBUG_LOG_MODULES="jax._src.compiler")
    runs = {"2 → 1": (saved_by_two, lambda w: _one(w, 4, steps)),
            "2 → 4": (saved_by_two, lambda w: _launch(w, 4, 1, steps).stdout),
            "1 → 2": (whole, lambda w: _said(_launch(w, 2, 2, steps, env=hits)))}
    for name, (source, resume) in runs.items():
        workdir = tmp_path / name.replace(" → ", "_to_")
        shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("model", str(steps)))
        out = resume(workdir)
        assert f"resumed from {workdir}/checkpoints/{half} (step {half}" in out, name
        if name == "1 → 2":
            loaded = re.findall(r"^\[(\d)\] .*Persistent compilation cache hit for 'jit_train_step'", out, re.MULTILINE)
            assert sorted(loaded) == ["0", "1"], out[-3000:]
        assert _lanes(workdir, steps) == _lanes(whole, steps), name
        losses = _records(workdir, "loss")
        _same_losses({s: losses[s] for s in range(half + 1, steps + 1)},
                     {s: v for s, v in _records(whole, "loss").items() if s > half}, exact_first=False)
        _same_model(_model(workdir), _model(whole), exact=False, name=name)


def _same_model(got: dict, expected: dict, exact: bool, name: str) -> None:
    assert got.keys() == expected.keys()
    for key in got:
        if exact:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{name}: {key}")
        else:
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-4, atol=1e-6, err_msg=f"{name}: {key}")


def test_sigterm_to_one_process_saves_the_same_step_in_every_process_and_resumes(tmp_path):
    workdir = tmp_path / "run"
    launcher = zaya_started("launch", "-n", "2", "--cpu-devices", "1", "--", *_train_args(workdir, 100000),
                            env=zaya_env(None))
    try:
        pids = _child_pids(launcher)
        _wait_for(lambda: os.path.exists(workdir / "metrics.jsonl") and len(_records(workdir, "loss")) >= 2)
        os.kill(pids[1], signal.SIGTERM)  # one process only: the runtime makes the other agree
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = [int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()]
    assert len(saved) == 1 and saved[0] >= 2
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(os.listdir(workdir / "checkpoints" / str(saved[0]) / "data"))
    assert f"stopped by SIGTERM after step {saved[0]}" in out
    resumed = _one(workdir, 2, saved[0] + 1)  # the reshard test resumes on every process count
    assert f"resumed from {workdir}/checkpoints/{saved[0]} (step {saved[0]}" in resumed


def test_killing_one_process_ends_the_others_and_leaves_no_orphan(tmp_path):
    launcher = zaya_started("launch", "-n", "2", "--cpu-devices", "1", "--grace-s", "2", "--",
                            *_train_args(tmp_path / "run", 100000), env=zaya_env(None))
    try:
        pids = _child_pids(launcher)
        _wait_for(lambda: os.path.exists(tmp_path / "run" / "metrics.jsonl"))
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        out, err = launcher.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL
    # The launcher stops process 0, unless process 0 ended first on the broken connection.
    assert re.search(r"zaya launch: process 1 was killed by SIGKILL \(137\)(; stopping the other 1|$)", err, re.M), err
    assert took < 2 + 10  # the grace period, then SIGKILL
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _child_pids(launcher) -> list[int]:
    """The processes' pids, from the launcher's first lines on stderr."""
    for line in launcher.stderr:
        if line.startswith("zaya launch: started"):
            return [int(part.split("pid ")[1]) for part in line.split(": ", 2)[2].split(", ")]
    raise AssertionError("the launcher did not say which processes it started")


def _wait_for(condition, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


@pytest.mark.parametrize("env,needle", [
    ({"JAX_COORDINATOR_ADDRESS": "localhost:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     "could not reach the coordinator at localhost:1 within distributed.initialization_timeout_s (2s)"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "process id 2 is not below the process count 2"),
    ({"JAX_COORDINATOR_ADDRESS": "nohost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "coordinator address 'nohost' is not HOST:PORT"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "--num-processes / JAX_NUM_PROCESSES must be an integer >= 1, got 'two'"),
], ids=["unreachable coordinator", "id outside the count", "address without port", "count not a number"])
def test_bad_start_up_is_one_line_and_exit_2(tmp_path, env, needle):
    done = zaya(*_train_args(tmp_path, 1, "--config.distributed.initialization_timeout_s=2"), timeout=60,
                env=zaya_env(1, **env))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("zaya: error: ") and needle in done.stderr


def test_processes_given_different_counts_stop_in_one_line(tmp_path):
    port = _free_port()
    common = ["--config.distributed.initialization_timeout_s=20"]
    procs = [zaya_started(*_train_args(tmp_path, 1, *common),
                          env=zaya_env(1, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=count,
                                       JAX_PROCESS_ID=pid))
             for pid, count in (("0", "2"), ("1", "3"))]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 2 for p in procs)
    assert all(err.strip().splitlines()[-1].startswith("zaya: error: ") for _, err in results)
    # Process 1 sees its own report; process 0 may see it too, or process 1 already gone.
    assert "the processes disagree on the process count: process 1 was given 3, the coordinator 2" in results[1][1]


@pytest.mark.parametrize("override,needle", [
    ("--config.mesh.data=3", "needs 3 devices but this run has 4"),  # the mesh
    ("--config.model.attention_kernel=cudnn", "the cudnn attention backend needs an NVIDIA GPU"),  # against the devices
    ("--config.eval.tasks=hellaswag", "eval.tasks and eval.prompts run in single-process runs for now"),
])
def test_a_config_every_process_refuses_ends_the_job_as_bad_input(tmp_path, override, needle):
    """Both processes raise the error and leave together (JAX's shutdown barrier): neither dies of
    SIGABRT when process 0's coordinator goes, and the launcher reports bad input (no restart)."""
    done = zaya("launch", "-n", "2", "--cpu-devices", "2", "--max-restarts", "2", "--",
                *_train_args(tmp_path, 1, override), devices=None)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if needle in line]
    assert sorted(line[:17] for line in errors) == ["[0] zaya: error: ", "[1] zaya: error: "]
    assert "SIGABRT" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # either may leave the barrier first
    assert re.fullmatch(r"zaya launch: not restarting: process [01] stopped on bad input \(status 2\)", last), last


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
