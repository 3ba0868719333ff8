"""`zaya launch --max-restarts`: which exits restart the job, the back-off, what each attempt is
told, and giving up, with stand-in processes that exit as a plan says (no JAX, so it is quick)."""

import json
import os
import signal
import sys
import textwrap

import pytest

from zaya_jax import exit_codes
from zaya_jax.cli import build_parser
from zaya_jax.cluster import launcher

CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    plan, log = json.loads(sys.argv[1]), sys.argv[2]
    attempt, me = int(os.environ["ZAYA_ATTEMPT"]), int(os.environ["JAX_PROCESS_ID"])
    with open(log, "a") as f:
        f.write(json.dumps({"attempt": attempt, "process": me, "cause": os.environ["ZAYA_RESTART_CAUSE"],
                            "failed_at": os.environ["ZAYA_FAILED_AT"]}) + "\\n")
    code = plan[min(attempt, len(plan) - 1)]  # process 1's exit in this attempt
    def logged(process):
        with open(log) as f:
            return any(r["attempt"] == attempt and r["process"] == process for r in map(json.loads, f))
    deadline = time.time() + 30
    while me == 1 and code != 0 and not logged(0) and time.time() < deadline:  # fail after the peer has logged
        time.sleep(0.01)
    if code == 0 or (me == 1 and code > 0):
        sys.exit(code)
    if me == 1:
        os.kill(os.getpid(), -code)
    if code in (-signal.SIGTERM, -signal.SIGINT):  # a save-and-stop: every process stops at the same step
        time.sleep(0.3)
        sys.exit(128 - code)
    time.sleep(60)  # waits for its failed peer: the launcher must end it
""")


def _launch(tmp_path, monkeypatch, plan, *flags):
    script, log = tmp_path / "child.py", tmp_path / "attempts.jsonl"
    script.write_text(CHILD)
    monkeypatch.setattr(launcher, "CHILD", [sys.executable, str(script), json.dumps(plan), str(log)])
    args, extra = build_parser().parse_known_args(
        ["launch", "-n", "2", "--cpu-devices", "1", "--grace-s", "1", "--restart-backoff-s", "0.1", *flags,
         "--", "train"])
    code = launcher.launch(args, extra)
    attempts = [json.loads(line) for line in log.read_text().splitlines()]
    return code, attempts


def test_a_crash_restarts_the_whole_job_with_a_doubling_back_off_until_it_finishes(tmp_path, monkeypatch, capfd):
    code, attempts = _launch(tmp_path, monkeypatch, [1, -signal.SIGKILL, 0], "--max-restarts", "3")
    assert code == 0
    assert sorted((a["attempt"], a["process"]) for a in attempts) == [(i, p) for i in range(3) for p in range(2)]
    causes = {a["attempt"]: a["cause"] for a in attempts}
    assert causes == {0: "", 1: "process 1 crashed (status 1)", 2: "process 1 was killed by SIGKILL (137)"}
    assert all(float(a["failed_at"]) > 0 for a in attempts if a["attempt"])
    err = capfd.readouterr().err
    assert "restart 1/3 in 0.1s from the newest checkpoint: process 1 crashed (status 1)" in err
    assert "restart 2/3 in 0.2s" in err and "attempt 3 of at most 4" in err


@pytest.mark.parametrize("status", [exit_codes.HUNG, exit_codes.CRASHED])
def test_it_gives_up_after_max_restarts_with_the_last_status(tmp_path, monkeypatch, capfd, status):
    code, attempts = _launch(tmp_path, monkeypatch, [status], "--max-restarts", "1")
    assert code == status and {a["attempt"] for a in attempts} == {0, 1}
    assert "giving up after 1 restart(s)" in capfd.readouterr().err


@pytest.mark.parametrize("status", [exit_codes.BAD_INPUT, exit_codes.BAD_STEPS])
def test_bad_input_and_repeated_bad_steps_are_never_restarted(tmp_path, monkeypatch, capfd, status):
    code, attempts = _launch(tmp_path, monkeypatch, [status, 0], "--max-restarts", "3")
    assert code == status and {a["attempt"] for a in attempts} == {0}
    assert "not restarting" in capfd.readouterr().err


def test_a_save_and_stop_restarts_only_when_asked(tmp_path, monkeypatch):
    stopped = -signal.SIGTERM  # process 1 is sent SIGTERM, so it exits 143 like a preempted zaya train
    code, attempts = _launch(tmp_path, monkeypatch, [stopped, 0], "--max-restarts", "3")
    assert code == 143 and {a["attempt"] for a in attempts} == {0}
    os.remove(tmp_path / "attempts.jsonl")
    code, attempts = _launch(tmp_path, monkeypatch, [stopped, 0], "--max-restarts", "3", "--restart-on-stop")
    assert code == 0 and {a["attempt"] for a in attempts} == {0, 1}


def test_without_max_restarts_a_failure_ends_the_job(tmp_path, monkeypatch):
    code, attempts = _launch(tmp_path, monkeypatch, [1, 0])
    assert code == 1 and {a["attempt"] for a in attempts} == {0}
