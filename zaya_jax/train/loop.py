"""The training loop behind `zaya train`: data, resume or init, compile, steps, logging, eval, saves.

Host work stays off the critical path: the loop only waits for the device at logging steps
(to read the loss), so steps in between are dispatched back to back. Metrics go to
`WORKDIR/metrics.jsonl` and TensorBoard (`WORKDIR/tensorboard/`). The full train state and the
data iterator are checkpointed to `WORKDIR/checkpoints/<step>/` every `checkpoint.every_steps`,
at the end, and on SIGTERM/SIGINT; a run started on a workdir that holds a checkpoint resumes
from the newest complete one. At the end the model alone is also written to `WORKDIR/model`
(loadable with `zaya_jax.load`, exportable with `zaya convert to-hf`).

With several processes (`zaya launch`, SLURM, Kubernetes) every process runs this loop on its
own devices: each reads the data lanes of the rows its devices hold, all write their shards of
every checkpoint and of the final model through Orbax, and all stop at the same step on SIGTERM.
Only process 0 speaks: the banner, the progress bar, metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import jax
import numpy as np

from zaya_jax.data.pipeline import DataPipeline, DataSettings
from zaya_jax.data.tokenizer import load_tokenizer
from zaya_jax.errors import ZayaError
from zaya_jax.experiment import Experiment
from zaya_jax.kernels import xla_flags
from zaya_jax.kernels.registry import describe as describe_kernel
from zaya_jax.model import layer_stack
from zaya_jax.parallel.mesh import BATCH_AXES
from zaya_jax.parallel.topology import Topology
from zaya_jax.train import compile_cache
from zaya_jax.train import flops as flops_lib
from zaya_jax.train import optim as optim_lib
from zaya_jax.train import processes
from zaya_jax.train.metrics_writer import MetricsWriter
from zaya_jax.train.program import Program, build_program
from zaya_jax.train.checkpoints import RunCheckpoints, check_compatible, run_meta
from zaya_jax.train.progress import Progress, StepTimer, device_profile
from zaya_jax.train.stop_signals import StopSignals


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
    layers = program.modeldef.cfg.num_hidden_layers
    row = jax.jit(lambda value, i: value[i])  # one layer's row, left sharded where it lies

    def groups():  # the per-layer interchange form, one layer at a time
        yield {k: v for k, v in arrays.items() if not layer_stack.is_stacked(k)}
        for i in range(layers):
            yield layer_stack.layer_entries(arrays, i, row)

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


def train(exp: Experiment, workdir: str, devices=None, out=sys.stdout, topology: Topology | None = None) -> dict:
    """Run (or resume) the experiment; returns a summary (losses, throughput, wall time, stop reason).

    `devices` in node-major order and `topology` come from the start-up (`cluster/startup.py`);
    the defaults are this process's view: all devices, one node."""
    started = time.perf_counter()
    xla_flags.require(exp.model)  # set by validation already; a no-op then (or too late: one sentence)
    topology = topology or Topology.one_node(jax.process_count())
    if jax.process_index() != 0:
        out = open(os.devnull, "w")  # noqa: SIM115 — process 0 speaks; errors still reach stderr
    workdir = prepare_workdir(workdir)
    c = exp.config
    compile_cache.use(c.train.compile_cache, workdir)  # before anything compiles
    program = build_program(exp, devices)  # layout errors first: they are cheap to find
    eval_batch_size = _eval_batch_size(program)
    data = build_data(exp)
    iterator = data.train_iterator(program.data_lanes())
    processes.use_coordination_barriers()  # before Orbax's first barrier
    checkpoints = RunCheckpoints(os.path.join(workdir, "checkpoints"), c.checkpoint.keep, c.checkpoint.async_save)
    try:
        return _run(exp, program, data, iterator, checkpoints, workdir, eval_batch_size, started, out, topology)
    finally:
        checkpoints.close()  # never leave a background save behind
        iterator.close()


def _run(exp, program, data, iterator, checkpoints, workdir, eval_batch_size, started, out, topology) -> dict:
    c = exp.config
    primary = jax.process_index() == 0
    hardware = device_profile(c.train.hardware, program.mesh.devices.flat[0])
    flops = flops_lib.training_flops_per_token(exp.model, c.train.seq_len)
    _banner(out, exp, program, data, workdir, hardware, topology)
    meta = run_meta(exp, program.abstract_state(), jax.process_count())
    state, start = _resume_or_init(program, checkpoints, iterator, meta, out)
    summary = {"first_loss": None, "last_loss": None, "eval_loss": None, "compile_sec": 0.0,
               "start_step": start, "stopped_by": None, "workdir": workdir}
    if start >= c.train.steps:
        print(f"already trained to step {start} (train.steps = {c.train.steps}); raise train.steps to go on",
              file=out, flush=True)
        return _finish(program, state, summary, started, workdir, out, timer=None)
    first_batch = next(iterator)  # a bad document near the start fails now, not after the compile
    with compile_cache.Hits() as hits:
        compiled, summary["compile_sec"] = program.compile_train_step()
    summary["compile_cache_hit"] = hits.count > 0
    eval_step = program.compile_eval_step(eval_batch_size) if c.eval.batches else None
    # gloo gives up on a collective whose peers arrive 30 s apart: start the first step together.
    processes.barrier("compiled", c.distributed.initialization_timeout_s)
    where = compile_cache.directory(c.train.compile_cache, workdir)
    source = f"loaded the train step from the compilation cache {where}" if hits.count else \
        f"compiled the train step{'' if where is None else ' (cached in ' + where + ')'}"
    print(f"{source} in {summary['compile_sec']:.1f}s", file=out, flush=True)
    eval_rows = program.local_rows(eval_batch_size)
    eval_batches = list(data.eval_batches(eval_batch_size, c.eval.batches, eval_rows)) if c.eval.batches else []

    timer = StepTimer(c.train.global_batch_size * c.train.seq_len, flops.total, program.mesh.size, hardware,
                      start_step=start)
    with StopSignals(topology.process_count) as stop, MetricsWriter(workdir, enabled=primary) as writer, \
            Progress(c.train.steps, enabled=c.train.progress and primary, initial=start) as bar:
        for step in range(start, c.train.steps):
            batch = first_batch if step == start else next(iterator)
            state, metrics = compiled(state, program.place_batch(batch))
            done = step + 1
            bar.advance()
            # Every process waits for the loss here (only process 0 writes it): this bounds how
            # many steps any process queues ahead of the devices.
            if done % c.train.log_every == 0 or done == c.train.steps or step == start:
                record = timer.record(jax.device_get(metrics), done)
                writer.write(done, record)
                bar.show(record)
                summary["first_loss"] = summary["first_loss"] or record["loss"]
                summary["last_loss"] = record["loss"]
            if (c.eval.every_steps and done % c.eval.every_steps == 0) or done == c.train.steps:
                result = evaluate(program, eval_step, state, eval_batches, eval_batch_size)
                if result:
                    writer.write(done, result)
                    bar.note(f"step {done}: held-out loss {result['eval_loss']:.4f}")
                    summary["eval_loss"] = result["eval_loss"]
            every = c.checkpoint.every_steps
            stopping = stop.reached(done)
            if (every and done % every == 0) or done == c.train.steps or stopping:
                blocking = checkpoints.save(done, state, iterator, meta)
                writer.write(done, {"checkpoint_blocking_sec": blocking, "checkpoint_async": checkpoints.async_save})
            _write_save_timings(writer, checkpoints)
            if stopping:
                summary["stopped_by"] = stop.name
                break
        checkpoints.wait()
        _write_save_timings(writer, checkpoints)
    summary["last_step"] = done
    if summary["stopped_by"]:
        print(f"stopped by {stop.name} after step {done}; saved {checkpoints.step_dir(done)}. "
              "Run the same command again to resume.", file=out, flush=True)
        return summary
    return _finish(program, state, summary, started, workdir, out, timer)


def _resume_or_init(program: Program, checkpoints: RunCheckpoints, iterator, meta: dict, out):
    """(state, first step): from the newest complete checkpoint if there is one, else fresh."""
    step = checkpoints.latest_step()
    if step is None:
        return program.init(), 0
    where = checkpoints.step_dir(step)
    if not program.exp.config.checkpoint.resume:
        raise ZayaError(f"{checkpoints.directory} already holds checkpoints (newest: step {step}) and "
                        "checkpoint.resume is False; use a fresh --workdir, or set checkpoint.resume=True")
    saved = checkpoints.read_meta(step)
    check_compatible(saved, meta, where)
    same_data = saved["data"] == meta["data"]
    state = checkpoints.restore(step, program.placed_abstract_state(), iterator if same_data else None)
    resharded = "" if saved["process_count"] == meta["process_count"] else \
        f"; saved by {saved['process_count']} process(es), resharded over {meta['process_count']}"
    print(f"resumed from {where} (step {step}{resharded})", file=out, flush=True)
    if not same_data:
        print("  the data settings changed since that checkpoint: the data pipeline starts from the "
              "beginning of the new settings", file=out, flush=True)
    return state, step


def _write_save_timings(writer: MetricsWriter, checkpoints: RunCheckpoints) -> None:
    for timing in checkpoints.finished_saves():
        writer.write(timing.step, {"checkpoint_background_sec": timing.background_sec})


def _finish(program, state, summary, started, workdir, out, timer) -> dict:
    final = os.path.join(workdir, "model")
    save_model(program, state, final)
    summary.update(timer.summary() if timer else {"tokens_per_sec": float("nan"), "mfu": None},
                   wall_sec=time.perf_counter() - started, model_dir=final)
    if timer:
        _report(out, summary, workdir)
    return summary


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
    print(f"  mesh    {program.mesh.size} {program.mesh.devices.flat[0].platform} device(s): {axes}", file=out)
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


def _report(out, summary: dict, workdir: str) -> None:
    eval_text = f", held-out {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    print(f"done: loss {summary['first_loss']:.4f} → {summary['last_loss']:.4f}{eval_text}; "
          f"{summary['tokens_per_sec']:.0f} tokens/s; {summary['wall_sec']:.0f}s wall", file=out)
    print(f"  metrics     {os.path.join(workdir, 'metrics.jsonl')}", file=out)
    print(f"  tensorboard tensorboard --logdir {os.path.join(workdir, 'tensorboard')}", file=out)
    print(f"  model       {summary['model_dir']} (zaya_jax.load or zaya convert to-hf)", file=out, flush=True)
