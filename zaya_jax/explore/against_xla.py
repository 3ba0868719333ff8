"""Check predictions against XLA: compile the real train step of a layout from abstract shapes.

Nothing is allocated: `train/program.Program.compile_train_step` lowers the step for shapes with
the layout's shardings on the devices given (fake CPU devices, a job's own, or compile-only GPUs:
`explore/deviceless.py`), and XLA's memory analysis gives per-device argument bytes (parameters,
optimizer state, inputs: the prediction's exact part) and temporary bytes (activations, gradients,
buffers: the modelled part). On CPU XLA's temporaries are a proxy for a GPU's: the CPU compiler
lowers `ragged_dot` densely and keeps more fp32 copies. On CPU devices the experts compile with the
`xla` grouped matmul (`ragged_dot`, whose GPU form XLA emits too) unless the overrides name one: the
CPU default, `tiled`, keeps per-tile copies of the rows and weights that no GPU kernel has (with
them, XLA's total for tiny_cpu under `data 8` is 1.7x the modelled one). On GPUs the run's own
kernels compile."""

from __future__ import annotations

import time

from zaya_jax.cpu_host import DEVICE_COUNT_FLAG
from zaya_jax.errors import ZayaError
from zaya_jax.explore import xla_terms


def compiled_overrides(overrides: list[str], on_cpu: bool = True) -> list[str]:
    """The overrides a validated step compiles with (and the prediction it is held against is made
    for): on CPU devices the experts on the `xla` grouped matmul unless they name one; on GPUs the
    run's own kernels."""
    named = any("model.moe_kernel" in o for o in overrides)
    return (["--config.model.moe_kernel=xla"] if on_cpu and not named else []) + list(overrides)


def memory_report(program, terms: bool = False, keep: str | None = None, largest: int = 0) -> dict:
    """Compile the program's train step; its per-device memory analysis, compile time (in all, and
    per phase: trace, lower, XLA compile) and the kernel backends it was built with; with `terms`,
    its bytes at the peak by explorer term (`xla_terms`), XLA's reports left in `keep` if given,
    and the `largest` buffers at the peak (bytes, shape, opcode, op name)."""
    if terms:
        with xla_terms.dumping(keep) as (options, read_peak):
            compiled, phases = program.compile_train_step_phases(options)
            buffers = read_peak()
            by_term = xla_terms.attribute(buffers, xla_terms.total_bytes(compiled))
    else:
        compiled, phases = program.compile_train_step_phases()
    mem = compiled.memory_analysis()
    report = {"argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
              "alias_bytes": int(mem.alias_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
              "compile_s": round(sum(phases.values()), 1), "phases": phases, "kernels": program.kernels()}
    if terms:
        report["terms"] = by_term
    if terms and largest:
        top = sorted(buffers, key=lambda b: -b.bytes)[:largest]
        report["largest_at_peak"] = [[b.bytes, b.shape, b.opcode, b.op_name[:160]] for b in top]
    return report


def compile_layout(config_path: str, overrides: list[str], layout: dict[str, int], devices, terms: bool = False,
                   keep: str | None = None) -> dict:
    """XLA's numbers for one layout, or {"error": why} when the step cannot be built here. The
    kernels are built for the devices' target (a deviceless GPU's on this CPU host too). With
    `terms`, XLA's reports are left in `keep` if given (`memory_report`)."""
    from zaya_jax.kernels.registry import device_target
    from zaya_jax.train.program import program_for_target

    mesh = [f"--config.mesh.{axis}={size}" for axis, size in layout.items()]
    target = device_target(devices[0])
    try:
        program = program_for_target(config_path, compiled_overrides(overrides, on_cpu=target == "cpu") + mesh,
                                     target, devices)
    except ZayaError as e:
        return {"error": str(e)}
    return memory_report(program, terms, keep)


def validate(config_path: str, overrides: list[str], layouts: list[dict[str, int]], progress=print,
             devices=None, terms: bool = False) -> dict:
    """XLA's numbers for each layout, keyed by `placement.describe(layout)`, compiled on `devices`
    (node-major; default JAX's)."""
    import jax

    from zaya_jax.explore.placement import describe, total

    devices = list(devices if devices is not None else jax.devices())
    out = {}
    for i, layout in enumerate(layouts, 1):
        n = total(layout)
        if len(devices) < n:
            raise ZayaError(f"--validate needs {n} devices and JAX sees {len(devices)}; run with "
                            f"XLA_FLAGS={DEVICE_COUNT_FLAG}={n} JAX_PLATFORMS=cpu")
        start = time.perf_counter()
        out[describe(layout)] = compile_layout(config_path, overrides, layout, devices[:n], terms)
        progress(f"validate {i}/{len(layouts)}: {describe(layout)} compiled in {time.perf_counter() - start:.1f}s")
    return out
