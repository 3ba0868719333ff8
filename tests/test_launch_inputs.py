"""Bad `zaya launch` flags and bad start-up settings: one `zaya: error:` line, exit 2, nothing started."""


import pytest

from zaya_jax.cli import main
from paths import TINY



@pytest.mark.parametrize("argv,needle", [
    (["launch", "-n", "0", "--", "train"], "zaya launch -n must be a number at least 1, got 0"),
    (["launch", "-n", "2", "--nodes", "2", "--node-rank", "2", "--coordinator-address", "h:1", "--", "train"],
     "--node-rank 2 is not below --nodes 2"),
    (["launch", "-n", "2", "--nodes", "2", "--", "train"], "with --nodes > 1 every node needs the same --coordinator-address"),
    (["launch", "-n", "2", "--cpu-devices", "0", "--", "train"], "zaya launch --cpu-devices must be a number at least 1, got 0"),
    (["launch", "-n", "2", "--grace-s", "-1", "--", "train"], "zaya launch --grace-s must be a number at least 0, got -1.0"),
    (["launch", "-n", "2"], "zaya launch needs a command after --"),
    (["launch", "-n", "2", "--", "launch", "-n", "2"], "zaya launch cannot launch itself"),
    (["launch", "-n", "2", "--max-restarts", "-1", "--", "train"], "--max-restarts must be a number at least 0, got -1"),
    (["launch", "-n", "2", "--restart-backoff-s", "-2", "--", "train"], "--restart-backoff-s must be a number at least 0"),
    (["launch", "-n", "2", "--nodes", "2", "--coordinator-address", "h:1", "--max-restarts", "2", "--", "train"],
     "--max-restarts supervises a one-node job; across nodes let the scheduler restart the job"),
    (["launch", "-n", "2", "--grace-s", "nan", "--", "train"], "--grace-s must be a number at least 0, got nan"),
    (["launch", "-n", "2", "--restart-backoff-s", "nan", "--", "train"], "--restart-backoff-s must be a number"),
    (["launch", "-n", "2", "--restart-backoff-s", "inf", "--", "train"], "--restart-backoff-s must be a number"),
    (["launch", "-n", "2", "--coordinator-address", "localhost:99999", "--", "train"],
     "'localhost:99999' is not HOST:PORT with a port in 1..65535 (--coordinator-address)"),
    (["launch", "-n", "2", "--coordinator-address", "localhost:0", "--", "train"], "port in 1..65535"),
    # argparse's own refusals: one line too, not its usage block
    (["launch", "-n", "abc", "--", "train"], "launch: argument -n/--nproc: invalid int value: 'abc'"),
    (["launch", "-n", "2", "--max-restarts", "1.5", "--", "train"], "--max-restarts: invalid int value: '1.5'"),
    (["convert", "to-hf", "--ckpt", "a", "--out", "b", "--dtype=int8"], "convert to-hf: argument --dtype: invalid choice"),
    (["convert", "to-hf", "--ckpt", "a", "--out", "b", "--max-shard-size=abc"], "'abc' is not a size like 5GB"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
    (["train"], "train: the following arguments are required: --config, --workdir"),
], ids=["no processes", "rank outside nodes", "nodes without coordinator", "no cpu devices", "negative grace",
        "no command", "launch itself", "negative restarts", "negative backoff", "restarts across nodes",
        "nan grace", "nan backoff", "infinite backoff", "port too high", "port zero", "nproc not a number",
        "restarts not an integer", "unknown dtype", "bad shard size", "unknown command", "missing flags"])
def test_bad_launch_flags_are_one_line_and_exit_2(capsys, argv, needle):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals leave through sys.exit
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zaya: error: ") and needle in err[0]


@pytest.mark.parametrize("env,overrides,needle", [
    ({"JAX_LOCAL_DEVICE_IDS": "0,x"}, [], "--local-device-ids / JAX_LOCAL_DEVICE_IDS must be device numbers"),
    ({"JAX_PROCESS_ID": "-1"}, [], "--process-id / JAX_PROCESS_ID must be an integer >= 0, got '-1'"),
    ({}, ["--config.distributed.heartbeat_timeout_s=0"], "distributed.heartbeat_timeout_s must be at least 1 second"),
    ({}, ["--config.distributed.initialization_timeout_s=0"],
     "distributed.initialization_timeout_s must be at least 1 second"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost:99999", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, [],
     "is not HOST:PORT with a port in 1..65535 (--coordinator-address or JAX_COORDINATOR_ADDRESS)"),
], ids=["device ids", "negative id", "heartbeat timeout", "initialization timeout", "port out of range"])
def test_bad_start_up_settings_are_one_line_and_exit_2(capsys, monkeypatch, tmp_path, env, overrides, needle):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = ["train", f"--config={TINY}", f"--workdir={tmp_path}", *overrides]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zaya: error: ") and needle in err[0]


@pytest.mark.parametrize("codes,reported", [
    ([None, 0], None),
    ([0, 0], None),
    ([1, None], (0, 1)),
    ([3, 1], (0, 3)),  # no signal: the lower rank
    ([1, -9], (1, -9)),  # rank 1 was SIGKILLed and rank 0 exited because its peer vanished
    ([-15, -9], (0, -15)),
    ([2, -6], (0, 2)),  # rank 0 stopped on bad input; rank 1 aborted when its coordinator left
    ([-6, 2], (1, 2)),
    ([3, -6], (0, 3)),  # rank 0's watchdog ended it; rank 1 aborted when its coordinator left
    ([-6, 4], (1, 4)),
    ([1, -6], (0, 1)),  # a crash and an abort: either may be the other's doing, so the lower rank
    ([-6, 1], (0, -6)),
    ([-6, -11], (1, -11)),  # a segfault is no peer's doing; the abort may be
])
def test_the_launcher_reports_the_likeliest_cause_of_a_jobs_end(codes, reported):
    from zaya_jax.cluster.launcher import first_failure

    assert first_failure(codes) == reported
