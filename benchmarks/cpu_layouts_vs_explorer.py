"""The explorer's step times against measured steps on this CPU, every 2-device layout side by side.

With one XLA device per core (`train.cpu_devices=2`, as `zaya train` runs `tiny_cpu`), for each
layout with one axis of 2 (data, fsdp, expert, tsp, tensor, sequence) of `tiny_cpu` and of a larger
CPU shape: the train step is compiled and timed (median of `--steps` after warm-up, on a fixed
random batch), and the explorer predicts it for a `cpu` profile measured on this host in the same
run (`zaya bench host` with both devices at once: matmul TFLOP/s by size, elementwise and memory
GB/s; `zaya bench collectives` over the 2 devices for the links), plus, with `--calibrate FILE`, a CPU report of
`tools/gpu_check.py` for the kernels' shares and the step residual. Each shape's layouts are
timed in round-robin rounds (the fastest median kept), so a slow spell of the host does not land
on one layout. Prints a table (measured, predicted, ratio per layout) with the rank correlation of
the two columns and the pairs of layouts more than 15% apart that the prediction orders right, and
writes JSON and Markdown.

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
    # Nothing of the model was measured on these: linear layers, full remat, longer sequences
    "hybrid LC, remat full, 8 x 256 tokens": ["--config.model.layer_pattern=LC", "--config.train.remat=full",
                                              "--config.train.seq_len=256", "--config.train.global_batch_size=8"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON path; the Markdown table goes beside it")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (the median is kept)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the layouts (the fastest median is kept)")
    p.add_argument("--calibrate", help="a CPU report of tools/gpu_check.py for the kernels and the residual")
    p.add_argument("--repredict", metavar="JSON", help="time nothing: this file's measured steps (and the host and "
                   "collectives it measured) against the current model's predictions, written to --out")
    args = p.parse_args(argv)
    if args.repredict:
        return _repredict(args)

    from zaya_jax import cpu_host

    cpu_host.prepare(2)  # before JAX starts: one device per core, as zaya train runs tiny_cpu
    import jax

    from zaya_jax.bench import host
    from zaya_jax.bench.collectives import measure as measure_collectives
    from zaya_jax.parallel.mesh import build_mesh

    devices = jax.devices()[:2]
    host_record = host.measure(devices)
    records = list(measure_collectives(build_mesh(dict.fromkeys(AXES, 1) | {"data": 2}, devices), lambda d: 0,
                                       ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute"),
                                       [4 * 1024, 64 * 1024, 1024 ** 2, 16 * 1024 ** 2], 10, 2))
    curves = _curves(records)
    rows = []
    for shape, overrides in SHAPES.items():
        prepared = {axis: _prepare(overrides, axis, devices) for axis in AXES}
        times = {axis: [] for axis in AXES}
        for _ in range(args.rounds):  # round-robin: a slow spell of the host lands on every layout alike
            for axis in AXES:
                times[axis].append(_time(prepared[axis], args.steps))
        for axis in AXES:
            rows.append(_row(shape, axis, prepared[axis], min(times[axis]), host_record, curves, args))
            print(_line(rows[-1]), flush=True)
        del prepared
    result = {"tool": "benchmarks/cpu_layouts_vs_explorer.py", "host": host_record, "machine": platform.processor()
              or platform.machine(), "jax": jax.__version__, "steps": args.steps, "rounds": args.rounds, "calibrate": args.calibrate,
              "collectives": records, "rows": rows}
    return _write(result, args.out)


def _repredict(args) -> int:
    """The measurements of an earlier run, predicted again (the host and its collectives as measured then)."""
    from zaya_jax.experiment import load_experiment

    with open(args.repredict) as f:
        result = json.load(f)
    curves = _curves(result["collectives"])
    for i, old in enumerate(result["rows"]):
        axis = old["layout"].split()[0]
        mesh = [f"--config.mesh.{a}={2 if a == axis else 1}" for a in AXES]
        exp = load_experiment(CONFIG, SHAPES[old["shape"]] + mesh + ["--config.train.cpu_devices=2"])
        p = {"exp": exp, "compile_s": old["compile_s"]}
        result["rows"][i] = _row(old["shape"], axis, p, old["measured_s"], result["host"], curves, args)
        print(_line(result["rows"][i]), flush=True)
    result["repredicted_from"] = args.repredict
    return _write(result, args.out)


def _write(result: dict, out: str) -> int:
    rows = result["rows"]
    result["rank_correlation"] = {shape: spearman([r["measured_s"] for r in rows if r["shape"] == shape],
                                                  [r["predicted_s"] for r in rows if r["shape"] == shape])
                                  for shape in SHAPES}
    result["ordered_pairs"] = {shape: ordered_pairs([r for r in rows if r["shape"] == shape]) for shape in SHAPES}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    md = os.path.splitext(out)[0] + ".md"
    with open(md, "w") as f:
        f.write(markdown(result))
    print(f"wrote {out} and {md}")
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


def _prepare(overrides, axis, devices) -> dict:
    """The layout's compiled step, its state and a fixed random batch, warmed up."""
    import jax
    import numpy as np

    from zaya_jax.experiment import load_experiment
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
    return {"exp": exp, "compiled": compiled, "state": state, "batch": batch, "compile_s": compile_s}


def _time(p: dict, steps: int) -> float:
    """Median seconds of `steps` train steps."""
    import jax

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        p["state"], metrics = p["compiled"](p["state"], p["batch"])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(shape, axis, p, measured, host_record, curves, args) -> dict:
    from zaya_jax import hardware
    from zaya_jax.explore import step_time
    from zaya_jax.explore.collectives import Network
    from zaya_jax.explore.workload import Workload

    exp = p["exp"]
    hw = hardware.measured_from(hardware.profile("cpu"), host_record, exp.model.compute_dtype)
    run = Workload.from_experiment(exp, hw, 1, 2)
    if args.calibrate:
        from zaya_jax.explore.calibration import calibrate

        run, _ = calibrate(run, args.calibrate)
    sizes = dict.fromkeys(AXES, 1) | {axis: 2}
    predicted = step_time.predict(run, sizes, Network(hw, curves))
    return {"shape": shape, "layout": f"{axis} 2", "measured_s": measured, "predicted_s": predicted.step_time_s,
            "ratio": predicted.step_time_s / measured, "compute_s": predicted.compute_s,
            "elementwise_s": predicted.elementwise_s, "exposed_comm_s": sum(predicted.exposed_comm_s.values()),
            "optimizer_s": predicted.optimizer_s, "compile_s": round(p["compile_s"], 1)}


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


def _rate_at(host: dict, flops: float) -> float:
    return next(rate for f, rate in host["matmul_curve"]["float32"] if f == flops)


def ordered_pairs(rows: list[dict], apart: float = 1.15) -> list[int]:
    """[pairs of layouts whose measured times differ by more than `apart`, of which the prediction
    orders right]."""
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]
             if max(a["measured_s"], b["measured_s"]) > apart * min(a["measured_s"], b["measured_s"])]
    right = sum((a["measured_s"] < b["measured_s"]) == (a["predicted_s"] < b["predicted_s"]) for a, b in pairs)
    return [len(pairs), right]


def _line(r: dict) -> str:
    return (f"{r['shape'][:40]:40s} {r['layout']:12s} measured {r['measured_s'] * 1e3:8.1f} ms  predicted "
            f"{r['predicted_s'] * 1e3:8.1f} ms  ratio {r['ratio']:.2f}")


def markdown(result: dict) -> str:
    h = result["host"]
    lines = ["# The explorer's step times against measured steps on this CPU (2 devices, one per core)",
             "", "The model's two measured constants (`step_time.ELEMENTWISE_PASSES`, `IN_STEP_MATMUL_SHARE`) come from "
             "profiling `tiny_cpu` under data 2; no step total here was used to fit anything.",
             "", f"Host ({result['machine']}, jax {result['jax']}): matmul {h['matmul_tflops']['float32']:.3g} TFLOP/s "
             f"float32 per device (a 256-wide one {_rate_at(h, 2 * 256 ** 3):.3g}), elementwise "
             f"{h['elementwise_gb_per_s']:.3g} GB/s, memory {h['memory_gb_per_s']:.3g} GB/s (zaya bench host, both devices at "
             f"once); links from zaya bench "
             f"collectives over the 2 devices" + (f"; calibrated with {result['calibrate']}" if result["calibrate"] else "")
             + f". Each layout: the fastest of {result.get('rounds', 1)} round-robin rounds' median of {result['steps']} steps."
             + (" The predictions were made again (`--repredict`) by a later model from these measurements."
                if result.get("repredicted_from") else ""), "",
             "| shape | layout | measured ms | predicted ms | predicted / measured |", "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['shape']} | {r['layout']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['ratio']:.2f} |")
    ratios = [r["ratio"] for r in result["rows"]]
    lines += ["", f"Predicted / measured {min(ratios):.2f} – {max(ratios):.2f}; within 25%: "
              f"{sum(abs(x - 1) <= 0.25 for x in ratios)} of {len(ratios)}.", "",
              "Rank correlation (Spearman) of predicted and measured, per shape: " + ", ".join(
                  f"{shape} {rho:.2f}" for shape, rho in result["rank_correlation"].items()) + ".", "",
              "Pairs of layouts more than 15% apart in measured time, ordered right by the prediction: " + ", ".join(
                  f"{shape} {right} of {n}" for shape, (n, right) in result["ordered_pairs"].items()) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
