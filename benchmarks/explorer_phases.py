"""The explorer's memory phase by phase: each phase of a drawn layout's step at its own peak, against
the model's price for that phase.

The model prices three phases of a step (`memory.phases`: the loss, the blocks' backward, the
update) and predicts the largest. XLA's peak is one point of its schedule; the drawn-shapes reports
(`benchmarks/explorer_drawn_shapes.py`) compare the two totals there. This script compiles the
layouts of one such report again with XLA's buffer dump kept, finds each phase's own peak in the
schedule (`xla_terms.phase_peaks`: the forward, the loss, the backward, the update, as spans
between their boundaries) and writes, per layout, XLA's bytes at each phase's peak beside the
model's for it, term by term. A row whose step's peak is not the report's (within `SAME` of it)
was compiled on another program than the report's and is marked.

    .venv-cuda/bin/python benchmarks/explorer_phases.py benchmarks/explorer_drawn_shapes_h100_zaya1_seeds24_35.json \\
        --gpu-target benchmarks/gpu_targets/h100_sxm.txtpb --out benchmarks/explorer_phases_h100_zaya1_seeds24_35.json

The report is rewritten after every layout. A report of fake CPU devices is refused: XLA:CPU
unrolls the loss's chunk loops on the drawn toy vocabularies and interleaves them with the blocks'
backward (seed 205 under `fsdp 4 x expert 2`: the loss's matmuls at points 486–2131 of a
3,227-point schedule, the blocks' backward at 261–2329), so its phases are no spans of the
schedule to compare with; so is a mocked GPU's (it needs the GPU it was compiled on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import explorer_drawn_shapes as drawn  # noqa: E402

GIB = 2 ** 30
MODEL_PHASES = ("loss", "backward", "update")  # the phases `memory.phases` prices
DEVICELESS = "deviceless"  # how a drawn report compiled with --gpu-target names its devices
SAME = 1e-4  # a step's peak within this share of the report's: the same program (a scalar's bytes may differ)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("report", help="a drawn-shapes report (benchmarks/explorer_drawn_shapes*.json)")
    p.add_argument("--out", required=True, help="JSON path; the Markdown table goes beside it")
    p.add_argument("--gpu-target", metavar="FILE", required=True,
                   help="the XLA GPU target config the report was compiled for")
    args = p.parse_args(argv)
    try:
        with open(args.report, encoding="utf-8") as f:
            report = json.load(f)
        rows_in, hardware_name = report["rows"], report["hardware"]
    except (OSError, ValueError, KeyError) as e:
        _fail(f"{args.report}: not a drawn-shapes report ({e})")
    if DEVICELESS not in report["device"]:
        _fail(f"{args.report}: phase by phase is for a set compiled for deviceless GPUs (this one: {report['device']}); "
              "XLA:CPU interleaves the loss with the backward, see --help")
    os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin then registers without looking for a driver
    import jax

    from zaya_jax import hardware

    roomy = report["device"].endswith(drawn.SIZED)
    devices = drawn._deviceless_gpus(args.gpu_target, pressed=not roomy)
    hw = hardware.profile(hardware_name)
    header = {"report": os.path.basename(args.report), "device": report["device"], "jax": jax.__version__}
    rows = []
    for row in rows_in:
        start = time.perf_counter()
        got = phases_of(report, row, hw, devices[:8])
        if got is None:
            continue
        got["compile_s"] = round(time.perf_counter() - start, 1)
        rows.append(got)
        print(f"seed {row['seed']:2d}  {row['layout']:30s} " + "  ".join(
            f"{ph} {got['ratio'][ph]:.2f}" for ph in MODEL_PHASES if ph in got["ratio"]) + f"  ({got['compile_s']:.0f} s)",
            flush=True)
        _write(args.out, header | {"rows": rows}, quiet=True)
    _write(args.out, header | {"rows": rows})
    return 0


def _fail(message: str) -> None:
    print(f"explorer_phases: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def phases_of(report: dict, row: dict, hw, devices) -> dict | None:
    """One row compiled again: XLA's terms at each phase's peak and the model's per phase."""
    from zaya_jax.explore import memory, xla_terms
    from zaya_jax.explore.against_xla import compile_layout

    config = os.path.join(drawn.ROOT, drawn.report_config(report))
    sizes = drawn._sizes(row["layout"])
    with tempfile.TemporaryDirectory(prefix="zaya_phases_") as folder:
        got = compile_layout(config, row["overrides"], sizes, devices, terms=True, keep=folder)
        if "error" in got:
            print(f"seed {row['seed']} {row['layout']}: {got['error']}", flush=True)
            return None
        by_phase = xla_terms.phase_peaks(*xla_terms.dump_files(folder))
    xla = {ph: _terms(buffers) for ph, buffers in by_phase.items()}
    run = drawn._workload(row["overrides"], hw, drawn.report_config(report))
    model = {ph: memory.by_term(m) for ph, m in memory.phases(run, sizes).items()}
    live = sum(row["xla"].values()) - row["xla"]["fragmentation"]
    return {"seed": row["seed"], "layout": row["layout"], "overrides": row["overrides"],
            "same_program": abs(max(sum(t.values()) for t in xla.values()) - live) <= SAME * live,
            "xla": xla, "predicted": model,
            "ratio": {ph: sum(xla[ph].values()) / sum(model[ph].values()) for ph in MODEL_PHASES if ph in xla}}


def _terms(buffers) -> dict[str, int]:
    from zaya_jax.explore import xla_terms

    return xla_terms.attribute(buffers, sum(b.bytes for b in buffers))


def _write(out: str, report: dict, quiet: bool = False) -> None:
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    if not quiet:
        print(text)


def markdown(report: dict) -> str:
    rows = report["rows"]
    lines = [f"# The explorer's memory phase by phase ({report['device']}, jax {report['jax']})", "",
             f"Each layout of `{report['report']}` compiled again; XLA's bytes at each phase's own peak "
             "(`xla_terms.phase_peaks`) against the model's price for that phase (`memory.phases`), GiB. "
             "`peak` is the phase XLA's step peaks in, `model` the one the model predicts; * a row whose "
             "step's peak differs from the report's (another program).", ""]
    for ph in MODEL_PHASES:
        ratios = [r["ratio"][ph] for r in rows if ph in r["ratio"]]
        if ratios:
            inside = sum(abs(x - 1) <= 0.10 for x in ratios)
            lines.append(f"- {ph}: XLA / predicted {min(ratios):.2f}–{max(ratios):.2f}, within 10% {inside} of {len(ratios)}")
    agree = sum(_peak_phase(r["xla"]) == _peak_phase(r["predicted"]) for r in rows)
    lines += [f"- the model names XLA's peak phase in {agree} of {len(rows)}", "",
              "| seed | layout | peak | model | " + " | ".join(f"{ph} XLA / predicted" for ph in MODEL_PHASES)
              + " | forward XLA |", "|---:|---|---|---|" + "---:|" * (len(MODEL_PHASES) + 1)]
    for r in rows:
        cells = [f"{_gib(r['xla'].get(ph))} / {_gib(r['predicted'][ph])} ({r['ratio'][ph]:.2f})" if ph in r["ratio"]
                 else "–" for ph in MODEL_PHASES]
        mark = "" if r["same_program"] else " *"
        lines.append(f"| {r['seed']}{mark} | {r['layout']} | {_peak_phase(r['xla'])} | {_peak_phase(r['predicted'])} | "
                     + " | ".join(cells) + f" | {_gib(r['xla'].get('forward'))} |")
    return "\n".join(lines) + "\n"


def _peak_phase(by_phase: dict) -> str:
    return max(by_phase, key=lambda ph: sum(by_phase[ph].values()))


def _gib(terms: dict | None) -> str:
    return "–" if terms is None else f"{sum(terms.values()) / GIB:.2f}"


if __name__ == "__main__":
    sys.exit(main())
