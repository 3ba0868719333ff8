"""Measured efficiencies for the explorer: `zaya mesh --calibrate FILE`.

FILE is the report `tools/gpu_check.py` writes on a lent device (`benchmarks/gpu_<device>.json`).
From its kernel benchmark (fwd+bwd at ZAYA1's shapes) it takes, per kernel kind of
`step_time.flops_by_kernel`, the share of the device's peak the run's own backend reached:
`attention` (packed documents where measured), `grouped_matmul` (the experts' backend), `matmul`
(the dense product of the same shapes; also the linear layers' core, which the file does not time).
From its profiled step (the `profile` part, where the report has one) it takes what the kernel
timings cannot: the factor between the device's measured elementwise work and copies (the
optimizer's aside) and the model's (`Workload.elementwise_scale`: the model counts the blocks'
passes, measured on a CPU), and the share of the fp32 peak Muon's Newton–Schulz products reached
(`newton_schulz`; without a profile, the dense matmul's share). From its timed train step it takes
the residual: the factor that makes the calibrated model's compute time for that step (one device,
no collectives) meet the measured step, less the optimizer's modelled time: what the timings and
the profile leave out (launches, what differs between the profiled and the timed shape); every
layout's compute is scaled by it. One measured step makes it a one-point fit: a prediction for
shapes near it, not a law. Measured collectives come from `zaya bench collectives` (`--collectives`).
"""

from __future__ import annotations

import dataclasses
import json
import os

from zaya_jax.errors import ZayaError
from zaya_jax.explore.workload import Workload
from zaya_jax.parallel.axes import MESH_AXES

TOOL = "tools/gpu_check.py"
KERNEL_ROWS = {"attention": "attention", "grouped_matmul": "grouped_matmul"}  # kind → bench kernel
ONE_DEVICE = dict.fromkeys(MESH_AXES, 1)  # the layout of a report's measured steps
MODEL_FIELDS = ("hidden_size", "num_hidden_layers", "num_experts", "num_attention_heads", "num_key_value_heads",
                "head_dim", "moe_intermediate_size", "vocab_size", "compute_dtype")


@dataclasses.dataclass(frozen=True)
class Calibration:
    path: str
    device: str
    efficiencies: dict  # kernel kind → share of the peak
    residual: float
    measured_step_s: float | None
    modelled_step_s: float | None  # the kernel-calibrated prediction for the measured step
    elementwise_scale: float = 1.0  # the profiled elementwise work over the modelled (1: no profile)

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(self.efficiencies.items()) if k != "linear_attention")
        profiled = f"; elementwise work x{self.elementwise_scale:.2f} (profiled)" if self.elementwise_scale != 1.0 else ""
        step = (f"; step residual x{self.residual:.2f} (measured {self.measured_step_s:.3g} s against "
                f"{self.modelled_step_s:.3g} s from the kernels)" if self.measured_step_s else "; no timed step")
        return f"calibrated from {self.path} ({self.device}): share of peak {kinds}{profiled}{step}"


def read(path: str) -> dict:
    """A gpu_check report, checked for what calibration needs."""
    if not os.path.isfile(path):
        raise ZayaError(f"--calibrate file {path} does not exist; pass the JSON tools/gpu_check.py wrote "
                        "(benchmarks/gpu_<device>.json)")
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise ZayaError(f"--calibrate file {path} is not valid JSON ({e})") from None
    if not isinstance(report, dict) or report.get("tool") != TOOL:
        raise ZayaError(f"--calibrate file {path} is not a {TOOL} report (measured collectives go to --collectives)")
    rows = ((report.get("parts") or {}).get("bench") or {}).get("rows")
    if not isinstance(rows, list) or not rows:
        raise ZayaError(f"--calibrate file {path} has no kernel benchmark rows (its bench part did not run)")
    return report


def calibrate(run: Workload, path: str) -> tuple[Workload, Calibration]:
    """`run` with the file's efficiencies for its own backends, and the residual of its timed step."""
    report = read(path)
    device = report.get("device", {}).get("slug", "?")
    if device != run.hw.name:
        raise ZayaError(f"--calibrate file {path} was measured on {device}, the question is for {run.hw.name}; "
                        f"pass --hardware {device} or a file from a {run.hw.name}")
    rows = report["parts"]["bench"]["rows"]
    efficiencies = _efficiencies(run, rows, path)
    scale = 1.0
    profile = report["parts"].get("profile") or {}
    if profile.get("status") == "ok":
        scale, efficiencies["newton_schulz"] = _profiled(profile, run, rows, path)
    calibrated = dataclasses.replace(run, efficiencies=tuple(sorted(efficiencies.items())), elementwise_scale=scale)
    step = (report["parts"].get("step") or {})
    if step.get("status") != "ok" or not step.get("step_s"):
        return calibrated, Calibration(path, device, efficiencies, 1.0, None, None, scale)
    measured = float(step["step_s"])
    predicted = _modelled_step(step, calibrated, rows, path)
    rest = predicted.step_time_s - predicted.compute_s  # the optimizer: not what the residual scales
    if measured <= rest:
        raise ZayaError(f"--calibrate file {path}: its step took {measured:.3g} s, less than the "
                        f"{rest:.3g} s the model gives its optimizer alone; the file's step is not this model's")
    residual = (measured - rest) / predicted.compute_s
    return (dataclasses.replace(calibrated, residual=residual),
            Calibration(path, device, efficiencies, residual, measured, predicted.step_time_s, scale))


def _efficiencies(run: Workload, rows: list, path: str) -> dict[str, float]:
    cfg, peak = run.cfg, run.hw.peak_bf16_tflops
    backends = {"attention": run.backend("attention", cfg.attention_kernel),
                "grouped_matmul": run.backend("grouped_matmul", cfg.moe_kernel)}
    out = {"matmul": _share(rows, "grouped_matmul", "dense", peak, path, "the dense matmul")}
    for kind, backend in backends.items():
        try:
            out[kind] = _share(rows, KERNEL_ROWS[kind], backend, peak, path, f"{kind} with the {backend} backend")
        except ZayaError:
            if kind == "attention" or backend != "xla":
                raise
            out[kind] = out["matmul"]  # never benchmarked apart: XLA's own product
    out["linear_attention"] = out["matmul"]  # not timed by gpu_check; its core is chunked matmuls
    out["newton_schulz"] = out["matmul"]  # until a profile times them (`_profiled`)
    return out


# A profile row's kind for fp32 library GEMMs no HLO op named: in our step, only Newton–Schulz's.
FP32_MATMUL = "matmul (tf32)"


def _profiled(profile: dict, run: Workload, rows: list, path: str) -> tuple[float, float]:
    """(measured over modelled elementwise work, Newton–Schulz's share of the fp32 peak) for the
    report's profiled step: its rows against the model of that step on one device."""
    from zaya_jax.explore import step_time
    from zaya_jax.explore.workload import share

    try:
        ms = [(str(r["part"]), str(r["kind"]), float(r["ms_per_step"])) for r in profile["rows"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ZayaError(f"--calibrate file {path}: its profile's rows are not tools/profile_step.py's "
                        f"({type(e).__name__}: {e}); re-run tools/gpu_check.py") from None
    elementwise = sum(t for part, kind, t in ms if kind in ("elementwise", "copy") and part != "optimizer") / 1e3
    newton_schulz = sum(t for part, kind, t in ms
                        if kind == FP32_MATMUL or (part == "optimizer" and kind.startswith("matmul"))) / 1e3
    if elementwise <= 0 or newton_schulz <= 0:
        missing = "elementwise work" if elementwise <= 0 else "Newton–Schulz products"
        raise ZayaError(f"--calibrate file {path}: its profile times no {missing}; "
                        "re-run tools/gpu_check.py --parts profile")
    profiled = _one_device(profile, run, rows, path, "profiled step")
    modelled = step_time.elementwise_seconds(profiled, ONE_DEVICE, share(profiled, ONE_DEVICE))
    rate = step_time.newton_schulz_flops(profiled, ONE_DEVICE) / newton_schulz / 1e12
    return elementwise / modelled, rate / (run.hw.peak_fp32_matmul_tflops or run.hw.peak_bf16_tflops)


def _share(rows: list, kernel: str, backend: str, peak_tflops: float, path: str, what: str) -> float:
    """A benchmark row's fwd+bwd TFLOP/s over the profile's peak (packed documents first, for
    attention): the profile's own peak, so a nominal one (the CPU's) calibrates too."""
    found = [r for r in rows if isinstance(r, dict) and r.get("kernel") == kernel and r.get("backend") == backend
             and r.get("pass") == "fwd+bwd" and isinstance(r.get("tflops"), (int, float)) and r["tflops"] > 0]
    if not found:
        raise ZayaError(f"--calibrate file {path} has no fwd+bwd timing of {what}; re-run tools/gpu_check.py "
                        "with that backend, or choose a measured one (--config.model.*_kernel)")
    found.sort(key=lambda r: "documents" not in str(r.get("variant", "")))
    return float(found[0]["tflops"]) / peak_tflops


def _modelled_step(step: dict, run: Workload, rows: list, path: str):
    """The calibrated prediction (kernels and profile, no residual) for the report's timed step: its
    model on one device."""
    from zaya_jax.explore import step_time
    from zaya_jax.explore.collectives import Network

    measured = _one_device(step, run, rows, path, "timed step")
    profiled = {**dict(measured.efficiencies), "newton_schulz": run.efficiency("newton_schulz")}
    measured = dataclasses.replace(measured, efficiencies=tuple(sorted(profiled.items())),
                                   elementwise_scale=run.elementwise_scale)
    return step_time.predict(measured, ONE_DEVICE, Network(run.hw))


def _one_device(part: dict, run: Workload, rows: list, path: str, what: str) -> Workload:
    """The workload of a step the report measured (its model, shape and kernels), on one device,
    its kernels at the report's shares, nothing else calibrated."""
    from zaya_jax.config import preset

    model = part.get("model") or {}
    missing = [k for k in MODEL_FIELDS if k not in model]
    if missing or not all(k in part for k in ("seq_len", "batch", "micro_batches", "remat")):
        raise ZayaError(f"--calibrate file {path}: its {what} does not say its shape ({missing[:1] or 'seq_len'}); "
                        "re-run tools/gpu_check.py")
    kernels = part.get("kernels") or {}
    cfg = preset("zaya1_base", **{k: model[k] for k in MODEL_FIELDS},
                 attention_kernel=kernels.get("attention", "auto"), moe_kernel=kernels.get("grouped_matmul", "auto"))
    # Its Newton–Schulz as it ran: a report from before bf16 products had fp32 ones.
    one = dataclasses.replace(run, cfg=cfg, seq_len=int(part["seq_len"]), global_batch=int(part["batch"]),
                              grad_accum=int(part["micro_batches"]), remat=str(part["remat"]), nodes=1,
                              gpus_per_node=1, residual=1.0, elementwise_scale=1.0,
                              ns_dtype=str(part.get("muon_ns_dtype", "float32")))
    return dataclasses.replace(one, efficiencies=tuple(sorted(_efficiencies(one, rows, path).items())))
