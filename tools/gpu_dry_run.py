"""`tools/gpu_check.py --gpu-target FILE`: its parts compiled for a GPU this machine does not have.

Owns what a dry run does in place of running: the device it reports (a compile-only device of the
target, `explore/deviceless.py`; AMD targets through the ROCm compile set-up), the step compiled
instead of timed (XLA's peak memory against the target's HBM, so the step part still steps down
its layer count when a step does not fit), and each kernel benchmark case compiled, forward and
forward+backward, instead of timed (`tools/bench_kernels.py --gpu-target`). Nothing runs, so a
dry run says whether the programs a GPU run would time build for that GPU, with its kernels and
the vendor flags its platform takes, not how fast they are.
"""

from __future__ import annotations

import json
import re
import time

GIB = 1024 ** 3


def target_memory(config: str) -> int:
    """The target's HBM bytes (`device_memory_size` of its XLA target config)."""
    found = re.search(r"device_memory_size:\s*(\d+)", config)
    return int(found.group(1)) if found else 0


def devices(path: str) -> list:
    """One compile-only device of the target at `path`, JAX itself kept on the CPU."""
    from zaya_jax.explore import deviceless

    config = deviceless.read_target(path)
    deviceless.use_cpu_host()
    return deviceless.gpu_devices(config, 1, 1, path)


def set_vendor_flags(path: str) -> list[str]:
    """Before JAX starts: the XLA flags of the target's vendor grouped GEMM, so that it compiles as
    a GPU run's would (`tools/bench_kernels.py`'s vendor row)."""
    from zaya_jax.explore import deviceless
    from zaya_jax.kernels import xla_flags
    from zaya_jax.kernels.registry import vendor_backend

    platform = deviceless.target_platform(deviceless.read_target(path))
    return xla_flags.require({"moe_kernel": vendor_backend("grouped_matmul", platform)})


PROBE = r"""
import importlib.metadata, json, platform, sys
sys.path.insert(0, %r)
import gpu_dry_run
from zaya_jax.errors import ZayaError
from zaya_jax.kernels.registry import device_target
try:
    [d] = gpu_dry_run.devices(sys.argv[1])
except ZayaError as e:
    print("GPU_DRY_RUN_REFUSED " + str(e)); sys.exit(0)
import jax
print(%r + json.dumps({"device_kind": d.device_kind, "platform": "gpu", "target": device_target(d),
    "device_count": 1, "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
    "python": platform.python_version(), "gpu_target": sys.argv[1]}))
"""


def step_compile(device, limit: int, layers: int, experiment: str, overrides: list[str]) -> dict:
    """The step at `layers` compiled for the compile-only `device`: XLA's peak against its HBM
    `limit` ('oom' above it)."""
    from zaya_jax.explore.xla_terms import total_bytes
    from zaya_jax.kernels.registry import device_target
    from zaya_jax.train.program import program_for_target

    program = program_for_target(experiment, overrides, device_target(device), [device])
    start = time.perf_counter()
    compiled, phases = program.compile_train_step_phases()
    peak = int(total_bytes(compiled))
    fits = not limit or peak <= limit
    out = {"status": "ok" if fits else "oom", "dry_run": True, "layers": layers, "kernels": program.kernels(),
           "compile_s": round(time.perf_counter() - start, 1), "phases": phases, "peak_bytes": peak,
           "limit_bytes": limit, "device_kind": device.device_kind}
    if not fits:
        out.update(needed_bytes=peak, error=f"XLA's peak {peak / GIB:.1f} GiB is over the target's "
                                            f"{limit / GIB:.1f} GiB")
    return out


def compile_cases(cases, device, forward_backward) -> list[dict]:
    """Each benchmark case compiled for `device`, forward and (where it has one) forward+backward
    (`forward_backward(case)`: bench_kernels' loss gradient): a row per pass with its compile
    seconds, or the compiler's first line."""
    import jax

    on = jax.sharding.SingleDeviceSharding(device)
    rows = []
    for case in cases:
        specs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on) for a in case.args)
        passes = [("fwd", case.fn)] + ([("fwd+bwd", forward_backward(case))] if case.backward else [])
        for direction, fn in passes:
            row = {"kernel": case.kernel, "variant": case.variant, "backend": case.backend, "pass": direction}
            start = time.perf_counter()
            try:
                jax.jit(fn).trace(*specs).lower().compile()
                row["compiled_s"] = round(time.perf_counter() - start, 2)
            except Exception as e:  # noqa: BLE001 - reported per row, as a timed run reports a failure
                row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            rows.append(row)
            print(f"{case.kernel:15s} {case.variant:18s} {case.backend:9s} {direction:7s} "
                  + (f"compiled in {row['compiled_s']:.1f} s" if "compiled_s" in row else row["error"]), flush=True)
    return rows


def report_line(part: dict) -> str:
    """The step part's summary line for a dry run."""
    return (f"{part['layers']} layers compiled in {part['compile_s']:.0f} s, XLA's peak "
            f"{part['peak_bytes'] / GIB:.1f} GiB of {part['limit_bytes'] / GIB:.1f} GiB (nothing run)")


def probe_result(lines: list[str], tag: str) -> dict | None:
    """The probe's device, or raises ValueError with the refusal's sentence."""
    for line in lines:
        if line.startswith("GPU_DRY_RUN_REFUSED "):
            raise ValueError(line.split(" ", 1)[1])
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    return None
