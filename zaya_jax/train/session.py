"""One attempt of a run, from resume or init to how it ends: compile, the steps, logging, evaluation,
saves, bad-step rollbacks, stops, and the final export and report (`Session.execute`)."""

from __future__ import annotations

import os
import signal
import time

import jax

from zaya_jax import exit_codes
from zaya_jax.drills import Drills
from zaya_jax.drills import parse as parse_drills
from zaya_jax.experiment.validate import profile_window
from zaya_jax.train import barriers, compile_cache
from zaya_jax.train import flops as flops_lib
from zaya_jax.train.bad_step_policy import BadStepPolicy
from zaya_jax.train.checkpoints import RunCheckpoints, run_meta
from zaya_jax.train.console import banner, report
from zaya_jax.train.evaluation import evaluate
from zaya_jax.train.events import EventLog
from zaya_jax.train.export import save_model
from zaya_jax.train.metrics_writer import MetricsWriter
from zaya_jax.train.profiler import ProfileWindow
from zaya_jax.train.progress import Progress
from zaya_jax.train.throughput import StepTimer, device_profile
from zaya_jax.train.resume import resume_or_init
from zaya_jax.train.routing_watch import RoutingWatch
from zaya_jax.train.stop_signals import StopSignals
from zaya_jax.train.watchdog import Watchdog


class Session:
    """One attempt of a run: resume or init, compile, the steps, saves, and how it ends."""

    def __init__(self, exp, program, data, iterator, checkpoints, workdir, eval_batch_size, out, topology, events,
                 ledger, attempt, downstream):
        self.exp, self.program, self.data, self.iterator = exp, program, data, iterator
        self.checkpoints, self.workdir, self.eval_batch_size, self.out = checkpoints, workdir, eval_batch_size, out
        self.topology, self.events, self.ledger, self.attempt = topology, events, ledger, attempt
        self.downstream = downstream
        self.c = exp.config
        self.primary = jax.process_index() == 0
        self.watchdog: Watchdog | None = None
        self.summary = {"first_loss": None, "last_loss": None, "eval_loss": None, "compile_sec": 0.0,
                        "start_step": 0, "stopped_by": None, "exit_code": exit_codes.OK, "workdir": workdir}

    def execute(self) -> dict:
        c, program = self.c, self.program
        hardware = device_profile(c.train.hardware, program.mesh.devices.flat[0])
        flops = flops_lib.training_flops_per_token(self.exp.model, c.train.seq_len)
        banner(self.out, self.exp, program, self.data, self.workdir, hardware, self.topology)
        self.meta = run_meta(self.exp, program.abstract_state(), jax.process_count())
        self.events.write("startup", sec=round(time.time() - self.attempt.started_at, 4))
        with self.watchdog.allow(c.fault.io_timeout_sec, "reading the checkpoint"):
            state, start = resume_or_init(program, self.checkpoints, self.iterator, self.meta, self.out, self.events)
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
        with self.watchdog.allow(0, "compiling"):
            with self.events.span("compile") as span:
                with compile_cache.Hits() as hits:
                    compiled, self.summary["compile_sec"] = program.compile_train_step()
                self.summary["compile_cache_hit"] = span["cache_hit"] = hits.count > 0
                eval_step = program.compile_eval_step(self.eval_batch_size) if c.eval.batches else None
            # gloo gives up on a collective whose peers arrive 30 s apart: start the first step together.
            with self.events.span("compile_wait"):
                barriers.barrier("compiled", c.distributed.initialization_timeout_s)
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
                self._log(writer, bar, timer, routing, metrics, done, start)
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
            write_save_timings(writer, self.checkpoints, self.events)
        self.summary["last_step"] = done
        return state, done

    def _log(self, writer, bar, timer, routing, metrics, done: int, start: int) -> None:
        c = self.c
        # Every process waits for the loss here (only process 0 writes it): this bounds how
        # many steps any process queues ahead of the devices.
        if done % c.train.log_every == 0 or done == c.train.steps or done == start + 1:
            fetched = jax.device_get(metrics)
            record = {**timer.record(fetched, done), **routing.interval_peaks(fetched, done)}
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
        if not (self.eval_batches or self.downstream.active):
            return
        self.span.close_at_sync(done, metrics)
        with self.events.span("eval", step=done):
            if self.eval_batches:
                result = evaluate(self.program, self.eval_step, state, self.eval_batches, self.eval_batch_size)
                writer.write(done, result)
                bar.note(f"step {done}: held-out loss {result['eval_loss']:.4f}")
                self.summary["eval_loss"] = result["eval_loss"]
            self.downstream.run(state, done, writer, bar.note, self.events)
        self.span.restart_clock()

    def _save(self, writer, state, metrics, done: int, stopping: bool) -> None:
        every = self.c.checkpoint.every_steps
        if (every and done % every == 0) or done == self.c.train.steps or stopping:
            self.span.close_at_sync(done, metrics, state)
            with self.watchdog.allow(self.c.fault.io_timeout_sec, "saving a checkpoint"), \
                    self.events.span("checkpoint", step=done):
                blocking = self.checkpoints.save(done, state, self.iterator, self.meta)
            self.span.restart_clock()
            writer.write(done, {"checkpoint_blocking_sec": blocking, "checkpoint_async": self.checkpoints.async_save})
        write_save_timings(writer, self.checkpoints, self.events)

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
            report(self.out, self.summary, self.workdir, hf_exportable=not self.exp.model.is_hybrid)
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


def write_save_timings(writer: MetricsWriter, checkpoints: RunCheckpoints, events: EventLog) -> None:
    """Saves whose background write finished: their time in metrics, their commit in the event log."""
    for timing in checkpoints.finished_saves():
        writer.write(timing.step, {"checkpoint_background_sec": timing.background_sec})
        events.write("checkpoint_commit", step=timing.step, background_sec=round(timing.background_sec, 4))
