"""Every stored drawn-shapes report (`benchmarks/explorer_drawn_shapes*.json`) against today's memory
model: per set and per compiler, the layouts within 10% of XLA's total, and the most a model
exact about every byte live at XLA's peak could reach.

Each report keeps XLA's side as compiled; the prediction is made again (`explorer_drawn_shapes.
repredicted`), so a model change shows here without compiling anything. XLA's total is the bytes
live at its peak plus the gaps its heap packing leaves (`fragmentation` in `explore/xla_terms.py`),
which no model of what is live knows. The *ceiling* counts the layouts a model exact about the live
bytes would put within 10% if it priced the gaps as one share of the total, the best share for the
compiler's layouts (`GAP_SHARES`): what the gaps alone leave out of reach. On XLA:CPU that is none
(a share of 0.085 puts all 408 stored layouts within 10%, the median, 0.029, 399): the misses
are the live bytes the model gets wrong.

    python benchmarks/drawn_shapes_summary.py   # writes benchmarks/drawn_shapes_summary.{json,md}

`tests/test_held_out.py` checks that the committed summary is today's model's and that
`memory.UNDERESTIMATE` is its largest XLA / predicted per compiler.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from explorer_drawn_shapes import repredicted  # noqa: E402

# The reports compiled as a device compiles for its own memory, by compiler (`memory.UNDERESTIMATE`'s
# keys), told by the report's device: a mocked GPU and a roomy deviceless one spend memory they have
# to spare on steps of a few MiB, and are listed but left out of the compilers' totals. Steps sized
# for the GPU (`--widths zaya1`) are compiled for its own HBM, as a run is, and again as if it were nearly
# full (`--nearly-full`: the same layouts, as one at the edge of fitting is scheduled).
COMPILERS = {"8 fake CPU devices": "cpu", "scheduled as if nearly full": "gpu", "steps sized for their HBM": "gpu"}
WITHIN = 0.10
GAP_SHARES = [i / 200 for i in range(41)]  # 0, 0.005, ..., 0.2: the gap shares the ceiling tries


def compiler_of(report: dict) -> str | None:
    return next((c for words, c in COMPILERS.items() if report["device"].endswith(words)), None)


def gap_share(row: dict) -> float:
    """The share of XLA's total that its heap's gaps are at the peak."""
    return row["xla"]["fragmentation"] / sum(row["xla"].values())


def within(ratio: float) -> bool:
    return abs(ratio - 1) <= WITHIN


def ceiling_ratio(row: dict, typical_gap: float) -> float:
    """XLA's total over what a model exact about the live bytes, with gaps of `typical_gap`, predicts."""
    total = sum(row["xla"].values())
    return total / ((total - row["xla"]["fragmentation"]) / (1 - typical_gap))


def tally(rows: list[dict], typical_gap: float) -> dict:
    """Counts over rows that carry their XLA terms and today's ratio."""
    ratios = [r["ratio"] for r in rows]
    return {"layouts": len(rows), "within": sum(map(within, ratios)),
            "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
            "ceiling": sum(within(ceiling_ratio(r, typical_gap)) for r in rows)}


def summarize(paths: list[str]) -> dict:
    """Per set and per compiler, the counts `tally` makes; the ceiling at the compiler's best gap share (a
    set of no compiler's: its own)."""
    reports = {os.path.basename(p): repredicted(_load(p)) for p in paths}
    by_compiler: dict[str, list[dict]] = {}
    for report in reports.values():
        if compiler_of(report):
            by_compiler.setdefault(compiler_of(report), []).extend(report["rows"])
    best = {c: best_gap_share(rows) for c, rows in by_compiler.items()}
    sets = {name: {"device": r["device"], "compiler": compiler_of(r),
                   **tally(r["rows"], best[compiler_of(r)] if compiler_of(r) else best_gap_share(r["rows"]))}
            for name, r in reports.items()}
    compilers = {}
    for c, rows in by_compiler.items():
        gaps = sorted(map(gap_share, rows))
        compilers[c] = {**tally(rows, best[c]), "ceiling_gap": best[c], "median_gap": round(statistics.median(gaps), 4),
                        "gap_p90": round(gaps[int(0.9 * len(gaps))], 4), "gap_max": round(gaps[-1], 4),
                        "underestimate": math.ceil(max(r["ratio"] for r in rows) * 100) / 100}
    return {"sets": sets, "compilers": compilers}


def best_gap_share(rows: list[dict]) -> float:
    """The smallest gap share (of `GAP_SHARES`) that puts the most of `rows` within 10% with their live bytes exact."""
    return max(GAP_SHARES, key=lambda g: (sum(within(ceiling_ratio(r, g)) for r in rows), -g))


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"drawn_shapes_summary: error: {path}: not a drawn-shapes report ({e})", file=sys.stderr)
        raise SystemExit(2)


def markdown(summary: dict) -> str:
    lines = ["# The explorer's memory on every drawn set, predicted by today's model", "",
             "Within 10%: layouts whose XLA / predicted total is 0.90–1.10. Ceiling: those a model exact about "
             "every byte live at XLA's peak would put there, pricing the heap's gaps as the one share of the total "
             "that puts the most there (`benchmarks/drawn_shapes_summary.py`).", "",
             "| compiler | layouts | within 10% | XLA / predicted | ceiling (at gap share) "
             "| gap share: median, 90th pct, max | underestimate |", "|---|---:|---:|---|---:|---|---:|"]
    for c, t in summary["compilers"].items():
        lines.append(f"| {c} | {t['layouts']} | {t['within']} | {t['ratio_min']:.2f}–{t['ratio_max']:.2f} | "
                     f"{t['ceiling']} ({t['ceiling_gap']:.3f}) | {t['median_gap']:.3f}, {t['gap_p90']:.3f}, "
                     f"{t['gap_max']:.3f} | {t['underestimate']:.2f} |")
    lines += ["", "| set | device | layouts | within 10% | XLA / predicted | ceiling |", "|---|---|---:|---:|---|---:|"]
    for name, t in summary["sets"].items():
        lines.append(f"| {name} | {t['device']} | {t['layouts']} | {t['within']} | "
                     f"{t['ratio_min']:.2f}–{t['ratio_max']:.2f} | {t['ceiling']} |")
    return "\n".join(lines) + "\n"


def report_paths() -> list[str]:
    return sorted(glob.glob(os.path.join(HERE, "explorer_drawn_shapes*.json")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "drawn_shapes_summary.json"),
                   help="JSON path; the Markdown table goes beside it (default benchmarks/drawn_shapes_summary.json)")
    args = p.parse_args(argv)
    summary = summarize(report_paths())
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    text = markdown(summary)
    with open(os.path.splitext(args.out)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
