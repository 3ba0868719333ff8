"""Where a step's overload comes from: the balancer's own error, the optimizer step's move of the router, the batch.

    python benchmarks/routing_update_drift.py [--experiment zaya1_routing_cpu] [--steps 40]
        [--balancers spread,solve] [--out benchmarks/routing_update_drift] [--config.KEY=VALUE ...]

For each balancer, trains the experiment in-process (its own devices, `train.cpu_devices`) and,
after every step t, routes batches again with the state before and after it. Per step, the
worst layer's busiest expert (its share of the expert-routed tokens × E; 1 is even):

- `seen`: what step t's own routing was (old weights, old biases, batch t);
- `balanced`: batch t through the old weights with the biases the balancer just set: how well the
  balancer evened what it measured (a balancer that re-routes measures the new weights instead);
- `moved`: batch t through the new weights and new biases: what the optimizer step did to it;
- `next`: batch t+1 through the new weights and biases: what step t+1 then sees (`moved` and
  `next` differ by the batch alone).

Prints a table every 5 steps and a summary, and writes JSON and Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COLUMNS = ("seen", "balanced", "moved", "next")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="zaya1_routing_cpu")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--balancers", default="spread,solve")
    p.add_argument("--out", default=os.path.join(HERE, "routing_update_drift"))
    args, overrides = p.parse_known_args(argv)
    if args.steps < 10:
        p.error(f"--steps must be at least 10 (the summary reads steps 10 on), got {args.steps}")
    args.overrides = overrides
    return args


def trace(config: str, overrides: list[str], steps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from zaya_jax import cpu_host
    from zaya_jax.experiment import load_experiment
    from zaya_jax.train import balancing
    from zaya_jax.train.loop import build_data
    from zaya_jax.train.program import build_program

    exp = load_experiment(config, overrides)
    cpu_host.prepare(exp.config.train.cpu_devices)  # as `zaya train` does, before JAX starts
    program = build_program(exp)
    iterator = build_data(exp).train_iterator(program.data_lanes())
    modeldef, experts = program.modeldef, program.modeldef.cfg.num_experts

    @jax.jit
    def load_max(params, biases, batch):
        rows = {k: v.reshape((-1,) + v.shape[2:]) for k, v in batch.items()}
        _, routing = modeldef.merge(params, biases).hidden_states(rows["inputs"], rows["segment_ids"], rows["positions"])
        counts = balancing.expert_counts(routing.expert, rows["segment_ids"] > 0, experts)
        return jnp.max(balancing.load_summary(counts)["layer_load_max"])

    step, state = program.jitted_train_step(), program.init()
    batch, rows = program.place_batch(next(iterator)), []
    try:
        for t in range(1, steps + 1):
            following = program.place_batch(next(iterator))
            old = jax.tree.map(jnp.copy, (state.params, state.biases))  # the step donates its state
            state, metrics = step(state, batch)
            rows.append({"step": t, "loss": float(metrics["loss"]),
                         "seen": float(load_max(*old, batch)),
                         "balanced": float(load_max(old[0], state.biases, batch)),
                         "moved": float(load_max(state.params, state.biases, batch)),
                         "next": float(load_max(state.params, state.biases, following))})
            batch = following
            if t % 5 == 0:
                print(f"  step {t:3d}: " + "  ".join(f"{c} {rows[-1][c]:.2f}" for c in COLUMNS), flush=True)
    finally:
        iterator.close()
    return rows


def summary(rows: list[dict], from_step: int = 10) -> dict:
    late = [r for r in rows if r["step"] >= from_step]
    return {c: {"mean": sum(r[c] for r in late) / len(late), "max": max(r[c] for r in late),
                "steps_at_or_over_2": sum(r[c] >= 2 for r in late)} for c in COLUMNS}


def markdown(results: dict, args) -> str:
    lines = ["# Where a step's overload comes from", "",
             f"`python benchmarks/routing_update_drift.py --experiment {args.experiment} --steps {args.steps} "
             f"--balancers {args.balancers}" + "".join(f" {o}" for o in args.overrides) + "`. "
             "The worst layer's busiest expert (share × E) at steps "
             f"10–{args.steps}: `seen` what the step routed; `balanced` the same batch and weights with the biases the "
             "balancer set; `moved` the same batch after the optimizer step; `next` the next batch, as the next step "
             "sees it (the script's docstring has the details).", "",
             "| balancer | column | mean | max | steps ≥ 2 |", "|---|---|---:|---:|---:|"]
    for name, r in results.items():
        for c in COLUMNS:
            s = r["summary"][c]
            lines.append(f"| {name} | {c} | {s['mean']:.2f} | {s['max']:.2f} | {s['steps_at_or_over_2']} |")
    lines += ["", "Per step (worst layer):", "", "| step | " + " | ".join(
        f"{n} {c}" for n in results for c in COLUMNS) + " |", "|---:|" + "---:|" * (len(results) * len(COLUMNS))]
    for i in range(args.steps):
        cells = [f"{results[n]['rows'][i][c]:.2f}" for n in results for c in COLUMNS]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    config = os.path.join(ROOT, "experiments", f"{args.experiment}.py")
    results = {}
    for name in args.balancers.split(","):
        print(f"{args.experiment}, optim.balancer={name}", flush=True)
        rows = trace(config, [*args.overrides, f"--config.optim.balancer={name}"], args.steps)
        results[name] = {"rows": rows, "summary": summary(rows)}
        print("  from step 10: " + ", ".join(f"{c} max {s['max']:.2f} ({s['steps_at_or_over_2']} steps ≥ 2)"
                                           for c, s in results[name]["summary"].items()), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"experiment": args.experiment, "overrides": args.overrides, "results": results}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
