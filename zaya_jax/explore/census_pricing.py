"""A step's census priced in time: each op's work at the rate a measured step reached for its class.

`time_class` sorts a census op (`explore/step_census.py`) into bf16 GEMMs, fp32 GEMMs, our attention
kernels, cuDNN's attention, our grouped-matmul kernels (all by FLOPs) or memory-bound ops (by bytes).
`fit_rates` takes one rate per class from a profiled step (`tools/profile_step.py`'s rows, compiled
here at the same shape for its census) and, for cuDNN's attention, from a kernel benchmark;
`predict` prices any census at those rates. One profiled step makes it a fit of five numbers: a
guide where no GPU is, checked against the steps the same report timed (`tools/gpu_census.py`).
"""

from __future__ import annotations

import collections

from zaya_jax.explore.step_census import Op


def time_class(op: Op) -> str:
    """Which measured rate prices an op: `gemm bf16`, `gemm fp32`, `attention kernel` (ours),
    `cudnn attention`, `grouped matmul kernel` (by FLOPs), or `memory` (every other op, by bytes)."""
    if op.kind == "gemm":
        return "gemm fp32" if op.dtype == "f32" else "gemm bf16"
    if op.kind == "kernel" and op.flops:
        if op.target.startswith("__cudnn$fmha"):
            return "cudnn attention"
        return "grouped matmul kernel" if "grouped_matmul" in op.target else "attention kernel"
    return "memory"


def work_by_class(ops: list[Op]) -> dict[str, float]:
    """FLOPs (or bytes, for `memory`) per step of each time class."""
    out = collections.Counter()
    for o in ops:
        cls = time_class(o)
        out[cls] += o.runs * (o.bytes if cls == "memory" else o.flops)
    return dict(out)


# A profiled step's rows (`tools/profile_step.py`: part, kind, ms) → the time class they measured.
def profiled_class(part: str, kind: str) -> str:
    if kind.startswith("matmul"):
        return "gemm fp32" if "tf32" in kind else "gemm bf16"
    if kind == "kernel" and part.startswith("attention"):
        return "attention kernel"
    if kind == "kernel" and part.startswith("experts"):
        return "grouped matmul kernel"
    return "memory"


def fit_rates(ops: list[Op], profile_rows: list[dict], bench_rows: list[dict] = ()) -> dict[str, float]:
    """Per time class, the work per second a profiled step reached: its census here (the same shape)
    against the device time its profile measured for the class. cuDNN's attention, which the
    profiled step did not run, at the rate the report's kernel benchmark timed it (fwd+bwd, causal:
    the same seven products a query-key pair as the census counts; with packed documents where it
    timed them)."""
    measured = collections.Counter()
    for row in profile_rows:
        measured[profiled_class(row["part"], row["kind"])] += row["ms_per_step"] / 1e3
    work = work_by_class(ops)
    rates = {cls: work[cls] / seconds for cls, seconds in measured.items() if seconds > 0 and work.get(cls)}
    cudnn = [r for r in bench_rows if r.get("kernel") == "attention" and r.get("backend") == "cudnn"
             and r.get("pass") == "fwd+bwd" and r.get("tflops")]
    packed = [r for r in cudnn if "documents" in str(r.get("variant", ""))]  # as training runs it, where timed
    if cudnn:
        rates["cudnn attention"] = (packed or cudnn)[0]["tflops"] * 1e12
    return rates


def predict(ops: list[Op], rates: dict[str, float]) -> dict[str, float]:
    """Seconds per step of each time class at `rates` (`fit_rates`); a class without a rate is absent."""
    return {cls: amount / rates[cls] for cls, amount in work_by_class(ops).items() if cls in rates}
