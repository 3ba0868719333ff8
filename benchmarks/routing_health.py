"""How even the default runs route: per layer, the busiest expert's share × E at every logged step.

    python benchmarks/routing_health.py                      # trains tiny_cpu and tiny_hybrid_cpu (~4 min each)
    python benchmarks/routing_health.py NAME=WORKDIR ...     # summarises finished runs instead

Prints a table (worst layer `load_max` from step 10 on, the logged steps where a layer was at or
above 2, held-out losses) and writes benchmarks/routing_health.json. The bar: every layer below 2
at every logged step from step 10, and a final loss no worse than the other recipes'
(benchmarks/routing_health.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = {"after": "experiments/tiny_cpu.py", "hybrid_after": "experiments/tiny_hybrid_cpu.py"}


def train(config: str, workdir: str) -> None:
    subprocess.run([sys.executable, "-m", "zaya_jax", "train", f"--config={os.path.join(ROOT, config)}",
                    f"--workdir={workdir}", "--config.train.progress=false"], check=True, cwd=ROOT)


def summary(workdir: str) -> dict:
    steps, evals = {}, {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "expert_load" in record:
                load = np.asarray(record["expert_load"])[:, :-1]
                share = load / np.maximum(load.sum(1, keepdims=True), 1e-9)
                steps[record["step"]] = {"loss": record["loss"],
                                         "layer_load_max": (share.max(1) * share.shape[1]).round(3).tolist()}
            if "eval_loss" in record:
                evals[record["step"]] = record["eval_loss"]
    late = {s: max(v["layer_load_max"]) for s, v in steps.items() if s >= 10}
    return {"worst_load_max_from_step_10": max(late.values()), "steps_at_or_above_2": [s for s, m in late.items() if m >= 2],
            "eval_loss": evals, "final_loss": steps[max(steps)]["loss"], "steps": steps}


def main(argv: list[str]) -> None:
    named = dict(arg.split("=", 1) for arg in argv) if argv else None
    with tempfile.TemporaryDirectory() as tmp:
        if named is None:
            named = {name: os.path.join(tmp, name) for name in RUNS}
            for name, workdir in named.items():
                train(RUNS[name], workdir)
        results = {name: summary(workdir) for name, workdir in named.items()}
    print(f"{'run':14s} {'worst load_max ≥ step 10':>25s} {'logged steps ≥ 2':>18s} {'final loss':>10s}  held-out")
    for name, r in results.items():
        evals = " / ".join(f"{v:.3f}" for v in r["eval_loss"].values())
        print(f"{name:14s} {r['worst_load_max_from_step_10']:25.2f} {len(r['steps_at_or_above_2']):18d} "
              f"{r['final_loss']:10.3f}  {evals}")
    with open(os.path.join(HERE, "routing_health.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
