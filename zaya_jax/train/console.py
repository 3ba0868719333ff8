"""What a run prints for a person: the banner before the first step and the report at the end."""

from __future__ import annotations

import os

import jax

from zaya_jax import cpu_host
from zaya_jax.data.pipeline import DataPipeline
from zaya_jax.experiment import Experiment
from zaya_jax.kernels.registry import describe as describe_kernel
from zaya_jax.parallel.topology import Topology
from zaya_jax.train import flops as flops_lib
from zaya_jax.train import optim as optim_lib
from zaya_jax.train.goodput import table as goodput_table
from zaya_jax.train.program import Program


def banner(out, exp: Experiment, program: Program, data: DataPipeline, workdir: str, hardware,
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
        host += cpu_host.devices_note(c.train.cpu_devices, jax.local_device_count()) + cpu_host.threads_note()
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


def report(out, summary: dict, workdir: str, hf_exportable: bool = True) -> None:
    eval_text = f", held-out {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    tps = summary["tokens_per_sec"]
    speed = f"{tps:.0f} tokens/s" if tps == tps else "tokens/s not measured (the first step of a start is not timed)"
    print(f"done: loss {summary['first_loss']:.4f} → {summary['last_loss']:.4f}{eval_text}; "
          f"{speed}; {summary['wall_sec']:.0f}s wall", file=out)
    if summary.get("goodput"):
        for line in goodput_table(summary["goodput"]):
            print(f"  {line}", file=out)
    print(f"  metrics     {os.path.join(workdir, 'metrics.jsonl')} (events: events.jsonl; zaya report {workdir})",
          file=out)
    print(f"  tensorboard tensorboard --logdir {os.path.join(workdir, 'tensorboard')}", file=out)
    readers = "zaya_jax.load or zaya convert to-hf" if hf_exportable else "zaya_jax.load; a hybrid model has no HF form"
    print(f"  model       {summary['model_dir']} ({readers})", file=out, flush=True)
