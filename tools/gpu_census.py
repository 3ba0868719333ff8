"""The GPU census of our own train step, without the GPU: what it launches, multiplies and moves, by model part.

    python tools/gpu_census.py [--gpu-target benchmarks/gpu_targets/h100_sxm.txtpb] [--layers 16]
        [--seq-len 4096] [--batch 4] [--micro-batches 1] [--calibrate benchmarks/gpu_h200.json]
        [--out benchmarks/gpu_census_h100.json] [--config.KEY=VALUE ...]

Compiles `tools/gpu_check.py`'s step (`experiments/zaya1_base_phase1.py` at ZAYA1-base width, bf16,
one device, the GPU's own kernels) with XLA's GPU compiler for the device a target config describes
(`explore/deviceless.py`: JAX's CUDA plugin, no GPU), GEMMs left to cuBLAS as after autotuning
(`--xla_gpu_enable_triton_gemm=false`), and reads its optimized HLO op by op (`explore/step_census.py`,
loops times their trip counts). Per model part (attention, experts, router, norms, loss, embedding,
the layer scan, the optimizer's update and its Newton–Schulz): kernel launches, GEMM TFLOP by dtype,
Pallas kernel TFLOP, non-GEMM GB (XLA's fusions and copies), and the kernels it calls; in total also
launches per layer, non-GEMM MB per token per layer and XLA's peak memory.

`--calibrate REPORT` (a `tools/gpu_check.py` report with a `profile` part, e.g. `benchmarks/gpu_h200.json`)
prices it: the profiled step's shape is compiled here too, and each time class (bf16 GEMMs, fp32
GEMMs, attention kernels, grouped-matmul kernels, memory-bound ops) gets the rate that step reached
(cuDNN's attention, which it did not run, the rate the report's kernel benchmark measured);
the asked step is then predicted at those rates, and so is every step the report timed (the check).

Every change to the step is compiled and counted here before a GPU times it. Bad input is one line
`gpu_census: error: ...` and exit status 2.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

# The step, its bad-input convention and the --out check are gpu_check's, whose step this counts.
from gpu_check import EXPERIMENT, UsageError, _Parser, check_writable, step_overrides  # noqa: E402
import gpu_dry_run  # noqa: E402  (the compile-only device of a target)
DEFAULT_TARGET = os.path.join(ROOT, "benchmarks", "gpu_targets", "h100_sxm.txtpb")
GIB = 1024 ** 3
# GEMMs to cuBLAS, as autotuning picks on the device for these shapes (the deviceless compile cannot autotune).
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def parse_args(argv):
    p = _Parser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--gpu-target", default=DEFAULT_TARGET, help="XLA GPU target config (default: an H100 SXM)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches the batch is taken in (default 1)")
    p.add_argument("--calibrate", metavar="REPORT", help="a tools/gpu_check.py report with a profiled step")
    p.add_argument("--out", help="write the census as JSON here, and Markdown beside it")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        raise UsageError(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = overrides
    for name in ("layers", "seq_len", "batch", "micro_batches"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.batch % args.micro_batches:
        raise UsageError(f"--batch {args.batch} must be a multiple of --micro-batches {args.micro_batches}")
    if args.calibrate:
        args.report = read_report(args.calibrate)
    if args.out:
        check_writable(os.path.dirname(os.path.abspath(args.out)), "--out")
    return args


def read_report(path: str) -> dict:
    """A gpu_check report with a profiled step (what --calibrate needs)."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except OSError as e:
        raise UsageError(f"--calibrate {path}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"--calibrate {path} is not JSON ({e})") from None
    profile = ((report.get("parts") or {}).get("profile") or {}) if isinstance(report, dict) else {}
    if not profile.get("rows") or not profile.get("layers"):
        raise UsageError(f"--calibrate {path} has no profiled step; pass a tools/gpu_check.py report whose "
                         "profile part ran (benchmarks/gpu_h200.json)")
    return report


def compile_census(devices, layers: int, seq_len: int, batch: int, micro_batches: int, overrides) -> dict:
    """The census of one step shape: its ops, XLA's peak bytes, and the compile's seconds."""
    from zaya_jax.explore import step_census
    from zaya_jax.explore.xla_terms import total_bytes
    from zaya_jax.kernels.registry import device_target
    from zaya_jax.train.program import program_for_target

    program = program_for_target(EXPERIMENT, step_overrides(layers, seq_len, batch, micro_batches) + list(overrides),
                                 device_target(devices[0]), devices)
    start = time.perf_counter()
    compiled, _ = program.compile_train_step_phases(COMPILER_OPTIONS)
    peak = total_bytes(compiled)
    return {"ops": step_census.census(compiled.as_text()), "peak_bytes": int(peak), "kernels": program.kernels(),
            "compile_s": round(time.perf_counter() - start, 1)}


def summary(census: dict, layers: int, tokens: int) -> dict:
    from zaya_jax.explore import step_census

    ops = census["ops"]
    total = step_census.totals(ops)
    return {"layers": layers, "tokens": tokens, "peak_gib": round(census["peak_bytes"] / GIB, 2),
            "kernels": census["kernels"], "total": total,
            "launches_per_layer": round(total["launches"] / layers, 1),
            "nongemm_mb_per_token_layer": round(total["nongemm_bytes"] / tokens / layers / 1e6, 3),
            "fp32_gemm_tflop_newton_schulz": round(sum(o.runs * o.flops for o in ops if o.part == "newton-schulz"
                                                       and o.kind == "gemm" and o.dtype == "f32") / 1e12, 2),
            "parts": step_census.by_part(ops)}


def calibration(devices, report: dict) -> dict:
    """Rates from the report's profiled step (compiled here at its shape) and, at those rates, the
    prediction of every step the report timed against its measured time."""
    from zaya_jax.explore import census_pricing

    prof = report["parts"]["profile"]
    shape = (prof["layers"], prof["seq_len"], prof["batch"], prof["micro_batches"])
    profiled = compile_census(devices, *shape, as_it_ran(prof))
    bench = (report["parts"].get("bench") or {}).get("rows") or []
    rates = census_pricing.fit_rates(profiled["ops"], prof["rows"], bench)
    checks = [{"layers": prof["layers"], "micro_batches": prof["micro_batches"], "measured_s": prof["step_s"],
               "predicted_s": sum(census_pricing.predict(profiled["ops"], rates).values()), "fitted": True}]
    step = report["parts"].get("step") or {}
    if step.get("step_s") and step.get("layers"):
        timed = compile_census(devices, step["layers"], step["seq_len"], step["batch"], step["micro_batches"],
                               as_it_ran(step))
        checks.append({"layers": step["layers"], "micro_batches": step["micro_batches"], "measured_s": step["step_s"],
                       "predicted_s": sum(census_pricing.predict(timed["ops"], rates).values()), "fitted": False})
    return {"device": report.get("device", {}).get("slug"), "jax": report.get("jax"), "rates": rates, "checks": checks}


def as_it_ran(part: dict) -> list[str]:
    """The overrides that make a report's step as it ran: its kernels, its remat and its
    Newton–Schulz dtype (fp32 in a report from before bf16 became the GPU default: it names none).
    Not the asked step's `--config` overrides: they describe the step to predict, not the one timed."""
    from zaya_jax.kernels.registry import KERNEL_FIELDS

    fields = {kernel: field for field, kernel in KERNEL_FIELDS.items()}
    out = [f"--config.model.{fields[k]}={v}" for k, v in (part.get("kernels") or {}).items() if k in fields]
    if part.get("remat"):
        out.append(f"--config.train.remat={part['remat']}")
    return [*out, f"--config.optim.muon_ns_dtype={part.get('muon_ns_dtype', 'float32')}"]


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        devices = gpu_dry_run.devices(args.gpu_target)
    except UsageError as e:
        return fail(str(e))
    except Exception as e:  # noqa: BLE001 - ZayaError (a bad target, no plugin): one line
        return fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    import jax
    from zaya_jax.errors import ZayaError
    from zaya_jax.explore import census_pricing

    try:
        census = compile_census(devices, args.layers, args.seq_len, args.batch, args.micro_batches, args.overrides)
        cal = calibration(devices, args.report) if args.calibrate else None
    except ZayaError as e:
        return fail(str(e))
    result = {"tool": "tools/gpu_census.py", "jax": jax.__version__, "device": devices[0].device_kind,
              "gpu_target": os.path.relpath(args.gpu_target, ROOT), "seq_len": args.seq_len, "batch": args.batch,
              "micro_batches": args.micro_batches, "overrides": args.overrides, "compile_s": census["compile_s"],
              **summary(census, args.layers, args.batch * args.seq_len)}
    if cal:
        result["calibration"] = {**cal, "source": args.calibrate}
        result["predicted_s"] = census_pricing.predict(census["ops"], cal["rates"])
    markdown = to_markdown(result)
    print(markdown)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        with open(os.path.splitext(args.out)[0] + ".md", "w", encoding="utf-8") as f:
            f.write(markdown)
    return 0


def fail(message: str) -> int:
    print(f"gpu_census: error: {message}", file=sys.stderr)
    return 2


def _tf(x: float) -> str:
    return f"{x / 1e12:.2f}" if x else "–"


def to_markdown(r: dict) -> str:
    t = r["total"]
    gemm = ", ".join(f"{dtype} {flops / 1e12:.1f}" for dtype, flops in sorted(t["gemm_flops"].items()))
    lines = [f"# GPU census: {r['layers']} layers, {r['batch']} × {r['seq_len']} tokens in {r['micro_batches']} "
             f"micro-batch(es), compiled for {r['device']} without it (jax {r['jax']})", "",
             f"`python tools/gpu_census.py --layers {r['layers']} --seq-len {r['seq_len']} --batch {r['batch']} "
             f"--micro-batches {r['micro_batches']}{''.join(' ' + o for o in r['overrides'])}`; kernels {r['kernels']}.", "",
             f"- kernel launches per step **{t['launches']:,}**, per layer **{r['launches_per_layer']:.0f}**",
             f"- non-GEMM traffic {t['nongemm_bytes'] / 1e9:.0f} GB per step, **{r['nongemm_mb_per_token_layer']:.2f} MB "
             f"per token per layer** (Pallas kernels' own {t['kernel_bytes'] / 1e9:.0f} GB aside)",
             f"- GEMM TFLOP by dtype: {gemm}; Pallas kernels {t['kernel_flops'] / 1e12:.1f}; fp32 GEMMs in "
             f"Newton–Schulz **{r['fp32_gemm_tflop_newton_schulz']:.1f}** TFLOP",
             f"- peak memory (XLA) **{r['peak_gib']:.1f} GiB**"]
    if "predicted_s" in r:
        cal = r["calibration"]
        pred = r["predicted_s"]
        lines += [f"- predicted **{sum(pred.values()) * 1e3:.0f} ms** per step at the rates of {cal['source']} "
                  f"({cal['device']}): " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sorted(pred.items(),
                                                                                              key=lambda kv: -kv[1])),
                  "", "Rates fitted to the profiled step: " + ", ".join(
                      f"{k} {v / (1e9 if k == 'memory' else 1e12):.0f} {'GB' if k == 'memory' else 'TFLOP'}/s"
                      for k, v in sorted(cal["rates"].items())), "",
                  "| measured step on " + str(cal["device"]) + " | measured ms | predicted ms | ratio |", "|---|---:|---:|---:|"]
        for c in cal["checks"]:
            tag = " (the fit's own)" if c["fitted"] else ""
            lines.append(f"| {c['layers']} layers, {c['micro_batches']} micro-batches{tag} | {c['measured_s'] * 1e3:.0f} | "
                         f"{c['predicted_s'] * 1e3:.0f} | {c['predicted_s'] / c['measured_s']:.2f} |")
    lines += ["", "| part | launches | per layer | GEMM TFLOP bf16 | GEMM TFLOP fp32 | kernel TFLOP | non-GEMM GB | kernels |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for part, p in r["parts"].items():
        kernels = ", ".join(f"{k} ×{n}" for k, n in sorted(p["kernels"].items()))
        lines.append(f"| {part} | {p['launches']:,} | {p['launches'] / r['layers']:.1f} | {_tf(p['gemm_flops'].get('bf16', 0))} | "
                     f"{_tf(p['gemm_flops'].get('f32', 0))} | {_tf(p['kernel_flops'])} | {p['nongemm_bytes'] / 1e9:.1f} | "
                     f"{kernels} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
