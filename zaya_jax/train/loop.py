"""The training loop behind `zaya train`: data, resume or init, compile, steps, logging, eval, saves.

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

import dataclasses
import os
import shutil
import signal
import sys
import time

import jax
import numpy as np

from zaya_jax import cpu_host, exit_codes
from zaya_jax.data.pipeline import DataPipeline, DataSettings
from zaya_jax.drills import Drills
from zaya_jax.drills import parse as parse_drills
from zaya_jax.data.tokenizer import load_tokenizer
from zaya_jax.errors import ZayaError
from zaya_jax.experiment import Experiment
from zaya_jax.experiment.validate import profile_window
from zaya_jax.kernels import xla_flags
from zaya_jax.kernels.registry import describe as describe_kernel
from zaya_jax.model import layer_stack
from zaya_jax.parallel.mesh import BATCH_AXES
from zaya_jax.parallel.topology import Topology
from zaya_jax.train import compile_cache
from zaya_jax.train import flops as flops_lib
from zaya_jax.train import optim as optim_lib
from zaya_jax.train import processes
from zaya_jax.train.bad_step_policy import BadStepPolicy
from zaya_jax.train.events import Attempt, EventLog, read_events
from zaya_jax.train.goodput import Ledger, table as goodput_table
from zaya_jax.train.metrics_writer import MetricsWriter
from zaya_jax.train.program import Program, build_program
from zaya_jax.train.checkpoints import RunCheckpoints, check_compatible, run_meta
from zaya_jax.train.profiler import ProfileWindow
from zaya_jax.train.routing_watch import RoutingWatch
from zaya_jax.train.progress import Progress, StepTimer, device_profile
from zaya_jax.train.stop_signals import StopSignals
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
    if tokenizer.vocab_size > model.vocab_size:
        raise ZayaError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {model.vocab_size}; "
                        "raise model.vocab_size to at least the tokenizer's size")
    return DataPipeline(DataSettings.from_config(exp.config), tokenizer)


def _eval_batch_size(program: Program) -> int:
    size = program.exp.config.eval.batch_size or program.micro_batch
    width = int(np.prod([program.mesh.shape[a] for a in BATCH_AXES]))
    if size % width:
        raise ZayaError(f"eval.batch_size ({size}) must be a multiple of the {width} data-parallel devices")
    return size


def evaluate(program: Program, eval_step, state, batches: list[dict], size: int) -> dict | None:
    if not batches:
        return None
    loss, tokens = 0.0, 0.0
    for batch in batches:
        l, n = jax.device_get(eval_step(state.params, state.biases, program.place_eval_batch(batch, size)))
        loss, tokens = loss + float(l), tokens + float(n)
    return {"eval_loss": loss / max(tokens, 1.0), "eval_tokens": tokens}


def save_model(program: Program, state, path: str) -> None:
    """The model (params + balancing biases) as a zaya-jax checkpoint, one layer group at a time.

    Every process writes its own shards through Orbax (`jax.Array`s sliced on the devices), so
    arrays no single host can address are saved too; process 0 alone moves directories."""
    from zaya_jax.checkpoint import orbax_store

    arrays = {**state.params, **state.biases}
    kinds = program.modeldef.cfg.layer_kinds
    row = jax.jit(lambda value, i: value[i])  # one layer's row, left sharded where it lies

    def groups():  # the per-layer interchange form, one layer at a time
        yield {k: v for k, v in arrays.items() if not layer_stack.is_stacked(k)}
        for i in range(len(kinds)):
            yield layer_stack.layer_entries(arrays, i, kinds, row)

    tmp = path + ".saving"
    timeout = program.exp.config.distributed.initialization_timeout_s
    _on_process_zero(lambda: shutil.rmtree(tmp, ignore_errors=True), "model_clear", timeout)
    orbax_store.save_groups(tmp, program.modeldef.cfg, groups())
    _on_process_zero(lambda: (shutil.rmtree(path, ignore_errors=True), os.replace(tmp, path)), "model_done", timeout)


def _on_process_zero(action, name: str, timeout_s: int) -> None:
    """Run a filesystem action once, then let every process go on after it."""
    if jax.process_index() == 0:
        action()
    processes.barrier(name, timeout_s)


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
    workdir = prepare_workdir(workdir)
    events, ledger = _event_log(workdir, attempt, primary)
    c = exp.config
    compile_cache.use(c.train.compile_cache, workdir)  # before anything compiles
    program = build_program(exp, devices)  # layout errors first: they are cheap to find
    eval_batch_size = _eval_batch_size(program)
    data = build_data(exp)
    iterator = data.train_iterator(program.data_lanes())
    processes.use_coordination_barriers()  # before Orbax's first barrier
    checkpoints = RunCheckpoints(os.path.join(workdir, "checkpoints"), c.checkpoint.keep, c.checkpoint.async_save)
    run = _Run(exp, program, data, iterator, checkpoints, workdir, eval_batch_size, out, topology, events, ledger,
               attempt)
    try:
        with Watchdog(c.fault.hang_timeout_sec, _hang_writer(workdir), jax.process_index()) as run.watchdog:
            return run.go()
    finally:
        checkpoints.close()  # never leave a background save behind
        iterator.close()


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


class _Run:
    """One attempt of a run: resume or init, compile, the steps, saves, and how it ends."""

    def __init__(self, exp, program, data, iterator, checkpoints, workdir, eval_batch_size, out, topology, events,
                 ledger, attempt):
        self.exp, self.program, self.data, self.iterator = exp, program, data, iterator
        self.checkpoints, self.workdir, self.eval_batch_size, self.out = checkpoints, workdir, eval_batch_size, out
        self.topology, self.events, self.ledger, self.attempt = topology, events, ledger, attempt
        self.c = exp.config
        self.primary = jax.process_index() == 0
        self.watchdog: Watchdog | None = None
        self.summary = {"first_loss": None, "last_loss": None, "eval_loss": None, "compile_sec": 0.0,
                        "start_step": 0, "stopped_by": None, "exit_code": exit_codes.OK, "workdir": workdir}

    def go(self) -> dict:
        c, program = self.c, self.program
        hardware = device_profile(c.train.hardware, program.mesh.devices.flat[0])
        flops = flops_lib.training_flops_per_token(self.exp.model, c.train.seq_len)
        _banner(self.out, self.exp, program, self.data, self.workdir, hardware, self.topology)
        self.meta = run_meta(self.exp, program.abstract_state(), jax.process_count())
        self.events.write("startup", sec=round(time.time() - self.attempt.started_at, 4))
        with self.watchdog.allow(c.fault.io_timeout_sec, "reading the checkpoint"):
            state, start = _resume_or_init(program, self.checkpoints, self.iterator, self.meta, self.out, self.events)
        self.summary["start_step"] = start
        if start >= c.train.steps:
            print(f"already trained to step {start} (train.steps = {c.train.steps}); raise train.steps to go on",
                  file=self.out, flush=True)
            return self._finish(state, start, timer=None)
        with self.events.span("data"):  # a bad document near the start fails now, not after the compile
            first_batch = next(self.iterator)
        compiled, self.eval_step = self._compile()
        with self.events.span("data"):
            eval_rows = program.local_rows(self.eval_batch_size)
            self.eval_batches = list(self.data.eval_batches(self.eval_batch_size, c.eval.batches, eval_rows)) \
                if c.eval.batches else []
        timer = StepTimer(c.train.global_batch_size * c.train.seq_len, flops.total, program.mesh.size, hardware,
                          start_step=start)
        state, done = self._steps(compiled, state, start, first_batch, timer)
        if self.summary["stopped_by"]:
            return self.summary
        return self._finish(state, done, timer)

    def _compile(self):
        c, program = self.c, self.program
        with self.watchdog.allow(0, "compiling"), self.events.span("compile") as span:
            with compile_cache.Hits() as hits:
                compiled, self.summary["compile_sec"] = program.compile_train_step()
            self.summary["compile_cache_hit"] = span["cache_hit"] = hits.count > 0
            eval_step = program.compile_eval_step(self.eval_batch_size) if c.eval.batches else None
            # gloo gives up on a collective whose peers arrive 30 s apart: start the first step together.
            processes.barrier("compiled", c.distributed.initialization_timeout_s)
        where = compile_cache.directory(c.train.compile_cache, self.workdir)
        source = f"loaded the train step from the compilation cache {where}" if hits.count else \
            f"compiled the train step{'' if where is None else ' (cached in ' + where + ')'}"
        print(f"{source} in {self.summary['compile_sec']:.1f}s", file=self.out, flush=True)
        return compiled, eval_step

    def _steps(self, compiled, state, start: int, first_batch, timer: StepTimer):
        c, program = self.c, self.program
        drills = Drills(parse_drills(c.fault.drill), jax.process_index(), self.attempt.number)
        self.span = _StepSpan(self.events, start, state)  # the writers' start-up is the first span's
        with StopSignals(self.topology.process_count) as stop, \
                MetricsWriter(self.workdir, enabled=self.primary) as writer, \
                Progress(c.train.steps, enabled=c.train.progress and self.primary, initial=start) as bar:
            policy = BadStepPolicy(c.fault, self.events, bar.note)
            routing = RoutingWatch(self.events, bar.note)
            profile = ProfileWindow(profile_window(c.train.profile_steps), self.workdir, self.events)
            done = start
            for step in range(start, c.train.steps):
                self.watchdog.beat()
                batch = first_batch if step == start else next(self.iterator)
                done = step + 1
                with profile.step(done):
                    state, metrics = compiled(state, program.place_batch(drills.apply(done, batch)))
                profile.after(done, metrics)
                bar.advance()
                action = policy.after_step(done, metrics)
                routing.after_step(done, metrics)
                if action == "rollback":  # before this step is logged or saved: its state is undone
                    state, action = self._rollback(done, policy, state)
                self._log(writer, bar, timer, metrics, done, start)
                if action == "stop":
                    self._stopped(f"stopped: {policy.reason}. Not saved: the newest checkpoint "
                                  f"({self._newest()}) is where a rerun starts; look at the data near step {done}, "
                                  "or lower optim.lr", "bad steps", exit_codes.BAD_STEPS, done)
                    break
                self._evaluate(writer, bar, state, metrics, done)
                stopping = stop.reached(done)
                self._save(writer, state, metrics, done, stopping)
                if stopping:
                    self._stopped(f"stopped by {stop.name} after step {done}; saved "
                                  f"{self.checkpoints.step_dir(done)}. Run the same command again to resume.",
                                  stop.name, 128 + getattr(signal, stop.name).value, done)
                    break
            policy.flush()
            routing.flush()
            profile.close(done)
            # Waiting for the last save's background commit is checkpoint time in the ledger.
            with self.watchdog.allow(c.fault.io_timeout_sec, "finishing the checkpoint save"), \
                    self.events.span("checkpoint", step=done, commit_wait=True):
                self.checkpoints.wait()
            _write_save_timings(writer, self.checkpoints, self.events)
        self.summary["last_step"] = done
        return state, done

    def _log(self, writer, bar, timer, metrics, done: int, start: int) -> None:
        c = self.c
        # Every process waits for the loss here (only process 0 writes it): this bounds how
        # many steps any process queues ahead of the devices.
        if done % c.train.log_every == 0 or done == c.train.steps or done == start + 1:
            record = timer.record(jax.device_get(metrics), done)
            self.span.close(done, record["bad_steps"])
            writer.write(done, {**record, **self._goodput()})
            bar.show(record)
            self.summary["first_loss"] = self.summary["first_loss"] or record["loss"]
            self.summary["last_loss"] = record["loss"]

    def _goodput(self) -> dict:
        if self.ledger is None:
            return {}
        g = self.ledger.summary()
        return {"goodput": g["goodput"], "lost_sec": g["lost_sec"]}

    def _evaluate(self, writer, bar, state, metrics, done: int) -> None:
        c = self.c
        if not ((c.eval.every_steps and done % c.eval.every_steps == 0) or done == c.train.steps):
            return
        if not self.eval_batches:
            return
        self.span.close_at_sync(done, metrics)
        with self.events.span("eval", step=done):
            result = evaluate(self.program, self.eval_step, state, self.eval_batches, self.eval_batch_size)
        self.span.restart_clock()
        writer.write(done, result)
        bar.note(f"step {done}: held-out loss {result['eval_loss']:.4f}")
        self.summary["eval_loss"] = result["eval_loss"]

    def _save(self, writer, state, metrics, done: int, stopping: bool) -> None:
        every = self.c.checkpoint.every_steps
        if (every and done % every == 0) or done == self.c.train.steps or stopping:
            self.span.close_at_sync(done, metrics, state)
            with self.watchdog.allow(self.c.fault.io_timeout_sec, "saving a checkpoint"), \
                    self.events.span("checkpoint", step=done):
                blocking = self.checkpoints.save(done, state, self.iterator, self.meta)
            self.span.restart_clock()
            writer.write(done, {"checkpoint_blocking_sec": blocking, "checkpoint_async": self.checkpoints.async_save})
        _write_save_timings(writer, self.checkpoints, self.events)

    def _rollback(self, done: int, policy: BadStepPolicy, state):
        """(state, action): the newest checkpoint's state, with the data iterator left past the
        steps that went bad; or, with no checkpoint to go back to, the state as it is and stop."""
        policy.forget()
        with self.watchdog.allow(self.c.fault.io_timeout_sec, "rolling back"):
            self.checkpoints.wait()
            step = self.checkpoints.latest_step()
            if step is None:
                policy.reason += ", and there is no checkpoint to roll back to"
                return state, "stop"
            with self.events.span("rollback", step=step, at_step=done):
                state = self.checkpoints.restore(step, self.program.placed_abstract_state(), None)
        print(f"rolled back to {self.checkpoints.step_dir(step)} after step {done}: {policy.reason}; "
              f"training goes on with the data after step {done}", file=self.out, flush=True)
        self.span.restart(done, state)
        return state, None

    def _newest(self) -> str:
        step = self.checkpoints.latest_step()
        return "none yet" if step is None else self.checkpoints.step_dir(step)

    def _stopped(self, text: str, name: str, code: int, done: int) -> None:
        self.summary.update(stopped_by=name, exit_code=code)
        self.events.write("stop", step=done, reason=name)
        print(text, file=self.out, flush=True)

    def _finish(self, state, done: int, timer) -> dict:
        final = os.path.join(self.workdir, "model")
        with self.watchdog.allow(self.c.fault.io_timeout_sec, "saving the model"), self.events.span("model_save"):
            save_model(self.program, state, final)
        self.events.write("end", step=done)
        self.summary.update(timer.summary() if timer else {"tokens_per_sec": float("nan"), "mfu": None},
                            wall_sec=time.time() - self.attempt.started_at, model_dir=final)
        if self.ledger is not None:
            self.summary["goodput"] = self.ledger.summary()
        if timer:
            _report(self.out, self.summary, self.workdir, hf_exportable=not self.exp.model.is_hybrid)
        return self.summary


class _StepSpan:
    """The `steps` events: the time since the last sync point, closed whenever the host waits for
    the devices anyway (logging, eval, a checkpoint), with the bad steps among them."""

    def __init__(self, events: EventLog, start: int, state):
        self.events = events
        self.restart(start, state)

    def restart(self, step: int, state) -> None:
        """Count from `step`, with `state`'s bad-step total (a restored state has its own)."""
        self.first, self.began = step, time.time()
        self.bad_total = int(jax.device_get(state.guard.bad_total))

    def restart_clock(self) -> None:
        """Time from now: what ran since the span closed (an eval, a save) has its own event."""
        self.began = time.time()

    def close(self, done: int, bad_total) -> None:
        """Write the span up to `done` (nothing when it is empty: just restarted)."""
        if done > self.first:
            self.events.write("steps", sec=round(time.time() - self.began, 4), first=self.first, last=done,
                              bad=max(int(bad_total) - self.bad_total, 0))
            self.first, self.began, self.bad_total = done, time.time(), int(bad_total)

    def close_at_sync(self, done: int, metrics: dict, state=None) -> None:
        if done > self.first:
            if state is not None:
                jax.block_until_ready(state)  # the step's compute is step time, not the save's
            self.close(done, jax.device_get(metrics["bad_steps"]))


def _resume_or_init(program: Program, checkpoints: RunCheckpoints, iterator, meta: dict, out, events: EventLog):
    """(state, first step): from the newest complete checkpoint if there is one, else fresh."""
    step = checkpoints.latest_step()
    if step is None:
        with events.span("init"):
            return program.init(), 0
    where = checkpoints.step_dir(step)
    if not program.exp.config.checkpoint.resume:
        raise ZayaError(f"{checkpoints.directory} already holds checkpoints (newest: step {step}) and "
                        "checkpoint.resume is False; use a fresh --workdir, or set checkpoint.resume=True")
    with events.span("restore", step=step):
        saved = checkpoints.read_meta(step)
        # Checkpoints from before the bad-step guard hold no guard: restore the rest, start it empty.
        guarded = any(path.startswith(".guard") for path in saved["state_shapes"])
        check_compatible(saved, meta if guarded else _without_guard(meta), where)
        same_data = saved["data"] == meta["data"]
        target = program.placed_abstract_state()
        state = checkpoints.restore(step, target if guarded else dataclasses.replace(target, guard=None),
                                    iterator if same_data else None)
        if not guarded:
            state = dataclasses.replace(state, guard=program.fresh_guard())
    resharded = "" if saved["process_count"] == meta["process_count"] else \
        f"; saved by {saved['process_count']} process(es), resharded over {meta['process_count']}"
    print(f"resumed from {where} (step {step}{resharded})", file=out, flush=True)
    if not same_data:
        print("  the data settings changed since that checkpoint: the data pipeline starts from the "
              "beginning of the new settings", file=out, flush=True)
    return state, step


def _without_guard(meta: dict) -> dict:
    return {**meta, "state_shapes": {k: v for k, v in meta["state_shapes"].items() if not k.startswith(".guard")}}


def _write_save_timings(writer: MetricsWriter, checkpoints: RunCheckpoints, events: EventLog) -> None:
    """Saves whose background write finished: their time in metrics, their commit in the event log."""
    for timing in checkpoints.finished_saves():
        writer.write(timing.step, {"checkpoint_background_sec": timing.background_sec})
        events.write("checkpoint_commit", step=timing.step, background_sec=round(timing.background_sec, 4))


def _banner(out, exp: Experiment, program: Program, data: DataPipeline, workdir: str, hardware,
            topology: Topology) -> None:
    m, c = exp.model, exp.config
    axes = ", ".join(f"{a}={s}" for a, s in program.mesh.shape.items() if s > 1) or "one device"
    active = flops_lib.matmul_params_per_token(m)
    print(f"zaya train: {exp.source} → {workdir}", file=out)
    print(f"  model   {m.num_hidden_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts, "
          f"vocab {m.vocab_size}; {active / 1e6:.2f}M active matmul params/token; compute {m.compute_dtype}", file=out)

    kernels = {name: describe_kernel(name, backend) for name, backend in program.kernels().items()}
    print(f"  kernels attention {kernels['attention']}, experts {kernels['grouped_matmul']}, "
          f"norm {kernels['rms_norm']}", file=out)
    platform = program.mesh.devices.flat[0].platform
    host = "; host memory kept for reuse between steps (ZAYA_HOST_MALLOC)" if cpu_host.applied() else ""
    if platform == "cpu":
        host += cpu_host.devices_note(c.train.cpu_devices, jax.local_device_count())
    print(f"  mesh    {program.mesh.size} {platform} device(s): {axes}{host}", file=out)
    if topology.process_count > 1:
        across = ", ".join(topology.axes_across_nodes(program.mesh)) or "none"
        print(f"  cluster {topology.process_count} processes on {topology.nodes} node(s); axes across nodes: "
              f"{across}", file=out)
    print(f"  data    {data.describe()}; rows of {c.train.seq_len} tokens", file=out)
    print(f"  steps   {c.train.steps} x {c.train.global_batch_size} sequences "
          f"({c.train.grad_accum_steps} micro-batch(es)); MFU against "
          f"{hardware.name + ' ' + str(hardware.peak_bf16_tflops) + ' TFLOP/s' if hardware else 'an unknown device'}",
          file=out)
    warmup = optim_lib.warmup_steps(c.optim, c.train.steps)
    if warmup != c.optim.warmup_steps:
        print(f"  warmup  optim.warmup_steps ({c.optim.warmup_steps}) does not fit the "
              f"{optim_lib.schedule_steps(c.optim, c.train.steps)}-step schedule: warming up over {warmup} "
              "step(s), a tenth of it", file=out)
    out.flush()


def _report(out, summary: dict, workdir: str, hf_exportable: bool = True) -> None:
    eval_text = f", held-out {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    print(f"done: loss {summary['first_loss']:.4f} → {summary['last_loss']:.4f}{eval_text}; "
          f"{summary['tokens_per_sec']:.0f} tokens/s; {summary['wall_sec']:.0f}s wall", file=out)
    if summary.get("goodput"):
        for line in goodput_table(summary["goodput"]):
            print(f"  {line}", file=out)
    print(f"  metrics     {os.path.join(workdir, 'metrics.jsonl')} (events: events.jsonl; zaya report {workdir})",
          file=out)
    print(f"  tensorboard tensorboard --logdir {os.path.join(workdir, 'tensorboard')}", file=out)
    readers = "zaya_jax.load or zaya convert to-hf" if hf_exportable else "zaya_jax.load; a hybrid model has no HF form"
    print(f"  model       {summary['model_dir']} ({readers})", file=out, flush=True)
