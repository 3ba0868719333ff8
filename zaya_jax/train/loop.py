"""The training loop behind `zaya train`: data, init, compile, steps, logging, eval, model saves.

Host work stays off the critical path: the loop only waits for the device at logging steps
(to read the loss), so steps in between are dispatched back to back. Metrics go to
`WORKDIR/metrics.jsonl` and TensorBoard (`WORKDIR/tensorboard/`); the model is saved as a
zaya-jax checkpoint (loadable with `zaya_jax.load`, exportable with `zaya convert to-hf`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import jax
import numpy as np

from zaya_jax.data import TextBatches, load_documents, load_tokenizer
from zaya_jax.errors import ZayaError
from zaya_jax.experiment import Experiment
from zaya_jax.parallel.mesh import BATCH_AXES
from zaya_jax.train import flops as flops_lib
from zaya_jax.train.metrics_writer import MetricsWriter
from zaya_jax.train.program import Program, build_program
from zaya_jax.train.progress import Progress, StepTimer, device_profile


def prepare_workdir(workdir: str) -> str:
    if not workdir:
        raise ZayaError("--workdir is required: the directory for metrics, TensorBoard logs and checkpoints")
    workdir = os.path.abspath(workdir)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ZayaError(f"--workdir {workdir} exists and is not a directory; choose another path")
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, ".zaya_write_test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ZayaError(f"--workdir {workdir} is not writable ({e.strerror}); choose a directory you can write") from None
    return workdir


def build_data(exp: Experiment) -> TextBatches:
    d, model = exp.config.data, exp.model
    tokenizer = load_tokenizer(d.tokenizer, eos_id=model.eos_token_id if d.tokenizer != "bytes" else None)
    if tokenizer.vocab_size > model.vocab_size:
        raise ZayaError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {model.vocab_size}; "
                        "raise model.vocab_size to at least the tokenizer's size")
    documents = load_documents(d.source, d.text_field)
    return TextBatches(documents, tokenizer, exp.config.train.seq_len, seed=exp.config.train.seed,
                       heldout_fraction=d.heldout_fraction)


def _eval_batch_size(program: Program) -> int:
    size = program.exp.config.eval.batch_size or program.micro_batch
    width = int(np.prod([program.mesh.shape[a] for a in BATCH_AXES]))
    if size % width:
        raise ZayaError(f"eval.batch_size ({size}) must be a multiple of the {width} data-parallel devices")
    return size


def evaluate(program: Program, eval_step, state, data: TextBatches, batch_size: int) -> dict | None:
    c = program.exp.config.eval
    if data.num_eval_rows == 0 or c.batches == 0:
        return None
    loss, tokens = 0.0, 0.0
    for batch in data.eval_batches(batch_size, c.batches):
        l, n = jax.device_get(eval_step(state.params, state.biases, program.place_batch(batch, accumulated=False)))
        loss, tokens = loss + float(l), tokens + float(n)
    return {"eval_loss": loss / max(tokens, 1.0), "eval_tokens": tokens}


def save_model(program: Program, state, path: str) -> None:
    """The model (params + balancing biases) as a zaya-jax checkpoint, one layer group at a time."""
    from zaya_jax.checkpoint import orbax_store

    arrays = {**state.params, **state.biases}
    layers = program.modeldef.cfg.num_hidden_layers

    def groups():
        yield {k: np.asarray(jax.device_get(v)) for k, v in arrays.items() if not k.startswith("layers/")}
        for i in range(layers):
            prefix = f"layers/{i}/"
            yield {k: np.asarray(jax.device_get(v)) for k, v in arrays.items() if k.startswith(prefix)}

    tmp = path + ".saving"
    shutil.rmtree(tmp, ignore_errors=True)
    orbax_store.save_groups(tmp, program.modeldef.cfg, groups())
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _prune(checkpoint_dir: str, keep: int) -> None:
    steps = sorted(d for d in os.listdir(checkpoint_dir) if d.startswith("step_") and not d.endswith(".saving"))
    for old in steps[:-keep]:
        shutil.rmtree(os.path.join(checkpoint_dir, old), ignore_errors=True)


def train(exp: Experiment, workdir: str, devices=None, out=sys.stdout) -> dict:
    """Run the experiment; returns a summary (first/last loss, eval loss, throughput, wall time)."""
    started = time.perf_counter()
    workdir = prepare_workdir(workdir)
    c = exp.config
    program = build_program(exp, devices)  # layout errors first: they are cheap to find
    eval_batch_size = _eval_batch_size(program)
    data = build_data(exp)
    hardware = device_profile(c.train.hardware, program.mesh.devices.flat[0])
    flops = flops_lib.training_flops_per_token(exp.model, c.train.seq_len)
    _banner(out, exp, program, data, workdir, hardware)

    state = program.init()
    compiled, compile_sec = program.compile_train_step()
    eval_step = program.jitted_eval_step()
    print(f"compiled the train step in {compile_sec:.1f}s", file=out, flush=True)

    tokens_per_step = c.train.global_batch_size * c.train.seq_len
    timer = StepTimer(tokens_per_step, flops.total, program.mesh.size, hardware)
    summary = {"first_loss": None, "last_loss": None, "eval_loss": None, "compile_sec": compile_sec}
    checkpoint_dir = os.path.join(workdir, "checkpoints")
    with MetricsWriter(workdir) as writer, Progress(c.train.steps, enabled=c.train.progress) as bar:
        for step in range(c.train.steps):
            batch = program.place_batch(data.train_batch(step, c.train.global_batch_size))
            state, metrics = compiled(state, batch)
            done = step + 1
            bar.advance()
            if done % c.train.log_every == 0 or done == c.train.steps or step == 0:
                record = timer.record(jax.device_get(metrics), done)
                writer.write(done, record)
                bar.show(record)
                summary["first_loss"] = summary["first_loss"] or record["loss"]
                summary["last_loss"] = record["loss"]
            if (c.eval.every_steps and done % c.eval.every_steps == 0) or done == c.train.steps:
                result = evaluate(program, eval_step, state, data, eval_batch_size)
                if result:
                    writer.write(done, result)
                    bar.note(f"step {done}: held-out loss {result['eval_loss']:.4f}")
                    summary["eval_loss"] = result["eval_loss"]
            if c.checkpoint.every_steps and done % c.checkpoint.every_steps == 0 and done < c.train.steps:
                os.makedirs(checkpoint_dir, exist_ok=True)
                save_model(program, state, os.path.join(checkpoint_dir, f"step_{done:08d}"))
                _prune(checkpoint_dir, c.checkpoint.keep)
    final = os.path.join(workdir, "model")
    save_model(program, state, final)
    summary.update(timer.summary(), wall_sec=time.perf_counter() - started, model_dir=final, workdir=workdir)
    _report(out, summary, workdir)
    return summary


def _banner(out, exp: Experiment, program: Program, data: TextBatches, workdir: str, hardware) -> None:
    m, c = exp.model, exp.config
    axes = ", ".join(f"{a}={s}" for a, s in program.mesh.shape.items() if s > 1) or "one device"
    active = flops_lib.matmul_params_per_token(m)
    print(f"zaya train: {exp.source} → {workdir}", file=out)
    print(f"  model   {m.num_hidden_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts, "
          f"vocab {m.vocab_size}; {active / 1e6:.2f}M active matmul params/token; compute {m.compute_dtype}", file=out)
    print(f"  mesh    {program.mesh.size} {program.mesh.devices.flat[0].platform} device(s): {axes}", file=out)
    print(f"  data    {c.data.source}: {data.num_train_rows} train rows, {data.num_eval_rows} held-out rows "
          f"of {c.train.seq_len} tokens", file=out)
    print(f"  steps   {c.train.steps} x {c.train.global_batch_size} sequences "
          f"({c.train.grad_accum_steps} micro-batch(es)); MFU against "
          f"{hardware.name + ' ' + str(hardware.peak_bf16_tflops) + ' TFLOP/s' if hardware else 'an unknown device'}",
          file=out, flush=True)


def _report(out, summary: dict, workdir: str) -> None:
    eval_text = f", held-out {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    print(f"done: loss {summary['first_loss']:.4f} → {summary['last_loss']:.4f}{eval_text}; "
          f"{summary['tokens_per_sec']:.0f} tokens/s; {summary['wall_sec']:.0f}s wall", file=out)
    print(f"  metrics     {os.path.join(workdir, 'metrics.jsonl')}", file=out)
    print(f"  tensorboard tensorboard --logdir {os.path.join(workdir, 'tensorboard')}", file=out)
    print(f"  model       {summary['model_dir']} (zaya_jax.load or zaya convert to-hf)", file=out, flush=True)
