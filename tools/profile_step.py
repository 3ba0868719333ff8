"""Where a train step's device time goes: `tools/gpu_check.py`'s step, profiled, by model part and kind of op.

Builds gpu_check's step (`experiments/zaya1_base_phase1.py` at `--layers`, bf16, the device's
kernels, `--batch` micro-batches of one `--seq-len` sequence) on one device, runs two warm-up
steps, then traces `--steps` steps with JAX's profiler. Each device op of the trace is matched to
its HLO instruction in the compiled step and counted by

* part: the model scope its `op_name` names (attention, experts, router, linear attention, norms,
  loss, embedding, the optimizer: its update and Muon's `newton_schulz`, other), forward or
  backward (`transpose(` in the name);
* kind: `matmul` (a dot, a cuBLAS call or a fusion holding one; `matmul (tf32)` for an fp32
  library GEMM), `kernel` (a Pallas/Triton custom call), `collective`, `copy` (copy, transpose,
  memcpy), `elementwise` (every other fusion or op).

XLA's CUDA graphs are turned off for the run (`--xla_gpu_enable_command_buffer=`): a kernel launched
inside one reports only the graph as its op. A trace taken with them on (or a kernel no instruction
names) is matched by the kernel's own name where it says what it is (cuBLAS, `zaya_*` Pallas kernels).

Prints the table (ms per step, share of the device time, bytes the elementwise ops read and write)
and writes JSON and Markdown; `--keep-trace DIR` leaves the trace and the optimized HLO there as a
.tar.gz. `tools/gpu_check.py`'s `profile` part runs it, and `zaya mesh --calibrate` reads its rows:
the elementwise work against the explorer's (`explore/step_time.py`, a pass count measured on
CPU) and the optimizer's fp32 products against their FLOPs (`explore/calibration.py`).

    python tools/profile_step.py --out benchmarks/gpu_step_profile_<device>.json [--layers 4]

On a machine without a GPU, `--allow-cpu` checks the tool on a small shape.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
TINY = ["--config.model.hidden_size=256", "--config.model.num_experts=4", "--config.model.moe_intermediate_size=256",
        "--config.model.vocab_size=1024", "--config.model.num_attention_heads=4", "--config.model.num_key_value_heads=2",
        "--config.model.head_dim=64"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON path; the Markdown table goes beside it")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="sequences per step, one per micro-batch (default 4)")
    p.add_argument("--steps", type=int, default=2, help="steps traced (default 2)")
    p.add_argument("--keep-trace", metavar="DIR", help="leave the trace and the optimized HLO here (.tar.gz)")
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU, on a small shape (checks the tool)")
    args = p.parse_args(argv)
    for name in ("layers", "seq_len", "batch", "steps"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    # Kernels XLA records into a CUDA graph report only the graph as their HLO op; launched one by
    # one, each names its own instruction (the step's time is measured the same way).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

    import jax

    on_cpu = jax.default_backend() == "cpu"
    if on_cpu and not args.allow_cpu:
        fail("JAX sees no GPU; pass --allow-cpu to check the tool on CPU")
    result = profile_step(args, TINY if on_cpu else [])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    markdown = _markdown(result)
    with open(os.path.splitext(args.out)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(markdown)
    print(markdown)
    return 0


def fail(message: str) -> None:
    """A bad argument or machine: one line on stderr, exit status 2."""
    print(f"profile_step: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def profile_step(args, extra: list[str]) -> dict:
    import jax
    import numpy as np

    from gpu_check import EXPERIMENT, step_overrides, synthetic_batch
    from zaya_jax.experiment import load_experiment
    from zaya_jax.explore.calibration import MODEL_FIELDS
    from zaya_jax.train.muon import ns_dtype
    from zaya_jax.train.program import build_program

    exp = load_experiment(EXPERIMENT, step_overrides(args.layers, args.seq_len, args.batch) + extra)
    program = build_program(exp, devices=jax.devices()[:1])
    compiled, phases = program.compile_train_step_phases()
    state, batch = program.init(), synthetic_batch(program)
    times = []
    for _ in range(2 + args.steps):
        t = time.perf_counter()
        state, metrics = jax.block_until_ready(compiled(state, batch))
        times.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory(prefix="zaya_profile_") as folder:  # a trace is tens of MiB
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(args.steps):
                state, metrics = jax.block_until_ready(compiled(state, batch))
        hlo = compiled.as_text()
        trace = sorted(glob.glob(os.path.join(folder, "plugins", "profile", "*", "perfetto_trace.json.gz")))[-1]
        rows, unmatched = tally(hlo, trace, args.steps)
        if args.keep_trace:
            os.makedirs(args.keep_trace, exist_ok=True)
            with open(os.path.join(folder, "step.hlo.txt"), "w", encoding="utf-8") as f:
                f.write(hlo)
            with tarfile.open(os.path.join(args.keep_trace, "step_trace.tar.gz"), "w:gz") as tar:
                tar.add(trace, arcname="perfetto_trace.json.gz")
                tar.add(os.path.join(folder, "step.hlo.txt"), arcname="step.hlo.txt")
    device, m, c = jax.devices()[0], exp.model, exp.config.train
    return {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "layers": args.layers, "seq_len": c.seq_len, "batch": c.global_batch_size, "micro_batches": c.grad_accum_steps,
            "model": {k: getattr(m, k) for k in MODEL_FIELDS},
            "kernels": program.kernels(), "remat": c.remat, "compile_phases_s": phases,
            "muon_ns_dtype": ns_dtype(exp.config.optim.muon_ns_dtype, program.target),
            "step_s": float(np.median(times[2:])), "loss": float(metrics["loss"]), "rows": rows,
            "unmatched_ms_per_step": unmatched}


# ---- the trace, matched to the HLO -----------------------------------------------------------
def kind_of(text: str, called: list) -> str:
    """The kind of op an instruction is (see the module docstring): the census's (`explore/step_census.py`;
    `called`: its fusion body's instructions), its `gemm` named `matmul` as the profiles the
    calibration reads name it."""
    from zaya_jax.explore import step_census

    kind = step_census.kind_of(text, called)
    return "matmul" if kind == "gemm" else kind


def part_of(text: str) -> str:
    """The census's model part, its Newton–Schulz counted in `optimizer` as the calibration reads it."""
    from zaya_jax.explore import step_census

    part = step_census.part_of(text)
    return "optimizer" if part == "newton-schulz" else part


def by_kernel_name(name: str) -> tuple[str, str] | None:
    """(part, kind) of a device kernel no HLO instruction names (one XLA launched inside a CUDA
    graph): read off the kernel's own name, the part unknown for library calls."""
    low = name.lower()
    if re.search(r"gemm|nvjet|cutlass|xmma|cublas", low):
        return "library call in a graph", "matmul (tf32)" if "tf32" in low else "matmul"
    if low.startswith("zaya_"):
        part = next((p for k, p in (("grouped_matmul", "experts"), ("rms_norm", "norms"), ("linear", "linear attention"),
                                    ("dkv", "attention"), ("dq", "attention"), ("forward", "attention")) if k in low), "other")
        return part + (" bwd" if re.search(r"bwd|dkv|dq|transposed", low) else ""), "kernel"
    if low.startswith(("memcpy", "memset")):
        return "no scope", "copy"
    return None


def tally(hlo: str, trace_path: str, steps: int) -> tuple[list[dict], float]:
    from zaya_jax.explore import step_census

    table = step_census.instructions(hlo)
    bodies = collections.defaultdict(list)
    for inst in table.values():
        bodies[inst.computation].append(inst)
    normal = {_normal(name): name for name in table}
    events = _device_events(trace_path)
    acc = collections.defaultdict(lambda: [0.0, 0, 0])
    unmatched = 0.0
    for name, args, dur_us in events:
        # A kernel inside a CUDA graph names its fusion; its hlo_op names only the command buffer.
        found = next((normal[_normal(k)] for k in (name, args.get("hlo_op", "")) if _normal(k) in normal), None)
        moved = 0
        if found is not None:
            inst = table[found]
            called = [i for c in re.findall(r"calls=%?([\w.\-]+)", inst.text) for i in bodies.get(c, [])]
            key = (part_of(inst.text), kind_of(inst.text, called))
            moved = step_census.moved_bytes(inst, called, table)  # the census's bytes, slices as moved
        else:
            key = by_kernel_name(name)
            if key is None:
                unmatched += dur_us
                continue
        row = acc[key]
        row[0] += dur_us
        row[1] += 1
        row[2] += moved
    total = sum(v[0] for v in acc.values()) or 1.0
    rows = [{"part": part, "kind": kind, "ms_per_step": round(v[0] / 1e3 / steps, 3), "share": round(v[0] / total, 4),
             "ops_per_step": v[1] // steps, "gb_per_step": round(v[2] / 1e9 / steps, 3)}
            for (part, kind), v in sorted(acc.items(), key=lambda kv: -kv[1][0])]
    return rows, round(unmatched / 1e3 / steps, 3)


def _device_events(trace_path: str) -> list[tuple[str, dict, float]]:
    """(name, args, µs) of every complete event on the device: a GPU's streams, or on CPU the
    threads that run XLA's ops."""
    with gzip.open(trace_path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {pid for pid, name in processes.items() if "/device:GPU" in name or "/device:ROCM" in name}
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        on_device = (e["pid"] in gpu and "XLA Ops" not in threads.get((e["pid"], e.get("tid")), "")) if gpu \
            else "Eigen" in threads.get((e["pid"], e.get("tid")), "")
        if on_device:
            out.append((e["name"], e.get("args", {}), float(e.get("dur", 0.0))))
    return out


def _normal(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def _markdown(r: dict) -> str:
    total = sum(x["ms_per_step"] for x in r["rows"])
    by_kind = collections.Counter()
    for x in r["rows"]:
        by_kind[x["kind"]] += x["ms_per_step"]
    lines = [f"# Where the step's device time goes on {r['device']} (jax {r['jax']})", "",
             f"`tools/gpu_check.py`'s step at {r['layers']} layers, {r['batch']} × {r['seq_len']} tokens, remat "
             f"{r['remat']}, kernels {r['kernels']}; measured step {r['step_s'] * 1e3:.1f} ms, device ops "
             f"{total:.1f} ms per step ({r['unmatched_ms_per_step']:.1f} ms of device events matched no HLO op).", "",
             "By kind: " + ", ".join(f"{k} {v:.1f} ms ({v / (total or 1):.0%})" for k, v in by_kind.most_common()), "",
             "| part | kind | ms / step | share | ops / step | GB read + written / step |",
             "|---|---|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {x['part']} | {x['kind']} | {x['ms_per_step']:.2f} | {x['share']:.1%} | {x['ops_per_step']} | "
                     f"{x['gb_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
