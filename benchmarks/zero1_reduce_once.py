"""Before / after reducing gradients once per step, ZeRO-1 and distributed Newton–Schulz, in one run.

For the ZAYA1-base phase-1 configuration (`experiments/zaya1_base_phase1.py`, 4 micro-batches):
XLA's per-device bytes of the train step compiled for one 8-GPU node (8 fake CPU devices, abstract
shapes) under `data 8` and `fsdp 8`, and the explorer's step time on one node (8 MI300X) and on
ZAYA1's 128 x 8 MI300X for Zyphra's layout (pure data parallel) and each version's best layout.
"Before" is the code at `--before` (a git revision without those three changes; the JSON names the
one it was measured against), checked out into a temporary git worktree and run in a child
process; "after" is this checkout.

    python benchmarks/zero1_reduce_once.py --before=REVISION --out=benchmarks/zero1_reduce_once.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "experiments/zaya1_base_phase1.py"
NODE = ["--config.train.global_batch_size=32"]  # one node: 4 micro-batches of 8 sequences
LAYOUTS = {"data 8": {"data": 8, "fsdp": 1}, "fsdp 8": {"data": 1, "fsdp": 8}}
GIB = 2 ** 30

# Runs in the child, against whichever checkout is on its path.
CHILD = r"""
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
from zaya_jax import hardware
from zaya_jax.experiment import load_experiment
from zaya_jax.explore.collectives import Network
from zaya_jax.explore.explorer import explore
from zaya_jax.explore.workload import Workload
from zaya_jax.explore.against_xla import memory_report
from zaya_jax.train.program import build_program
config, node, layouts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {"xla": {}, "explorer": {}}
for name, mesh in layouts.items():
    overrides = node + [f"--config.mesh.{a}={n}" for a, n in mesh.items()]
    report = memory_report(build_program(load_experiment(config, overrides)))
    out["xla"][name] = {k: report[k] for k in ("argument_bytes", "temp_bytes")}
hw = hardware.profile("mi300x")
for nodes, extra in ((1, node), (128, [])):
    run = Workload.from_experiment(load_experiment(config, extra), hw, nodes, 8)
    ranked = explore(run)
    data = next(p for p in ranked if p.layout["data"] == run.devices)
    best = ranked[0]
    out["explorer"][f"{nodes} x 8"] = {
        "data parallel": {"step_s": data.time.step_time_s, "gib": data.memory.total_bytes / 2 ** 30,
                          "rank": ranked.index(data) + 1},
        "best": {"layout": " x ".join(f"{a} {n}" for a, n in best.layout.items() if n > 1),
                 "step_s": best.time.step_time_s, "gib": best.memory.total_bytes / 2 ** 30},
        "layouts": len(ranked)}
print("RESULT " + json.dumps(out))
"""


def measure(checkout: str) -> dict:
    env = dict(os.environ, PYTHONPATH=checkout)
    done = subprocess.run([sys.executable, "-c", CHILD, CONFIG, json.dumps(NODE), json.dumps(LAYOUTS)],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"measuring {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def table(before: dict, after: dict) -> list[str]:
    rows = ["| | before | after | after / before |", "|---|---:|---:|---:|"]
    for name in LAYOUTS:
        for key, label in (("argument_bytes", "arguments"), ("temp_bytes", "temporaries")):
            b, a = before["xla"][name][key] / GIB, after["xla"][name][key] / GIB
            rows.append(f"| XLA {label}, {name} (GiB/device) | {b:.2f} | {a:.2f} | {a / b:.2f} |")
    for where in before["explorer"]:
        b, a = before["explorer"][where], after["explorer"][where]
        bd, ad = b["data parallel"], a["data parallel"]
        rows.append(f"| explorer, {where} MI300X, data parallel: step s | {bd['step_s']:.3f} | {ad['step_s']:.3f} "
                    f"| {ad['step_s'] / bd['step_s']:.2f} |")
        rows.append(f"| ... its memory GiB/device, rank of {a['layouts']} | {bd['gib']:.1f}, #{bd['rank']} | "
                    f"{ad['gib']:.1f}, #{ad['rank']} | |")
        rows.append(f"| explorer, {where} MI300X, best: step s | {b['best']['step_s']:.3f} ({b['best']['layout']}) "
                    f"| {a['best']['step_s']:.3f} ({a['best']['layout']}) | {a['best']['step_s'] / b['best']['step_s']:.2f} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True,
                        help="git revision to compare against (zero1_reduce_once.json names the one measured)")
    parser.add_argument("--out", help="write both measurements as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "before")
        subprocess.run(["git", "worktree", "add", "--detach", tree, args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            print(f"measuring {args.before} ...", file=sys.stderr, flush=True)
            before = measure(tree)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
    print("measuring this checkout ...", file=sys.stderr, flush=True)
    after = measure(ROOT)
    print("\n".join(table(before, after)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"before": args.before, "before_result": before, "after": after}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
