"""Compile an experiment's train step for N devices from abstract shapes and report its memory.

Nothing is allocated: the train state and batch are `jax.ShapeDtypeStruct`s with the shardings
of the run's mesh, so a full-size ZAYA1 step compiles on a laptop for a fake 8-device host (a
"per-device slice" of a bigger cluster: same per-device shapes as one node of the real run).
Prints the trace, lower and XLA-compile seconds and XLA's per-device argument / output /
temporary bytes, and writes them as JSON.

    python tools/compile_step.py --config=experiments/zaya1_base_phase1.py --devices=8 \\
        --config.train.global_batch_size=32 --out=benchmarks/compile_zaya1_base_phase1.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="experiment file")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices to compile for (default 8)")
    parser.add_argument("--out", help="write the report as JSON here")
    return parser.parse_known_args(argv)


def main(argv=None) -> int:
    args, overrides = parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    from zaya_jax.cpu_host import with_device_count

    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), args.devices)
    from zaya_jax.errors import ZayaError
    from zaya_jax.experiment import load_experiment
    from zaya_jax.train.program import build_program

    try:
        exp = load_experiment(args.config, overrides)
        program = build_program(exp)
    except ZayaError as e:
        print(f"compile_step: error: {e}", file=sys.stderr)
        return 2
    report = compile_report(program)
    print(format_report(report))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


def compile_report(program) -> dict:
    from zaya_jax.explore.against_xla import memory_report

    mem = memory_report(program)
    c = program.exp.config
    return {
        "config": program.exp.source,
        "mesh": {k: int(v) for k, v in program.mesh.shape.items()},
        "global_batch_size": c.train.global_batch_size, "seq_len": c.train.seq_len,
        "grad_accum_steps": c.train.grad_accum_steps, "remat": c.train.remat,
        "compute_dtype": c.model.compute_dtype, "compile_sec": mem["compile_s"], "phases_sec": mem["phases"],
        "per_device_bytes": {
            "arguments": mem["argument_bytes"], "outputs": mem["output_bytes"], "aliased": mem["alias_bytes"],
            "temporaries": mem["temp_bytes"],
            "total": mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"],
        },
    }


def format_report(report: dict) -> str:
    gib = 1024 ** 3
    phases = ", ".join(f"{name[:-2]} {seconds}s" for name, seconds in report.get("phases_sec", {}).items())
    rows = [f"compiled {report['config']} in {report['compile_sec']}s ({phases}) for mesh "
            f"{', '.join(f'{k}={v}' for k, v in report['mesh'].items() if v > 1) or 'one device'}",
            "per-device memory (XLA memory_analysis):"]
    rows += [f"  {name:<12} {value / gib:8.2f} GiB" for name, value in report["per_device_bytes"].items()]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
