"""`zaya launch`: start the processes of one node, prefix their output, end them all when one fails.

`zaya launch -n N [--nodes M --node-rank R --coordinator-address HOST:PORT] -- COMMAND ...`
runs `zaya COMMAND ...` N times on this machine as processes R·N ... R·N+N-1 of an N·M-process
JAX job: each gets the explicit start-up settings (`cluster/startup.ENV`) and either one local
GPU (`JAX_LOCAL_DEVICE_IDS=i`) or, with `--cpu-devices K`, K CPU devices. Their output lines
are prefixed `[i]`, each written whole (`cluster/relay.py`). When one process fails, the others
get SIGTERM and, after `--grace-s`, SIGKILL (each runs in its own process group, so nothing it
started survives), and the launcher exits with the failed process's status. SIGTERM or Ctrl-C to
the launcher is passed on as SIGTERM, so a training job saves a checkpoint and stops; a second
one kills.

With `--max-restarts K` the launcher is also the job's supervisor on one node: when a process
fails (`exit_codes.restartable`: crashed, killed, hung) it ends the others and starts the whole
job again, after a back-off that doubles from `--restart-backoff-s`, up to K times; the job
resumes from its newest complete checkpoint. It never restarts after bad input (2) or repeated bad
steps (4), and after a save-and-stop (143, 130) only with `--restart-on-stop`. Each process is
told its attempt and the previous one's cause (`train/events.ATTEMPT_ENV`) for the event log.
Across nodes the scheduler supervises (SLURM requeue, JobSet restarts): see the templates.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from zaya_jax import exit_codes
from zaya_jax.cluster.relay import relay
from zaya_jax.cluster.startup import ENV, NODE_ENV, check_address
from zaya_jax.cpu_host import with_device_count
from zaya_jax.errors import ZayaError
from zaya_jax.train.events import ATTEMPT_ENV

EPILOG = """\
examples:
  zaya launch -n 2 --cpu-devices 4 -- train --config=experiments/tiny_cpu.py --workdir=/tmp/zaya_mp
  zaya launch -n 8 -- train --config=experiments/zaya1_base_phase1.py --workdir=/shared/run   # one process per GPU
  zaya launch -n 8 --nodes 128 --node-rank $NODE --coordinator-address node0:8476 -- train ...
  zaya launch -n 8 --max-restarts 5 -- train ...   # one node, restarted from its checkpoint on failure

Every process gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID and either
JAX_LOCAL_DEVICE_IDS=i (its GPU) or JAX_PLATFORMS=cpu with K fake CPU devices (--cpu-devices K)."""


def add_parser(jobs) -> None:
    p = jobs.add_parser(
        "launch", help="run a zaya command as N processes of a JAX job (one per GPU, or CPU processes)",
        description="Start N local processes of a multi-process JAX job running `zaya COMMAND`, prefix "
                    "their output, and stop them all when one fails (with --max-restarts: start them again "
                    "from the newest checkpoint). Exit status: the failed process's (zaya_jax/exit_codes.py).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc", type=int, required=True, metavar="N", help="processes on this node")
    p.add_argument("--nodes", type=int, default=1, metavar="M", help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node, 0..M-1 (default 0)")
    p.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help="process 0's address (default with one node: a free local port)")
    p.add_argument("--cpu-devices", type=int, metavar="K", help="run on CPU with K devices per process")
    p.add_argument("--grace-s", type=float, default=10.0, metavar="S",
                   help="after a failure, seconds between SIGTERM and SIGKILL to the others (default 10)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart the whole job from its newest checkpoint when a process fails (crash, kill, hang), "
                        "up to K times (default 0; one node only: across nodes the scheduler restarts)")
    p.add_argument("--restart-backoff-s", type=float, default=10.0, metavar="S",
                   help="wait S seconds before the first restart, doubling each time up to 300 (default 10)")
    p.add_argument("--restart-on-stop", action="store_true",
                   help="also restart after the processes saved and stopped on a SIGTERM that did not come "
                        "through this launcher (status 143: e.g. one process preempted)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the zaya command each process runs, e.g. -- train --config=... --workdir=...")


def launch(args, extra: list[str], started_at: float | None = None) -> int:
    """Start (and with --max-restarts, supervise) the processes; `started_at`: this launcher's own
    start, which is when the job's first attempt began."""
    command = _command(args, extra)
    _check(args)
    total = args.nproc * args.nodes
    first = args.node_rank * args.nproc
    attempt, cause, failed_at = 0, "", None
    while True:
        address = args.coordinator_address or f"localhost:{_free_port()}"  # a fresh port: the old one may linger
        print(f"zaya launch: processes {first}..{first + args.nproc - 1} of {total} "
              f"({_devices_text(args)}), coordinator {address}{_attempt_text(attempt, args.max_restarts)}: "
              f"zaya {' '.join(command)}", file=sys.stderr, flush=True)
        started = {ATTEMPT_ENV["attempt"]: str(attempt), ATTEMPT_ENV["cause"]: cause,
                   ATTEMPT_ENV["failed_at"]: "" if failed_at is None else repr(failed_at),
                   ATTEMPT_ENV["launched_at"]: repr(started_at if attempt == 0 and started_at else time.time())}
        children = [_start(args, command, i, address, total, started) for i in range(args.nproc)]
        pids = ", ".join(f"{first + i}: pid {child.pid}" for i, child in enumerate(children))
        print(f"zaya launch: started {pids}", file=sys.stderr, flush=True)
        supervisor = Supervisor(children, args.grace_s, first)
        code = supervisor.wait()
        if supervisor.told_to_stop or attempt >= args.max_restarts or \
                not exit_codes.restartable(code, args.restart_on_stop):
            if code and attempt < args.max_restarts and not supervisor.told_to_stop:
                print(f"zaya launch: not restarting: process {supervisor.failure_text}", file=sys.stderr, flush=True)
            elif code and args.max_restarts and attempt >= args.max_restarts:
                print(f"zaya launch: giving up after {attempt} restart(s): process {supervisor.failure_text}",
                      file=sys.stderr, flush=True)
            return code
        attempt, cause, failed_at = attempt + 1, f"process {supervisor.failure_text}", supervisor.failed_at
        wait = min(args.restart_backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
        print(f"zaya launch: restart {attempt}/{args.max_restarts} in {wait:g}s from the newest checkpoint: {cause}",
              file=sys.stderr, flush=True)
        if _sleep_unless_told_to_stop(wait):
            return code


MAX_BACKOFF_S = 300.0


def _attempt_text(attempt: int, max_restarts: int) -> str:
    return f", attempt {attempt + 1} of at most {max_restarts + 1}" if max_restarts else ""


def _sleep_unless_told_to_stop(seconds: float) -> bool:
    """Back off; True when SIGTERM/Ctrl-C arrived meanwhile (then nothing restarts)."""
    told = []
    previous = {sig: signal.signal(sig, lambda signum, frame: told.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        deadline = time.monotonic() + seconds
        while not told and time.monotonic() < deadline:
            time.sleep(min(0.1, seconds))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if told:
        print(f"zaya launch: {signal.Signals(told[0]).name} during the back-off: not restarting",
              file=sys.stderr, flush=True)
    return bool(told)


def _command(args, extra: list[str]) -> list[str]:
    command = list(args.argv or [])
    if command[:1] == ["--"]:
        command = command[1:]
    command += extra
    if not command:
        raise ZayaError("zaya launch needs a command after --, e.g. zaya launch -n 2 -- train --config=... --workdir=...")
    if command[0] == "launch":
        raise ZayaError("zaya launch cannot launch itself; give the command the processes run, e.g. -- train ...")
    return command


def _check(args) -> None:
    for flag, value, low in (("-n", args.nproc, 1), ("--nodes", args.nodes, 1), ("--node-rank", args.node_rank, 0),
                             ("--cpu-devices", args.cpu_devices, 1), ("--grace-s", args.grace_s, 0),
                             ("--max-restarts", args.max_restarts, 0), ("--restart-backoff-s", args.restart_backoff_s, 0)):
        if value is not None and not (math.isfinite(value) and value >= low):
            raise ZayaError(f"zaya launch {flag} must be a number at least {low}, got {value}")
    if args.coordinator_address:
        check_address(args.coordinator_address, "--coordinator-address")
    if args.node_rank >= args.nodes:
        raise ZayaError(f"--node-rank {args.node_rank} is not below --nodes {args.nodes}; ranks run 0..{args.nodes - 1}")
    if args.nodes > 1 and not args.coordinator_address:
        raise ZayaError("with --nodes > 1 every node needs the same --coordinator-address HOST:PORT "
                        "(node 0's address and a free port)")
    if args.nodes > 1 and args.max_restarts:
        raise ZayaError("--max-restarts supervises a one-node job; across nodes let the scheduler restart the job "
                        "(SLURM --requeue, JobSet failurePolicy: zaya template slurm|k8s)")


def _devices_text(args) -> str:
    return f"{args.cpu_devices} CPU device(s) each" if args.cpu_devices else "one GPU each"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


CHILD = [sys.executable, "-m", "zaya_jax"]  # what each process runs, before the command


def _start(args, command: list[str], local: int, address: str, total: int, attempt: dict) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(attempt)
    env.update({ENV["coordinator_address"]: address, ENV["num_processes"]: str(total),
                ENV["process_id"]: str(args.node_rank * args.nproc + local), NODE_ENV: f"node-{args.node_rank}",
                "PYTHONUNBUFFERED": "1"})
    if args.cpu_devices:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=with_device_count(env.get("XLA_FLAGS", ""), args.cpu_devices))
        env.pop(ENV["local_device_ids"], None)
    else:
        env[ENV["local_device_ids"]] = str(local)
    # Own session: a terminal's Ctrl-C reaches the launcher only, which passes it on as SIGTERM.
    return subprocess.Popen([*CHILD, *command], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


class Supervisor:
    """Relays the children's output and ends them all when one fails or the launcher is told to stop."""

    def __init__(self, children: list[subprocess.Popen], grace_s: float, first_id: int):
        self.children, self.grace_s, self.first_id = children, grace_s, first_id
        self._stop_requests = 0
        self.failed_at: float | None = None  # wall time the first failure was seen
        self.failure_text = ""
        lock = threading.Lock()  # one line at a time, whichever process it comes from
        self._relays = [threading.Thread(target=relay, args=(stream, sink, f"[{first_id + i}] ", lock), daemon=True)
                        for i, child in enumerate(children)
                        for stream, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
        for thread in self._relays:
            thread.start()

    def wait(self) -> int:
        """The job's status: 0, or the first failed process's (128+s for a signal s)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            failure = self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for thread in self._relays:
            thread.join(timeout=5)
        if failure is None:
            return 0
        index, code = failure
        status = _status(code)
        self.failure_text = f"{self.first_id + index} {exit_codes.describe(status)}"
        return status

    @property
    def told_to_stop(self) -> bool:
        """SIGTERM or Ctrl-C reached the launcher itself: the job ends, nothing restarts."""
        return self._stop_requests > 0

    def _watch(self) -> tuple[int, int] | None:
        while True:
            codes = [child.poll() for child in self.children]
            failed = first_failure(codes)
            if failed is not None and self.failed_at is None:
                self.failed_at = time.time()
            if self._stop_requests and failed is not None:
                if all(c is not None for c in codes):  # told to stop: each saves and exits on its own
                    return failed
            elif failed is not None and _status(failed[1]) in exit_codes.STOPPED:
                # One process saved and stopped (a SIGTERM that reached it alone): the others stop
                # at the same step on their own; killing them now could cut their save short.
                if all(c is not None for c in codes):
                    return failed
            elif failed is not None:
                self._end_others(*failed)
                return failed
            if all(c == 0 for c in codes):
                return None
            time.sleep(0.1)

    def _end_others(self, index: int, code: int) -> None:
        how = exit_codes.describe(_status(code))
        running = [c for c in self.children if c.poll() is None]
        stopping = f"; stopping the other {len(running)} (SIGTERM, then SIGKILL after {self.grace_s:g}s)" \
            if running else ""
        print(f"zaya launch: process {self.first_id + index} {how}{stopping}", file=sys.stderr, flush=True)
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(c.poll() is None for c in self.children):
            time.sleep(0.1)
        self._signal_all(signal.SIGKILL)
        for child in self.children:
            child.wait()

    def _on_signal(self, signum, frame) -> None:
        self._stop_requests += 1
        if self._stop_requests == 1:
            print(f"zaya launch: {signal.Signals(signum).name}: asking every process to save and stop "
                  "(again to kill them)", file=sys.stderr, flush=True)
            self._signal_all(signal.SIGTERM)
        else:
            self._signal_all(signal.SIGKILL)

    def _signal_all(self, sig: int) -> None:
        for child in self.children:
            try:
                os.killpg(child.pid, sig)  # the whole group: nothing a process started outlives it
            except (ProcessLookupError, PermissionError):
                pass


def first_failure(codes: list[int | None]) -> tuple[int, int] | None:
    """(index, return code) of the failure to report among the children's `poll()` codes, or None.

    When several have failed by the same poll, the likeliest cause comes first, then the lower rank:
    1. an exit our code chose about itself (bad input, hung, repeated bad steps): never a peer's
       doing, and bad input must not be reported as a restartable failure;
    2. a signal other than SIGABRT (SIGKILL, SIGSEGV, ...): its peers usually ended only because
       it vanished (a collective lost its partner);
    3. a crash or SIGABRT, what a peer dies of when a process leaves: JAX's client aborts when
       the coordinator process 0 hosted is gone.
    """
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    return min(failed, key=lambda ic: (_cause_rank(ic[1]), ic[0]), default=None)


def _cause_rank(returncode: int) -> int:
    if returncode in (exit_codes.BAD_INPUT, exit_codes.HUNG, exit_codes.BAD_STEPS):
        return 0
    if returncode < 0 and -returncode != signal.SIGABRT:
        return 1
    return 2


def _status(returncode: int) -> int:
    """A child's exit status as a shell reports it: killed by signal s is 128 + s (Popen says -s)."""
    return returncode if returncode >= 0 else 128 - returncode
