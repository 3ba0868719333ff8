"""`zaya train`'s entry: the workdir, the data, the program, the event log and the watchdog around one
`Session` (`train/session.py`: the attempt itself, with `resume.py`, `evaluation.py`, `export.py`
and `console.py`).

Host work stays off the critical path: the loop reads each step's bad-step verdict one step late
(after the next step is dispatched) and waits for the loss only at logging steps. Metrics go to
`WORKDIR/metrics.jsonl` and TensorBoard (`WORKDIR/tensorboard/`). The full train state and the
data iterator are checkpointed to `WORKDIR/checkpoints/<step>/` every `checkpoint.every_steps`,
at the end, and on SIGTERM/SIGINT; a run started on a workdir that holds a checkpoint resumes
from the newest complete one. At the end the model alone is also written to `WORKDIR/model`
(loadable with `zaya_jax.load`, exportable with `zaya convert to-hf`).

With several processes (`zaya launch`, SLURM, Kubernetes) every process runs this loop on its
own devices: each reads the data lanes of the rows its devices hold, all write their shards of
every checkpoint and of the final model through Orbax, and all stop at the same step on SIGTERM.
Only process 0 speaks: the banner, the progress bar, metrics.jsonl and TensorBoard.

Faults (docs/faults.md): a hang watchdog (`train/watchdog.py`) ends a process that
makes no progress; bad steps are skipped in the compiled step and a streak of them rolls the
run back or stops it (`train/bad_step_policy.py`); `fault.drill` injects faults on purpose
(`drills.py`). Everything that takes time is an event in `WORKDIR/events.jsonl`, and process 0
keeps the goodput ledger (`train/goodput.py`): in metrics/TensorBoard and the final summary.
"""

from __future__ import annotations

import os
import sys

import jax

from zaya_jax import drills
from zaya_jax.data.pipeline import DataPipeline, DataSettings
from zaya_jax.data.tokenizer import check_fits, load_tokenizer
from zaya_jax.errors import ZayaError
from zaya_jax.experiment import Experiment
from zaya_jax.kernels import xla_flags
from zaya_jax.parallel.topology import Topology
from zaya_jax.train import barriers, compile_cache
from zaya_jax.train.checkpoints import RunCheckpoints
from zaya_jax.train.downstream import Downstream, check_tasks
from zaya_jax.train.evaluation import eval_batch_size
from zaya_jax.train.events import Attempt, EventLog, read_events
from zaya_jax.train.goodput import Ledger
from zaya_jax.train.program import build_program
from zaya_jax.train.resume import check_resumable
from zaya_jax.train.session import Session
from zaya_jax.train.watchdog import Watchdog


def prepare_workdir(workdir: str) -> str:
    if not workdir:
        raise ZayaError("--workdir is required: the directory for metrics, TensorBoard logs and checkpoints")
    workdir = os.path.abspath(workdir)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ZayaError(f"--workdir {workdir} exists and is not a directory; choose another path")
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".zaya_write_test.{os.getpid()}")  # one per process: they check at once
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ZayaError(f"--workdir {workdir} is not writable ({e.strerror}); choose a directory you can write") from None
    return workdir


def build_data(exp: Experiment) -> DataPipeline:
    d, model = exp.config.data, exp.model
    tokenizer = load_tokenizer(d.tokenizer, eos_id=model.eos_token_id if d.tokenizer != "bytes" else None)
    check_fits(tokenizer, model.vocab_size, "raise model.vocab_size to at least the tokenizer's size")
    return DataPipeline(DataSettings.from_config(exp.config), tokenizer)


def train(exp: Experiment, workdir: str, devices=None, out=sys.stdout, topology: Topology | None = None,
          attempt: Attempt | None = None) -> dict:
    """Run (or resume) the experiment; returns a summary (losses, throughput, wall time, goodput,
    how it stopped and the exit status that says so: `exit_codes`).

    `devices` in node-major order and `topology` come from the start-up (`cluster/startup.py`);
    the defaults are this process's view: all devices, one node. `attempt` says which start of
    the run this is (a supervisor's restart); the default is a fresh start, now."""
    attempt = attempt or Attempt()
    xla_flags.require(exp.model)  # set by validation already; a no-op then (or too late: one sentence)
    topology = topology or Topology.one_node(jax.process_count())
    primary = jax.process_index() == 0
    if not primary:
        out = open(os.devnull, "w")  # noqa: SIM115 — process 0 speaks; errors still reach stderr
    tasks = _downstream_tasks(exp)  # a bad task name is refused before the workdir is touched
    drills.check_job(drills.parse(exp.config.fault.drill), jax.process_count(), exp.config.train.steps)
    c = exp.config
    # Every input is checked before the workdir is touched: layout errors first (cheap to find),
    # then the data sources and the tokenizer, then the checkpoint a resume would read; nothing
    # here compiles.
    program = build_program(exp, devices)
    eval_size = eval_batch_size(program)
    data = build_data(exp)
    check_resumable(program, os.path.abspath(workdir))  # a checkpoint this run cannot resume: said first
    workdir = prepare_workdir(workdir)
    events, ledger = _event_log(workdir, attempt, primary)
    # Before anything compiles. On CPU each process's cache keys are its own: each writes them.
    own_keys = jax.process_count() > 1 and program.devices_target == "cpu"
    compile_cache.use(c.train.compile_cache, workdir, every_process=own_keys)
    iterator = data.train_iterator(program.data_lanes())
    barriers.use_coordination_barriers()  # before Orbax's first barrier
    checkpoints = RunCheckpoints(os.path.join(workdir, "checkpoints"), c.checkpoint.keep, c.checkpoint.async_save)
    session = Session(exp, program, data, iterator, checkpoints, workdir, eval_size, out, topology, events, ledger,
                      attempt, Downstream(program, tasks, data.tokenizer, workdir, primary))
    try:
        with Watchdog(c.fault.hang_timeout_sec, _hang_writer(workdir), jax.process_index()) as session.watchdog:
            return session.execute()
    finally:
        checkpoints.close()  # never leave a background save behind
        iterator.close()


def _downstream_tasks(exp: Experiment):
    e = exp.config.eval
    if (e.tasks.strip() or e.prompts) and jax.process_count() > 1:
        raise ZayaError("eval.tasks and eval.prompts run in single-process runs for now; evaluate a multi-process "
                        "run's WORKDIR/model with `zaya eval` and `zaya generate`, or set eval.tasks='' eval.prompts=[]",
                        every_process=True)
    return check_tasks(exp.config)


def _event_log(workdir: str, attempt: Attempt, primary: bool) -> tuple[EventLog, Ledger | None]:
    """The run's event log, and (process 0) the goodput ledger with the run's history in it."""
    events = EventLog(workdir, jax.process_index(), enabled=primary)
    if not primary:
        return events, None
    ledger = Ledger()
    if os.path.exists(events.path):
        for event in read_events(workdir):
            ledger.add(event)
    events.listeners.append(ledger.add)
    events.write("start", at=attempt.started_at, attempt=attempt.number, cause=attempt.cause,
                 failed_at=attempt.failed_at, processes=jax.process_count())
    return events, ledger


def _hang_writer(workdir: str):
    """What the watchdog records when it fires, from whichever process it runs in."""
    def write(idle: float, what: str, limit: float) -> None:
        EventLog(workdir, jax.process_index()).write("hang", sec=round(idle, 4), what=what, limit=limit)

    return write
