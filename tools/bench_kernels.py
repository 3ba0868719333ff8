"""Time the hot-path kernels against XLA (and cuDNN on NVIDIA) at ZAYA1 shapes; print and save a table.

For each kernel and backend it times the forward and forward+backward (jit, median of --iters
runs after a warm-up), and reports TFLOP/s, GB/s, the fraction of the device's peak (from
`zaya_jax.hardware.PROFILES`) and the time ratio against the baseline measured in the same run:

* attention (B 4 × S 4096 = 16K tokens, nq 8, nk 2, d 128, bf16, causal): pallas vs xla and, on
  NVIDIA, vs cudnn; all again with packed documents (segment ids; cuDNN's as a mask);
* grouped matmul (16K tokens routed top-1 over 16 experts, hidden 2048 → expert width 2048,
  bf16): pallas vs xla's ragged_dot, the vendor's grouped GEMM (`cudnn` on NVIDIA, `hipblaslt`
  on AMD) where `--platform` names the GPU, and one dense [16K, 2048] × [2048, 2048] matmul with
  the same FLOPs;
* RMSNorm (16K × 2048, fp32 in, bf16 out): pallas vs xla;
* Muon's Newton–Schulz (one pass of 64 [2048 × 2048] expert matrices, five iterations): its
  products in bfloat16 (the GPU default) vs float32 (TF32 on NVIDIA); forward only, it has no backward.

The vendor grouped GEMM is picked by XLA flags read once, when JAX starts (`registry.XLA_FLAGS`),
so it is timed only where `--platform cuda|rocm` (or JAX_PLATFORMS) says the GPU before the
start; they hold for the whole run: on AMD they put every GEMM of it on hipBLASLt, the dense
baseline's and Newton–Schulz's included, as a `hipblaslt` training run would.

Absolute times mean something only on a GPU. On CPU the Pallas kernels run in the interpreter;
use `--size small` there to check the tool end to end. A backend that fails to compile is
reported with its error instead of stopping the run.

    python tools/bench_kernels.py [--size zaya1|small] [--iters 20] [--platform cuda|rocm|cpu] [--out benchmarks]
    python tools/bench_kernels.py --gpu-target benchmarks/gpu_targets/mi300x.txtpb   # compile every case, run none

`--gpu-target FILE` is the dry run (`tools/gpu_dry_run.py`): every case compiled, forward and
forward+backward, for the GPU an XLA target config describes, on this machine without it, the
vendor grouped GEMM with its flags; `kernels_<size>_<device>_compiled.json` says what compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp

SIZES = {
    "zaya1": dict(batch=4, seq=4096, nq=8, nk=2, head_dim=128, tokens=16384, experts=16, hidden=2048,
                  width=2048, matrices=64),
    "small": dict(batch=1, seq=128, nq=8, nk=2, head_dim=128, tokens=256, experts=16, hidden=128, width=128,
                  matrices=4),
}


def _platform_from_env() -> str | None:
    named = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    return named if named in ("cuda", "rocm", "cpu") else None


@dataclasses.dataclass
class Case:
    kernel: str
    variant: str
    backend: str
    fn: Callable
    args: tuple
    diff_argnums: tuple
    fwd_flops: float
    fwd_bytes: float
    bwd_factor: float  # backward FLOPs / forward FLOPs
    baseline: str  # backend whose time this row's ratio divides
    backward: bool = True  # also time forward+backward


def attention_cases(s: dict) -> list[Case]:
    from zaya_jax import kernels
    from zaya_jax.kernels.registry import gpu_vendor

    b, n, nq, nk, d = s["batch"], s["seq"], s["nq"], s["nk"], s["head_dim"]
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (b, n, nq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, n, nk, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, n, nk, d), jnp.bfloat16)
    # Documents of ~1K tokens, as a packed pretraining batch would have.
    segments = jnp.cumsum(jax.random.bernoulli(keys[3], 1 / 1024, (b, n)), axis=1).astype(jnp.int32)
    flops = 4 * b * n * n * nq * d / 2  # QKᵀ and PV, causal half
    nbytes = 2 * b * n * d * (2 * nq + 2 * nk)  # read q, k, v; write o
    backends = ["xla", "pallas"] + (["cudnn"] if gpu_vendor() == "cuda" else [])
    cases = []
    for variant, seg, names in (("causal", None, backends), ("causal+documents", segments, backends)):
        baseline = "cudnn" if "cudnn" in names else "xla"
        for backend in names:
            def fn(q, k, v, seg=seg, backend=backend):
                return kernels.flash_attention(q, k, v, segment_ids=seg, backend=backend)
            cases.append(Case("attention", variant, backend, fn, (q, k, v), (0, 1, 2), flops, nbytes, 2.5, baseline))
    return cases


def grouped_matmul_cases(s: dict) -> list[Case]:
    from zaya_jax import kernels

    m, h, w, e = s["tokens"], s["hidden"], s["width"], s["experts"]
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    lhs = jax.random.normal(keys[0], (m, h), jnp.bfloat16)
    rhs = jax.random.normal(keys[1], (e, h, w), jnp.bfloat16) * h ** -0.5
    choice = jax.random.randint(keys[2], (m,), 0, e)  # top-1 routing, roughly balanced
    sizes = jnp.bincount(choice, length=e).astype(jnp.int32)
    flops = 2 * m * h * w
    nbytes = 2 * (m * h + e * h * w + m * w)
    cases = []
    # `tiled` is the CPU's default experts backend: timed there, so a CPU report calibrates it too.
    from zaya_jax.kernels.registry import platform

    backends = ("xla", "pallas") + (("tiled",) if platform() == "cpu" else ())
    for backend in backends + vendor_gemm():
        def fn(lhs, rhs, backend=backend):
            return kernels.grouped_matmul(lhs, rhs, sizes, backend=backend)
        cases.append(Case("grouped_matmul", "top-1, 16 experts", backend, fn, (lhs, rhs), (0, 1), flops, nbytes, 2.0,
                          "dense"))
    dense = rhs[0]
    cases.append(Case("grouped_matmul", "top-1, 16 experts", "dense", lambda lhs, rhs: lhs @ rhs, (lhs, dense),
                      (0, 1), flops, 2 * (m * h + h * w + m * w), 2.0, "dense"))
    return cases


def vendor_gemm() -> tuple[str, ...]:
    """The target's vendor grouped matmul backend, where its XLA flags were set before JAX started."""
    from zaya_jax.errors import ZayaError
    from zaya_jax.kernels import xla_flags
    from zaya_jax.kernels.registry import gpu_vendor, vendor_backend

    backend = vendor_backend("grouped_matmul", gpu_vendor())
    try:
        return (backend,) if backend and xla_flags.require({"moe_kernel": backend}) else ()
    except ZayaError:  # JAX started without them (no --platform): XLA would not read them now
        return ()


def rms_norm_cases(s: dict) -> list[Case]:
    from zaya_jax import kernels

    rows, width = s["tokens"], s["hidden"]
    x = jax.random.normal(jax.random.PRNGKey(2), (rows, width), jnp.float32)
    weight = jnp.ones((width,), jnp.float32)
    cases = []
    for backend in ("xla", "pallas"):
        def fn(x, weight, backend=backend):
            return kernels.rms_norm(x, weight, eps=1e-5, out_dtype=jnp.bfloat16, backend=backend)
        cases.append(Case("rms_norm", "fp32 → bf16", backend, fn, (x, weight), (0, 1), 4 * rows * width,
                          rows * width * (4 + 2) + 4 * width, 2.0, "xla"))
    return cases


def newton_schulz_cases(s: dict) -> list[Case]:
    from zaya_jax.train.muon import newton_schulz

    count, m, n = s["matrices"], s["hidden"], s["width"]
    x = jax.random.normal(jax.random.PRNGKey(3), (count, m, n), jnp.float32)
    small, large = min(m, n), max(m, n)
    # Per iteration: the Gram matrix (2·s²·l), its square-and-scale (2·s³), the product back (2·s²·l).
    flops = 5 * count * (4 * small * small * large + 2 * small ** 3)
    nbytes = 4 * count * m * n * 2  # the fp32 matrices in and out
    cases = []
    for backend in ("float32", "bfloat16"):
        def fn(x, dtype=backend):
            return newton_schulz(x, steps=5, dtype=jnp.dtype(dtype))
        cases.append(Case("newton_schulz", f"{count} × {m}×{n}", backend, fn, (x,), (), flops, nbytes, 0.0,
                          "float32", backward=False))
    return cases


BUILDERS = {"attention": attention_cases, "grouped_matmul": grouped_matmul_cases, "rms_norm": rms_norm_cases,
            "newton_schulz": newton_schulz_cases}


def median_seconds(fn: Callable, args: tuple, iters: int) -> float:
    compiled = jax.jit(fn)
    jax.block_until_ready(compiled(*args))  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_backward(case: Case) -> Callable:
    def loss(*args):
        return jnp.sum(case.fn(*args).astype(jnp.float32))

    return jax.grad(loss, case.diff_argnums)


def measure(case: Case, iters: int) -> list[dict]:
    rows = []
    passes = [("fwd", case.fn, 1.0, 1.0)]
    if case.backward:
        passes.append(("fwd+bwd", forward_backward(case), 1.0 + case.bwd_factor, 3.0))  # bwd re-reads inputs, writes grads
    for direction, fn, flop_factor, byte_factor in passes:
        row = {"kernel": case.kernel, "variant": case.variant, "backend": case.backend, "pass": direction,
               "baseline": case.baseline, "flops": case.fwd_flops * flop_factor, "bytes": case.fwd_bytes * byte_factor}
        try:
            row["seconds"] = median_seconds(fn, case.args, iters)
        except Exception as e:  # report and go on: one backend failing must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
    return rows


def add_rates(rows: list[dict], peak_tflops: float | None, peak_tbps: float | None) -> None:
    times = {(r["kernel"], r["variant"], r["backend"], r["pass"]): r.get("seconds") for r in rows}
    for r in rows:
        t = r.get("seconds")
        if t is None:
            continue
        r["tflops"] = r["flops"] / t / 1e12
        r["gb_per_s"] = r["bytes"] / t / 1e9
        if peak_tflops:
            r["fraction_of_peak_flops"] = r["tflops"] / peak_tflops
        if peak_tbps:
            r["fraction_of_peak_bandwidth"] = r["gb_per_s"] / (peak_tbps * 1e3)
        base = times.get((r["kernel"], r["variant"], r["baseline"], r["pass"]))
        if base:
            r["baseline_time_over_this"] = base / t  # > 1: faster than the baseline


def markdown(result: dict) -> str:
    lines = [f"# Kernel benchmark: {result['device_kind']} ({result['size']} shapes)", "",
             f"jax {result['jax']}, {result['platform']}; peak {result['peak_bf16_tflops']} TFLOP/s bf16, "
             f"{result['peak_hbm_tb_per_s']} TB/s ({result['profile']}). {result['note']}", "",
             "| kernel | variant | backend | pass | ms | TFLOP/s | GB/s | % peak FLOP/s | % peak BW | baseline ÷ this |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['variant']} | {r['backend']} | {r['pass']} | failed: "
                         f"{r['error'].replace('|', '/')} | | | | | |")
            continue
        pct = (lambda k: f"{100 * r[k]:.1f}" if k in r else "–")
        ratio = f"{r['baseline_time_over_this']:.2f} (vs {r['baseline']})" if "baseline_time_over_this" in r else "–"
        lines.append(f"| {r['kernel']} | {r['variant']} | {r['backend']} | {r['pass']} | {1e3 * r['seconds']:.3f} | "
                     f"{r['tflops']:.3g} | {r['gb_per_s']:.3g} | {pct('fraction_of_peak_flops')} | "
                     f"{pct('fraction_of_peak_bandwidth')} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="zaya1", help="shape set (default: zaya1)")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per measurement (default: 20)")
    parser.add_argument("--kernels", default="attention,grouped_matmul,rms_norm,newton_schulz",
                        help="comma-separated subset of attention,grouped_matmul,rms_norm,newton_schulz")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "benchmarks"), help="directory for the JSON and Markdown")
    parser.add_argument("--platform", choices=("cuda", "rocm", "cpu"), default=_platform_from_env(),
                        help="the JAX platform, named so that the vendor grouped GEMM's XLA flags are set before "
                             "JAX starts (default: JAX_PLATFORMS when it names one, else what JAX finds, "
                             "without the vendor GEMM)")
    parser.add_argument("--gpu-target", metavar="FILE", help="compile every case for this XLA GPU target, run none")
    args = parser.parse_args(argv)
    if args.platform and not args.gpu_target:
        from zaya_jax.kernels import xla_flags
        from zaya_jax.kernels.registry import vendor_backend

        os.environ["JAX_PLATFORMS"] = args.platform
        if vendor := vendor_backend("grouped_matmul", args.platform):
            xla_flags.require({"moe_kernel": vendor})
    chosen = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(chosen) - set(BUILDERS))
    if unknown or args.iters < 1:
        print(f"error: unknown kernel(s) {unknown} (choose from {sorted(BUILDERS)})" if unknown
              else "error: --iters must be >= 1", file=sys.stderr)
        return 2
    if args.gpu_target:
        return compile_only(args, chosen)

    from zaya_jax.hardware import detect
    from zaya_jax.kernels.registry import platform

    device = jax.devices()[0]
    profile = detect(device)
    rows = []
    for name in chosen:
        for case in BUILDERS[name](SIZES[args.size]):
            print(f"{case.kernel:15s} {case.variant:18s} {case.backend:7s} ...", flush=True)
            rows.extend(measure(case, args.iters))
    peak_tflops = profile.peak_bf16_tflops if profile and not profile.nominal else None
    peak_tbps = profile.hbm_tb_per_s if profile and not profile.nominal else None
    add_rates(rows, peak_tflops, peak_tbps)
    note = ("Pallas ran in interpret mode: CPU times check the tool, they are not kernel performance."
            if platform() == "cpu" else "Compiled Pallas (Triton lowering).")
    result = {"device_kind": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "size": args.size, "shapes": SIZES[args.size], "iters": args.iters,
              "profile": profile.name if profile else None, "peak_bf16_tflops": peak_tflops,
              "peak_hbm_tb_per_s": peak_tbps, "note": note, "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}
    slug = re.sub(r"[^a-z0-9]+", "_", device.device_kind.lower()).strip("_")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"kernels_{args.size}_{slug}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    table = markdown(result)
    with open(stem + ".md", "w") as f:
        f.write(table)
    print(table)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


def compile_only(args, chosen: list[str]) -> int:
    """--gpu-target: every chosen case compiled for the target's device; the rows written as JSON."""
    import gpu_dry_run
    from zaya_jax.errors import ZayaError
    from zaya_jax.kernels.registry import device_target, targeting

    try:
        flags = gpu_dry_run.set_vendor_flags(args.gpu_target)  # before JAX starts
        [device] = gpu_dry_run.devices(args.gpu_target)
    except ZayaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    with targeting(device_target(device)):
        for name in [k.strip() for k in args.kernels.split(",") if k.strip()]:
            rows += gpu_dry_run.compile_cases(BUILDERS[name](SIZES[args.size]), device, forward_backward)
    slug = re.sub(r"[^a-z0-9]+", "_", device.device_kind.lower()).strip("_")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kernels_{args.size}_{slug}_compiled.json")
    with open(path, "w") as f:
        json.dump({"device_kind": device.device_kind, "gpu_target": args.gpu_target, "jax": jax.__version__,
                   "size": args.size, "xla_flags": " ".join(flags), "rows": rows}, f, indent=2)
    failed = [r for r in rows if "error" in r]
    print(f"{len(rows) - len(failed)} of {len(rows)} compiled; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
