"""Routing at every step, over seeds: each layer's busiest expert against the bar, from the unmodified commands.

    python benchmarks/routing_seeds.py [--seeds 0,1,2,3,4] [--experiments tiny_cpu,tiny_hybrid_cpu,zaya1_routing_cpu]
        [--out benchmarks/routing_seeds] [--config.KEY=VALUE ...]

Each run is `zaya train --config=experiments/NAME.py --config.train.seed=S` (plus the overrides, e.g.
`--config.optim.balancer=adam`). A logged record carries every layer's peak `load_max` (the busiest
expert's share of the expert-routed tokens × E; 1 is even) over all steps since the previous
record (`train/routing_watch.py`), so nothing between logged steps is missed. The bar (issue 72):
from step 10 on, at every step, every layer below 2; the skip class's share is reported beside it.
Prints a table per run and over seeds, and writes JSON and Markdown (rewritten after each run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BAR, FROM_STEP = 2.0, 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--experiments", default="tiny_cpu,tiny_hybrid_cpu,zaya1_routing_cpu")
    p.add_argument("--out", default=os.path.join(HERE, "routing_seeds"), help="report path without extension")
    args, overrides = p.parse_known_args(argv)
    args.overrides = overrides
    return args


def train(experiment: str, seed: int, overrides: list[str], workdir: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "zaya_jax", "train", f"--config={ROOT}/experiments/{experiment}.py",
                    f"--workdir={workdir}", f"--config.train.seed={seed}", "--config.train.progress=false",
                    *overrides], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def read(workdir: str) -> dict:
    """Per logged record: the worst layer over the steps it covers, and the skip share's peak."""
    records = []
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "load_max_peak" in r:
                records.append(r)
    worst, over, skip, previous = 0.0, [], 0.0, 0
    for r in records:
        if r["step"] >= FROM_STEP:
            # A record's peaks cover (previous record, its step]; at FROM_STEP only the step's own value counts.
            own = r["step"] == FROM_STEP
            value, first = (r["load_max"], r["step"]) if own else (r["load_max_peak"], previous + 1)
            worst = max(worst, value)
            skip = max(skip, max(r["layer_skip_fraction_peak"]))
            if value >= BAR:
                over.append([first, r["step"], round(value, 3)])
        previous = r["step"]
    return {"worst_load_max": round(worst, 3), "intervals_at_or_over_bar": over, "skip_peak": round(skip, 4),
            "final_loss": records[-1]["loss"], "steps": records[-1]["step"]}


def markdown(rows: list[dict], args) -> str:
    lines = ["# Routing at every step, over seeds", "",
             f"`python benchmarks/routing_seeds.py --seeds {args.seeds} --experiments {args.experiments}"
             + "".join(f" {o}" for o in args.overrides) + "`: `zaya train` of each experiment, unmodified but for "
             f"`train.seed`. Worst `load_max` from step {FROM_STEP} on, at every step (the routing watch's peaks "
             f"between logged records); the bar is below {BAR:g} at every step.", "",
             "| experiment | seed | worst load_max | intervals at or over the bar (steps, peak) | skip share peak | "
             "final loss | minutes |", "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        over = ", ".join(f"{a}–{b} ({v:.2f})" for a, b, v in r["intervals_at_or_over_bar"]) or "none"
        lines.append(f"| {r['experiment']} | {r['seed']} | {r['worst_load_max']:.2f} | {over} | {r['skip_peak']:.3f} | "
                     f"{r['final_loss']:.3f} | {r['seconds'] / 60:.1f} |")
    lines += ["", "| experiment | seeds | meeting the bar | worst over seeds |", "|---|---:|---:|---:|"]
    for name in dict.fromkeys(r["experiment"] for r in rows):
        mine = [r for r in rows if r["experiment"] == name]
        ok = sum(r["worst_load_max"] < BAR for r in mine)
        lines.append(f"| {name} | {len(mine)} | {ok} | {max(r['worst_load_max'] for r in mine):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for experiment in args.experiments.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            with tempfile.TemporaryDirectory() as workdir:
                seconds = train(experiment, seed, args.overrides, workdir)
                rows.append({"experiment": experiment, "seed": seed, "seconds": round(seconds, 1), **read(workdir)})
            r = rows[-1]
            print(f"{experiment:20s} seed {seed}: worst {r['worst_load_max']:.2f}, "
                  f"{len(r['intervals_at_or_over_bar'])} intervals ≥ {BAR:g}, skip ≤ {r['skip_peak']:.3f}, "
                  f"loss {r['final_loss']:.3f} ({seconds / 60:.1f} min)", flush=True)
            with open(args.out + ".json", "w") as f:
                json.dump({"overrides": args.overrides, "rows": rows}, f, indent=1)
            with open(args.out + ".md", "w") as f:
                f.write(markdown(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
