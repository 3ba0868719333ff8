"""Compile the stored rows of a drawn-shapes report again and attribute XLA's buffers with the
current `explore/xla_terms.py`: for when the attribution (not the program) has changed. Each
row's XLA total must come out byte for byte as stored (the program is the same); its terms are
replaced, its prediction and ratio kept, and the report says what was re-attributed and when.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/reattribute_drawn.py \\
        --why "the micro-batch loop's running gradient sum: update -> gradients" \\
        --only-micro-batches benchmarks/explorer_drawn_shapes*.json

A row whose XLA total is not as stored (its program has changed since the run) stops it, or with
`--recompile-changed` takes the new numbers, is predicted by the current model and marked. The
reports made on deviceless GPUs (`explorer_drawn_shapes.py --gpu-target`: scheduled as if nearly
full, or steps sized for their HBM) are compiled again with `--gpu-target FILE`, the same target
config, in a venv with JAX's CUDA plugin; a mocked GPU's and a roomy one's are skipped. Each
report is rewritten after every row.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reports", nargs="+", help="drawn-shapes JSON reports made on 8 fake CPU devices (or on "
                   "deviceless GPUs, with --gpu-target)")
    p.add_argument("--why", required=True, help="what changed in the attribution (written into each report)")
    p.add_argument("--only-micro-batches", action="store_true", help="only rows with more than one micro-batch")
    p.add_argument("--recompile-changed", action="store_true", help="a row whose program has changed since the run "
                   "(another XLA total) takes the new numbers and the current model's prediction, marked "
                   "recompiled; without this, such a row stops the run")
    p.add_argument("--gpu-target", metavar="FILE", help="compile the reports made on deviceless GPUs for this XLA "
                   "GPU target config (the one they were made with; needs JAX's CUDA plugin)")
    args = p.parse_args(argv)
    if args.gpu_target:
        os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin then registers without looking for a driver
    import jax

    import explorer_drawn_shapes as eds
    from zaya_jax.explore.against_xla import compile_layout

    gpus: dict[bool, list] = {}  # deviceless GPUs as a report was compiled: as if nearly full, or not

    def deviceless(pressed: bool) -> list:
        if pressed not in gpus:
            gpus[pressed] = eds._deviceless_gpus(args.gpu_target, pressed)
        return gpus[pressed]

    today = datetime.date.today().isoformat()
    for path in args.reports:
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
            device = report["device"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"{path}: not a drawn-shapes report ({e}); give the JSON benchmarks/explorer_drawn_shapes.py wrote",
                  file=sys.stderr)
            return 2
        if device.endswith("scheduled as if nearly full") and args.gpu_target:
            devices = deviceless(pressed=True)
        elif device.endswith(eds.SIZED) and args.gpu_target:
            devices = deviceless(pressed=False)
        elif device.endswith("fake CPU devices"):
            if len(jax.devices()) < 8 or jax.devices()[0].platform != "cpu":
                print("run on 8 fake CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8", file=sys.stderr)
                return 2
            devices = jax.devices()[:8]
        else:
            print(f"{path}: made on {device}: skipped (deviceless GPUs need --gpu-target; a mocked GPU's and "
                  "a roomy one's are not compiled again)", file=sys.stderr)
            continue
        done = 0
        for row in report["rows"]:
            if args.only_micro_batches and "--config.train.grad_accum_steps=1" in row["overrides"]:
                continue
            start = time.perf_counter()
            config = os.path.join(ROOT, eds.report_config(report))
            got = compile_layout(config, row["overrides"], eds._sizes(row["layout"]), devices, terms=True)
            old, new = sum(row["xla"].values()), sum(got["terms"].values())
            if old != new and not args.recompile_changed:
                print(f"{path}: seed {row['seed']} {row['layout']}: XLA's total is {new} bytes now, {old} stored: the "
                      "program changed; add --recompile-changed or compile the report again", file=sys.stderr)
                return 2
            row["xla"] = got["terms"]
            if old != new:
                _predict_again(row, report, old, today)
            done += 1
            print(f"{os.path.basename(path)} seed {row['seed']} {row['layout']}: {time.perf_counter() - start:.0f} s",
                  flush=True)
            _note(report, f"{today}: {args.why}", done)
            eds._write(path, report, quiet=True)  # a run stopped midway keeps the rows it compiled
    return 0


def _note(report: dict, what: str, rows: int) -> None:
    """The report's note of this run (one, its row count kept current)."""
    notes = report.setdefault("reattributed", [])
    if notes and notes[-1].startswith(what + " ("):
        notes.pop()
    notes.append(f"{what} ({rows} rows)")


def _predict_again(row: dict, report: dict, old_total: int, today: str) -> None:
    """A row whose program changed since its run: the current model's prediction beside it."""
    import explorer_drawn_shapes as eds

    eds.predict_row(row, report)
    row["recompiled"] = f"on {today}: their programs had changed since the run"
    row["xla_total_at_run"] = old_total
    print(f"  recompiled: {old_total} -> {sum(row['xla'].values())} bytes", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
