"""Compile the stored rows of a drawn-shapes report again and attribute XLA's buffers with the
current `explore/xla_terms.py`: for when the attribution (not the program) has changed. Each
row's XLA total must come out byte for byte as stored (the program is the same); its terms are
replaced, its prediction and ratio kept, and the report says what was re-attributed and when.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/reattribute_drawn.py \\
        --why "the micro-batch loop's running gradient sum: update -> gradients" \\
        --only-micro-batches benchmarks/explorer_drawn_shapes*.json

A row whose XLA total is not as stored (its program has changed since the run) stops it, or with
`--recompile-changed` takes the new numbers, is predicted by the current model and marked.
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
    p.add_argument("reports", nargs="+", help="drawn-shapes JSON reports made on 8 fake CPU devices")
    p.add_argument("--why", required=True, help="what changed in the attribution (written into each report)")
    p.add_argument("--only-micro-batches", action="store_true", help="only rows with more than one micro-batch")
    p.add_argument("--recompile-changed", action="store_true", help="a row whose program has changed since the run "
                   "(another XLA total) takes the new numbers and the current model's prediction, marked "
                   "recompiled; without this, such a row stops the run")
    args = p.parse_args(argv)
    import jax

    import explorer_drawn_shapes as eds
    from zaya_jax.explore.against_xla import compile_layout

    if len(jax.devices()) < 8 or jax.devices()[0].platform != "cpu":
        print("run on 8 fake CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8", file=sys.stderr)
        return 2
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
        if not device.endswith("fake CPU devices"):
            print(f"{path}: not a report made on fake CPU devices; skipped", file=sys.stderr)
            continue
        done = 0
        for row in report["rows"]:
            if args.only_micro_batches and "--config.train.grad_accum_steps=1" in row["overrides"]:
                continue
            start = time.perf_counter()
            got = compile_layout(eds.CONFIG, row["overrides"], eds._sizes(row["layout"]), jax.devices()[:8], terms=True)
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
        if done:
            report.setdefault("reattributed", []).append(f"{today}: {args.why} ({done} rows)")
            eds._write(path, report, quiet=True)
    return 0


def _predict_again(row: dict, report: dict, old_total: int, today: str) -> None:
    """A row whose program changed since its run: the current model's prediction beside it."""
    import explorer_drawn_shapes as eds

    eds.predict_row(row, report)
    row["recompiled"] = f"on {today}: their programs had changed since the run"
    row["xla_total_at_run"] = old_total
    print(f"  recompiled: {old_total} -> {sum(row['xla'].values())} bytes", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
