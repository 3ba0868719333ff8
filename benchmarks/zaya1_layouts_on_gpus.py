"""The ZAYA1-base step on one node of GPUs this machine does not have: XLA's bytes per device against the explorer's.

For `--hardware` (an 8-GPU node of it, compiled for through `--gpu-target`, deviceless: no GPU,
nothing run), the explorer ranks every layout of the ZAYA1-base phase-1 experiment
(`experiments/zaya1_base_phase1.py`: 40 layers at full width, bf16, remat `full`, 4 micro-batches)
at `--global-batch` sequences, and the `--top` best that fit are compiled with the run's own GPU
kernels. Then the same model with a hybrid layer pattern (`--hybrid`, linear attention in place
of CCA in three of four layers) under the best layout with a `sequence` split, where its linear
layers run LASP-2 and its CCA layers LASP-2H. Each compile's buffers at the step's peak are
attributed to the explorer's terms (`explore/xla_terms.py`, as `zaya mesh --validate --terms`
prints them). Prints one row per layout and writes JSON and Markdown (rewritten after each).

    python benchmarks/zaya1_layouts_on_gpus.py --hardware mi300x --gpu-target benchmarks/gpu_targets/mi300x.txtpb \\
        --out benchmarks/zaya1_layouts_mi300x            # python tools/rocm_compile_setup.py first
    python benchmarks/zaya1_layouts_on_gpus.py --hardware h100 --gpu-target benchmarks/gpu_targets/h100_sxm.txtpb \\
        --out benchmarks/zaya1_layouts_h100              # JAX's CUDA plugin beside this jax

`--layers N` compiles a shallower model (a quick check of the tool).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
EXPERIMENT = os.path.join(ROOT, "experiments", "zaya1_base_phase1.py")
GIB = 2 ** 30
GPUS = 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", required=True, help="the explorer's hardware profile: mi300x, h100, ...")
    p.add_argument("--gpu-target", required=True, help="XLA GPU target config of that device")
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step (default 32: 4 a device)")
    p.add_argument("--top", type=int, default=3, help="best layouts of ZAYA1-base to compile (default 3)")
    p.add_argument("--hybrid", default="LLLC", help="the hybrid's layer pattern (default LLLC); '' for none")
    p.add_argument("--layers", type=int, help="layers (default: the experiment's 40)")
    p.add_argument("--out", required=True, help="report path without extension (.json and .md are written)")
    return p.parse_args(argv)


def cases(args) -> list[tuple[str, list[str], str]]:
    """(model, overrides, which layouts) for each model the report compiles."""
    common = [f"--config.train.global_batch_size={args.global_batch}"]
    if args.layers:
        common.append(f"--config.model.num_hidden_layers={args.layers}")
    out = [("ZAYA1-base", common, "best")]
    if args.hybrid:
        out.append((f"hybrid {args.hybrid}", common + [f"--config.model.layer_pattern={args.hybrid}",
                                                     "--config.model.linear_decay=retention"], "best with sequence"))
    return out


def chosen(predictions, which: str, top: int):
    fitting = [p for p in predictions if p.fits]
    if which == "best":
        return [(i + 1, p) for i, p in enumerate(fitting[:top])]
    ranked = [(i + 1, p) for i, p in enumerate(fitting) if p.layout.get("sequence", 1) > 1]
    return ranked[:1]


def row(model, rank, prediction, xla, hw) -> dict:
    from zaya_jax.explore.memory import by_term
    from zaya_jax.explore.placement import describe

    out = {"model": model, "layout": describe(prediction.layout), "rank": rank, "hardware": hw,
           "predicted_bytes": round(prediction.memory.total_bytes), "predicted_step_s": prediction.time.step_time_s,
           "predicted_terms": {k: round(v) for k, v in by_term(prediction.memory).items()}, "xla": xla}
    if "error" not in xla:
        total = xla["argument_bytes"] + xla["temp_bytes"]
        out["xla_total_bytes"] = total
        out["xla_over_predicted"] = round(total / prediction.memory.total_bytes, 3)
    return out


def markdown(rows, args, device_kind, seconds) -> str:
    import jax

    lines = [f"# The ZAYA1-base step on 8 {device_kind}, compiled here: XLA's bytes against the explorer's",
             "",
             f"{datetime.date.today()}, jax {jax.__version__}, {platform.machine()} host; deviceless: XLA's GPU compiler "
             f"for `{args.gpu_target}`, the run's own kernels, nothing run ({seconds:.0f} s in all). "
             f"`experiments/zaya1_base_phase1.py` at {args.global_batch} sequences of 4,096 tokens a step"
             f"{f', {args.layers} layers' if args.layers else ''}; predicted for `{args.hardware}`. The hybrid "
             f"is the same model with layer pattern `{args.hybrid}` (retention decay): its linear layers run "
             "LASP-2 over the sequence split, its CCA layers LASP-2H.",
             "",
             f"    python benchmarks/zaya1_layouts_on_gpus.py --hardware {args.hardware} --gpu-target {args.gpu_target} "
             f"--out {args.out}",
             "",
             "| model | explorer's rank | layout | predicted GiB | XLA arguments + temporaries, GiB | XLA / predicted "
             "| compile s |",
             "|---|---:|---|---:|---|---:|---:|"]
    for r in rows:
        x = r["xla"]
        cells = ("not compiled: " + x["error"], "", "") if "error" in x else (
            f"{x['argument_bytes'] / GIB:.2f} + {x['temp_bytes'] / GIB:.2f} = {r['xla_total_bytes'] / GIB:.2f}",
            f"{r['xla_over_predicted']:.3f}", f"{x['compile_s']:.0f}")
        lines.append(f"| {r['model']} | {r['rank']} | {r['layout']} | {r['predicted_bytes'] / GIB:.2f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "By term (GiB per device, predicted / XLA's buffers at the step's peak):", ""]
    terms = [t for t in rows[0]["predicted_terms"]
             if any(r["predicted_terms"].get(t) or r["xla"].get("terms", {}).get(t) for r in rows)]
    lines += ["| model | layout | " + " | ".join(terms) + " |", "|---|---|" + "---:|" * len(terms)]
    for r in rows:
        got = r["xla"].get("terms", {})
        lines.append(f"| {r['model']} | {r['layout']} | " + " | ".join(
            f"{r['predicted_terms'].get(t, 0) / GIB:.2f} / {got.get(t, 0) / GIB:.2f}" for t in terms) + " |")
    kernels = {json.dumps(r["xla"].get("kernels"), sort_keys=True) for r in rows if "kernels" in r["xla"]}
    lines += ["", "Kernels compiled: " + "; ".join(sorted(kernels))]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from zaya_jax import hardware
    from zaya_jax.experiment import load_experiment
    from zaya_jax.explore import deviceless
    from zaya_jax.explore.against_xla import compile_layout, compiled_overrides
    from zaya_jax.explore.explorer import explore
    from zaya_jax.explore.workload import Workload

    start = time.perf_counter()
    deviceless.use_cpu_host()
    devices = deviceless.gpu_devices(deviceless.read_target(args.gpu_target), 1, GPUS, args.gpu_target)
    hw = hardware.profile(args.hardware)
    rows = []
    for model, overrides, which in cases(args):
        exp = load_experiment(EXPERIMENT, compiled_overrides(overrides, on_cpu=False))
        predictions = explore(Workload.from_experiment(exp, hw, 1, GPUS))
        for rank, p in chosen(predictions, which, args.top):
            t0 = time.perf_counter()
            xla = compile_layout(EXPERIMENT, overrides, p.layout, devices, terms=True)
            rows.append(row(model, rank, p, xla, args.hardware))
            r = rows[-1]
            print(f"{model:14s} #{rank:<3d} {r['layout']:28s} predicted {p.memory.total_bytes / GIB:7.2f} GiB  "
                  + (f"XLA {r['xla_total_bytes'] / GIB:7.2f} GiB  {r['xla_over_predicted']:.3f}" if "error" not in xla
                     else f"not compiled: {xla['error']}") + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            with open(args.out + ".json", "w") as f:
                json.dump({"device_kind": devices[0].device_kind, "gpu_target": args.gpu_target, "rows": rows}, f,
                          indent=1)
            with open(args.out + ".md", "w") as f:
                f.write(markdown(rows, args, devices[0].device_kind, time.perf_counter() - start))
    print(f"wrote {args.out}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
