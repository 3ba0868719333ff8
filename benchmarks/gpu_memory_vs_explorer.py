"""The explorer's memory against XLA's own buffers on a GPU, term by term, at ZAYA1-base width on one device.

Each case is `tools/gpu_check.py`'s train step (`experiments/zaya1_base_phase1.py`, bf16, the
GPU kernels, `--batch` sequences of `--seq-len` as micro-batches) with a layer count, a remat
policy or a layer pattern changed. It is compiled, not run (nothing is allocated, so a case
larger than the device still compiles), with XLA's dump on; the buffers live at the step's peak
are attributed to the explorer's terms (`explore/xla_terms.py`, as `zaya mesh --validate --terms`
does on CPU) and held against `explore/memory.predict` for the device's hardware profile.
Prints one row per case and writes JSON and Markdown; `--keep-dumps DIR` leaves the first case's
XLA reports (optimized HLO, buffer assignment, live ranges) there as a .tar.gz.

    python benchmarks/gpu_memory_vs_explorer.py --out $OUT/gpu_memory_vs_explorer.json [--hardware h200]

On a machine without a GPU, `--allow-cpu --cases tiny` checks the tool on a small shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
GIB = 2 ** 30
# name → (layers, overrides on top of gpu_check's step); the first is gpu_check's own step shape at 4 layers.
CASES = {
    "L4 full": (4, ["--config.train.remat=full"]),
    "L4 none": (4, ["--config.train.remat=none"]),
    "L4 moe": (4, ["--config.train.remat=moe"]),
    "L4 full A1": (4, ["--config.train.remat=full", "--config.train.global_batch_size=1",
                                   "--config.train.grad_accum_steps=1"]),
    "L4 LC full": (4, ["--config.train.remat=full", "--config.model.layer_pattern=LC"]),
    "L8 full": (8, ["--config.train.remat=full"]),
    "L31 full": (31, ["--config.train.remat=full"]),
}
TINY = {"tiny": (2, ["--config.train.remat=full", "--config.model.hidden_size=256", "--config.model.num_experts=4",
                     "--config.model.moe_intermediate_size=256", "--config.model.vocab_size=1024"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON path; the Markdown table goes beside it")
    p.add_argument("--hardware", default="h200", help="the explorer's hardware profile (default h200)")
    p.add_argument("--cases", default="all", help="comma-separated case names, 'all' or 'tiny'")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="sequences per step, one per micro-batch (default 4)")
    p.add_argument("--keep-dumps", metavar="DIR", help="leave the first case's XLA reports here (.tar.gz)")
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU (checks the tool, not a GPU)")
    p.add_argument("--repredict", metavar="JSON", help="no compile: this file's XLA numbers against the current "
                   "model's predictions, written to --out")
    args = p.parse_args(argv)
    if args.repredict:
        return _repredict(args)
    cases = _cases(args.cases)

    import jax

    if jax.default_backend() == "cpu" and not args.allow_cpu:
        _fail("JAX sees no GPU; pass --allow-cpu to check the tool on CPU")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = []
    for i, (name, (layers, extra)) in enumerate(cases.items()):
        try:
            row = _case(name, layers, extra, args, keep=args.keep_dumps if i == 0 else None)
        except Exception as e:  # noqa: BLE001 - one case's failure is a row, not the end of the run
            row = {"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        rows.append(row)
        print(_line(row), flush=True)
        _write(args.out, _record(rows, args.hardware))
    print(_markdown(_record(rows, args.hardware)))
    return 0


def _fail(message: str) -> None:
    print(f"gpu_memory_vs_explorer: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _repredict(args) -> int:
    with open(args.repredict, encoding="utf-8") as f:
        record = json.load(f)
    record.setdefault("hardware", args.hardware)
    for row in record["rows"]:
        if "error" not in row:
            row["predicted"] = _predicted(row["overrides"], record["hardware"])
            row["ratio"] = sum(row["xla"].values()) / sum(row["predicted"].values())
        print(_line(row))
    _write(args.out, record)
    print(_markdown(record))
    return 0


def _predicted(overrides: list[str], hardware_name: str) -> dict:
    from gpu_check import EXPERIMENT
    from zaya_jax import hardware
    from zaya_jax.experiment import load_experiment
    from zaya_jax.explore import memory
    from zaya_jax.explore.workload import Workload
    from zaya_jax.parallel.axes import MESH_AXES

    run = Workload.from_experiment(load_experiment(EXPERIMENT, overrides), hardware.profile(hardware_name), 1, 1)
    return memory.by_term(memory.predict(run, dict.fromkeys(MESH_AXES, 1)))


def _cases(spec: str) -> dict:
    if spec == "all":
        return CASES
    if spec == "tiny":
        return TINY
    unknown = [c for c in spec.split(",") if c not in CASES]
    if unknown:
        _fail(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    return {c: CASES[c] for c in spec.split(",")}


def _case(name: str, layers: int, extra: list[str], args, keep: str | None) -> dict:
    import jax

    from gpu_check import EXPERIMENT, step_overrides
    from zaya_jax.experiment import load_experiment
    from zaya_jax.explore.against_xla import memory_report
    from zaya_jax.train.program import build_program

    overrides = step_overrides(layers, args.seq_len, args.batch) + extra
    predicted = _predicted(overrides, args.hardware)
    program = build_program(load_experiment(EXPERIMENT, overrides), jax.devices()[:1])
    folder = tempfile.mkdtemp(prefix="zaya_gpu_mem_") if keep else None
    try:
        got = memory_report(program, terms=True, keep=folder, largest=12)
    finally:
        if keep:
            _keep(folder, keep)  # also when XLA's reports could not be read
    return {"case": name, "layers": layers, "overrides": overrides, "predicted": predicted, "xla": got["terms"],
            "ratio": sum(got["terms"].values()) / sum(predicted.values()),
            "xla_argument_bytes": got["argument_bytes"], "xla_temp_bytes": got["temp_bytes"],
            "compile_s": got["compile_s"], "phases": got["phases"], "largest_at_peak": got["largest_at_peak"]}


def _keep(folder: str, dest: str) -> None:
    """Every optimized-module report XLA wrote (also when they could not be read)."""
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(os.path.join(dest, "xla_dump_first_case.tar.gz"), "w:gz") as tar:
        for name in sorted(os.listdir(folder)):
            if "after_optimizations" in name and name.endswith(".txt"):
                tar.add(os.path.join(folder, name), arcname=name)


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['case']:24s} error: {row['error']}"
    misses = sorted(row["xla"], key=lambda t: -abs(row["xla"][t] - row["predicted"][t]))[:3]
    said = ", ".join(f"{t} {(row['xla'][t] - row['predicted'][t]) / GIB:+.2f}" for t in misses)
    return (f"{row['case']:24s} predicted {sum(row['predicted'].values()) / GIB:7.2f} GiB  XLA "
            f"{sum(row['xla'].values()) / GIB:7.2f} GiB  XLA/predicted {row['ratio']:.2f}  ({said})")


def _record(rows: list[dict], hardware_name: str) -> dict:
    import jax

    device = jax.devices()[0]
    return {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "hardware": hardware_name, "rows": rows}


def _write(out: str, record: dict) -> None:
    with open(out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(_markdown(record))


def _markdown(record: dict) -> str:
    rows = record["rows"]
    ok = [r for r in rows if "error" not in r]
    terms = [t for t in (ok[0]["xla"] if ok else {}) if any(r["xla"][t] or r["predicted"][t] for r in ok)]
    ratios = [r["ratio"] for r in ok]
    lines = [f"# The explorer's memory against XLA's buffers on {record['device']} (jax {record['jax']})", "",
             "One device, ZAYA1-base width (`tools/gpu_check.py`'s step: 4 micro-batches of one 4096-token "
             f"sequence unless the case says A1), compiled not run; predicted for `{record.get('hardware', 'h200')}`. "
             "GiB per term, predicted / XLA at the step's peak."
             + (f" XLA / predicted total {min(ratios):.2f}–{max(ratios):.2f}, within 10%: "
                f"{sum(abs(x - 1) <= 0.1 for x in ratios)} of {len(ratios)}." if ratios else ""), "",
             "| case | " + " | ".join(terms) + " | total | XLA / predicted |",
             "|---|" + "---:|" * (len(terms) + 2)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} |")
            continue
        cells = [f"{r['predicted'][t] / GIB:.2f} / {r['xla'][t] / GIB:.2f}" for t in terms]
        total = f"{sum(r['predicted'].values()) / GIB:.2f} / {sum(r['xla'].values()) / GIB:.2f}"
        lines.append(f"| {r['case']} | " + " | ".join(cells) + f" | {total} | {r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
