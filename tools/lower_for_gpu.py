"""Lower an experiment's train step (and every Pallas kernel) for a CUDA or ROCm GPU on this machine.

No GPU is needed: the program is built on fake CPU devices with its kernels targeted at the GPU
platform (Pallas compiled, not interpreted; the platform's tuning rows), and lowered with
`lowering_platforms=(platform,)`, which runs Pallas's Triton lowering. A kernel Triton cannot
express fails here with its error. Prints the Triton calls of the step by kernel name.

    python tools/lower_for_gpu.py --config=experiments/layouts/tsp8.py --platform=rocm \\
        --config.model.compute_dtype=bfloat16 [--devices=8] [--kernels] [--out=lowering.json]

Exit status: 0 when everything lowers, 1 when something does not (the error names it), 2 for
bad input (a missing config, an unknown platform, a layout that does not fit the devices).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PLATFORMS = ("cuda", "rocm")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="experiment file (leave out with --kernels to lower only the kernels)")
    parser.add_argument("--platform", default="cuda,rocm",
                        help="GPU platform(s) to lower for, comma-separated: cuda, rocm (default both)")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices the mesh is built on (default 8)")
    parser.add_argument("--kernels", action="store_true",
                        help="also lower every Pallas kernel, forward and forward+backward, at ZAYA1 shapes "
                             "in bf16 and fp32")
    parser.add_argument("--out", help="write the report as JSON here")
    return parser.parse_known_args(argv)


def _platforms(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PLATFORMS]
    if not names or bad:
        raise ValueError(f"--platform takes {', '.join(PLATFORMS)} (comma-separated), got {text!r}")
    return names


def main(argv=None) -> int:
    args, overrides = parse_args(argv)
    try:
        platforms = _platforms(args.platform)
        if args.devices < 1:
            raise ValueError(f"--devices must be at least 1, got {args.devices}")
        if not args.config and not args.kernels:
            raise ValueError("give --config=EXPERIMENT (a train step to lower), --kernels, or both")
        if overrides and not args.config:
            raise ValueError(f"{overrides[0]} needs --config")
        if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            raise ValueError(f"--out folder {os.path.dirname(os.path.abspath(args.out))} does not exist")
    except ValueError as e:
        return _fail(str(e))
    os.environ["JAX_PLATFORMS"] = "cpu"
    from zaya_jax.cpu_host import with_device_count

    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), args.devices)
    from zaya_jax.errors import ZayaError
    from zaya_jax.train.program import program_for_target

    report = {"platforms": platforms, "steps": [], "kernels": []}
    failed = False
    for platform in platforms:
        try:
            program = program_for_target(args.config, overrides, platform) if args.config else None
        except ZayaError as e:  # the experiment or its layout: the user's input
            return _fail(str(e))
        try:
            if args.kernels:
                report["kernels"] += lower_kernels(platform)
            if program is not None:
                report["steps"].append(lower_step(program, args.config, overrides, platform))
        except ZayaError as e:
            print(f"lower_for_gpu: {platform}: {e}", file=sys.stderr, flush=True)
            failed = True
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 1 if failed else 0


def _fail(message: str) -> int:
    print(f"lower_for_gpu: error: {message}", file=sys.stderr)
    return 2


def lower_kernels(platform: str) -> list[dict]:
    """Every Pallas kernel case lowered for `platform`; raises ZayaError on the first that fails."""
    import jax.numpy as jnp

    from zaya_jax.kernels import gpu_lowering

    rows = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for case in gpu_lowering.kernel_cases(dtype):
            calls = gpu_lowering.lower_kernel_case(case, platform)
            rows.append({"platform": platform, "dtype": jnp.dtype(dtype).name, "case": case.name,
                         "triton_calls": dict(calls)})
    print(f"{platform}: {len(rows)} kernel cases lowered (bf16 and fp32, forward and forward+backward)", flush=True)
    return rows


def lower_step(program, config: str, overrides: list[str], platform: str) -> dict:
    """The program's train step lowered for `platform`: its Triton calls by kernel and the time taken."""
    from zaya_jax.errors import ZayaError
    from zaya_jax.kernels import gpu_lowering

    start = time.perf_counter()
    try:
        text = program.lower_train_step(platform).as_text()
    except Exception as e:  # the Triton lowering's own error
        raise ZayaError(f"the train step of {config} does not lower: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from e
    seconds = time.perf_counter() - start
    calls = gpu_lowering.triton_calls(text)
    mesh = {k: int(v) for k, v in program.mesh.shape.items() if v > 1}
    m, kernels = program.exp.model, program.kernels()
    print(f"{platform}: lowered {config} ({', '.join(f'{k}={v}' for k, v in mesh.items()) or 'one device'}; "
          f"{m.compute_dtype}; kernels {', '.join(f'{k} {v}' for k, v in kernels.items())}) "
          f"in {seconds:.1f}s: {sum(calls.values())} Triton calls", flush=True)
    for name, count in sorted(calls.items()):
        print(f"  {name:<34} {count:5d}")
    return {"platform": platform, "config": config, "overrides": overrides, "mesh": mesh,
            "compute_dtype": m.compute_dtype, "kernels": kernels, "lower_sec": round(seconds, 2),
            "triton_calls": dict(calls)}


if __name__ == "__main__":
    sys.exit(main())
