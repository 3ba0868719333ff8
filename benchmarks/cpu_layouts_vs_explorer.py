"""The explorer's step times against measured steps on this CPU, every 2-device layout side by side.

With one XLA device per core (`train.cpu_devices=2`, as `zaya train` runs `tiny_cpu`), for each
layout with one axis of 2 (data, fsdp, expert, tsp, tensor, sequence) of `tiny_cpu` and of a larger
CPU shape: the train step is compiled and timed (median of `--steps` after warm-up, on a fixed
random batch), and the explorer predicts it for a `cpu` profile measured on this host in the same
run (`zaya bench host`: matmul TFLOP/s and memory GB/s on one device; `zaya bench collectives`
over the 2 devices for the links), plus, with `--calibrate FILE`, a CPU report of
`tools/gpu_check.py` for the kernels' shares and the step residual. Prints a table (measured,
predicted, ratio per layout) with the rank correlation of the two columns, and writes JSON and
Markdown.

    python benchmarks/cpu_layouts_vs_explorer.py --out=benchmarks/cpu_layouts_vs_explorer.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "experiments", "tiny_cpu.py")
AXES = ("data", "fsdp", "expert", "tsp", "tensor", "sequence")
SHAPES = {
    "tiny_cpu": [],
    "wider (hidden 256, 8 experts, 4 layers)": ["--config.model.hidden_size=256", "--config.model.num_experts=8",
                                                "--config.model.moe_intermediate_size=256",
                                                "--config.model.num_attention_heads=8"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON path; the Markdown table goes beside it")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--calibrate", help="a CPU report of tools/gpu_check.py for the kernels and the residual")
    args = p.parse_args(argv)

    from zaya_jax import cpu_host

    cpu_host.prepare(2)  # before JAX starts: one device per core, as zaya train runs tiny_cpu
    import jax

    from zaya_jax.bench import host
    from zaya_jax.bench.collectives import measure as measure_collectives
    from zaya_jax.parallel.mesh import build_mesh

    devices = jax.devices()[:2]
    host_record = host.measure(devices[0])
    records = list(measure_collectives(build_mesh(dict.fromkeys(AXES, 1) | {"data": 2}, devices), lambda d: 0,
                                       ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute"),
                                       [4 * 1024, 64 * 1024, 1024 ** 2, 16 * 1024 ** 2], 10, 2))
    curves = _curves(records)
    rows = []
    for shape, overrides in SHAPES.items():
        for axis in AXES:
            rows.append(_one(shape, overrides, axis, devices, host_record, curves, args))
            print(_line(rows[-1]), flush=True)
    result = {"tool": "benchmarks/cpu_layouts_vs_explorer.py", "host": host_record, "machine": platform.processor()
              or platform.machine(), "jax": jax.__version__, "steps": args.steps, "calibrate": args.calibrate,
              "collectives": records, "rows": rows, "rank_correlation": {
                  shape: spearman([r["measured_s"] for r in rows if r["shape"] == shape],
                                  [r["predicted_s"] for r in rows if r["shape"] == shape]) for shape in SHAPES}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(markdown(result))
    print(f"wrote {args.out} and {md}")
    return 0


def _curves(records):
    from zaya_jax.explore.collectives import Curves

    points: dict = {}
    for r in records:
        points.setdefault((r["tier"], r["op"]), {}).setdefault(int(r["group"]), []).append(
            (float(r["bytes"]), float(r["busbw_gb_per_s"])))
    for by_group in points.values():
        for pts in by_group.values():
            pts.sort()
    return Curves(points)


def _one(shape, overrides, axis, devices, host_record, curves, args) -> dict:
    import jax
    import numpy as np

    from zaya_jax import hardware
    from zaya_jax.explore.collectives import Network
    from zaya_jax.experiment import load_experiment
    from zaya_jax.explore import step_time
    from zaya_jax.explore.workload import Workload
    from zaya_jax.train.program import build_program

    mesh = [f"--config.mesh.{a}={2 if a == axis else 1}" for a in AXES]
    exp = load_experiment(CONFIG, overrides + mesh + ["--config.train.cpu_devices=2"])
    program = build_program(exp, devices)
    state = program.init()
    compiled, compile_s = program.compile_train_step()
    c = exp.config.train
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, exp.model.vocab_size, (c.global_batch_size, c.seq_len + 1)).astype(np.int32)
    batch = program.place_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                                 "segment_ids": np.ones((c.global_batch_size, c.seq_len), np.int32),
                                 "positions": np.broadcast_to(np.arange(c.seq_len, dtype=np.int32),
                                                              (c.global_batch_size, c.seq_len)).copy(),
                                 "loss_mask": np.ones((c.global_batch_size, c.seq_len), np.float32)})
    for _ in range(3):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    hw = hardware.measured_from(hardware.profile("cpu"), host_record, exp.model.compute_dtype)
    run = Workload.from_experiment(exp, hw, 1, 2)
    if args.calibrate:
        from zaya_jax.explore.calibration import calibrate

        run, _ = calibrate(run, args.calibrate)
    sizes = dict.fromkeys(AXES, 1) | {axis: 2}
    predicted = step_time.predict(run, sizes, Network(hw, curves))
    measured = statistics.median(times)
    return {"shape": shape, "layout": f"{axis} 2", "measured_s": measured, "predicted_s": predicted.step_time_s,
            "ratio": predicted.step_time_s / measured, "compute_s": predicted.compute_s,
            "exposed_comm_s": sum(predicted.exposed_comm_s.values()), "optimizer_s": predicted.optimizer_s,
            "compile_s": round(compile_s, 1)}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def _line(r: dict) -> str:
    return (f"{r['shape'][:40]:40s} {r['layout']:12s} measured {r['measured_s'] * 1e3:8.1f} ms  predicted "
            f"{r['predicted_s'] * 1e3:8.1f} ms  ratio {r['ratio']:.2f}")


def markdown(result: dict) -> str:
    h = result["host"]
    lines = ["# The explorer's step times against measured steps on this CPU (2 devices, one per core)",
             "", f"Host ({result['machine']}, jax {result['jax']}): matmul {h['matmul_tflops']['float32']:.3g} TFLOP/s "
             f"float32 per device, memory {h['memory_gb_per_s']:.3g} GB/s (zaya bench host); links from zaya bench "
             f"collectives over the 2 devices" + (f"; calibrated with {result['calibrate']}" if result["calibrate"] else "")
             + f". Median of {result['steps']} steps.", "",
             "| shape | layout | measured ms | predicted ms | predicted / measured |", "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['shape']} | {r['layout']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['ratio']:.2f} |")
    lines += ["", "Rank correlation (Spearman) of predicted and measured, per shape: " + ", ".join(
        f"{shape} {rho:.2f}" for shape, rho in result["rank_correlation"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
