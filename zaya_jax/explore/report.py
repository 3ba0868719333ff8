"""The explorer's outputs: a readable table, the JSON list, and a memory-vs-step-time plot."""

from __future__ import annotations

import json
import os

from zaya_jax.errors import ZayaError
from zaya_jax.explore.explorer import GIB, Prediction

MIB = 2 ** 20
from zaya_jax.explore.placement import describe
from zaya_jax.explore.workload import Workload


def header(run: Workload, shown: int, total: int, fitting: int, tight: int = 0) -> str:
    cfg, hw = run.cfg, run.hw
    tokens = run.global_batch * run.seq_len
    tight_note = f" ({tight} of them tight: within the prediction's measured error of the limit)" if tight else ""
    return (f"{total} layouts of {run.nodes} x {run.gpus_per_node} {hw.name} ({run.devices} devices); {fitting} fit in "
            f"{hw.hbm_gb:g} GB{tight_note}. Model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts; "
            f"{run.seq_len}-token sequences, {run.global_batch} per step ({tokens / 1e6:.1f}M tokens) in {run.grad_accum} "
            f"micro-batch(es), remat {run.remat}, {cfg.compute_dtype}. Best {shown} (GiB per device):"
            + (" [nominal hardware numbers]" if hw.nominal else ""))


def table(predictions: list[Prediction], xla: dict | None = None) -> str:
    cols = ["#", "layout", "fits", "params", "grads", "optim", "activ", "total", "step s", "MFU", "largest exposed comm"]
    if xla:
        cols += ["XLA args", "XLA temp", "args/pred"]
    rows = []
    for i, p in enumerate(predictions, 1):
        m, t = p.memory, p.time
        comm = max(t.exposed_comm_s.items(), key=lambda kv: kv[1], default=("-", 0.0))
        row = [str(i), describe(p.layout), fit_word(p), *(f"{v / GIB:.2f}" for v in (
            m.param_bytes, m.grad_bytes, m.optimizer_bytes, m.activation_bytes, m.total_bytes)),
            f"{t.step_time_s:.3g}", f"{t.mfu:.1%}", f"{comm[0]} {comm[1]:.3g}s" if comm[1] else "-"]
        if xla:
            row += _xla_cells(xla.get(describe(p.layout)), p)
        rows.append(row)
    return _aligned(cols, rows, left=(1, 10))


def fit_word(p: Prediction) -> str:
    """The table's `fits` cell: yes, no, or tight (fits as predicted, within the model's largest
    measured underestimate of the limit: check it with --validate)."""
    return "tight" if p.tight else "yes" if p.fits else "no"


def tight_note(best: Prediction, run: Workload) -> str:
    """What the `best:` line adds when the best layout is tight."""
    from zaya_jax.explore.memory import underestimate

    return (f"; tight: XLA has needed up to {underestimate(run):.2f}x the prediction on drawn shapes, and this "
            "layout would not fit at that: check it with --validate") if best.tight else ""


def compiler_note(jax_version: str) -> str:
    """What a CPU validation adds when this jax is not the one the CPU terms were read on; "" when it is."""
    from zaya_jax.explore.memory import CPU_TERMS_JAX

    if tuple(int(part) for part in jax_version.split(".")[:2]) == CPU_TERMS_JAX:
        return ""
    read_on = ".".join(map(str, CPU_TERMS_JAX))
    return (f"note: XLA here is jax {jax_version}'s; the explorer's CPU terms were read on jax {read_on}'s XLA:CPU, "
            "which schedules the step differently (up to 1.35x apart on a small fsdp 8 step): "
            "see docs/mesh_explorer.md, \"The XLA these numbers were read on\"")


def terms_table(predictions: list[Prediction], xla: dict) -> str:
    """Per validated layout, each memory term predicted against XLA's bytes at the step's peak
    (`xla_terms`), MiB per device; `kernel` and `xla_copies` have no predicted part."""
    from zaya_jax.explore.memory import by_term
    from zaya_jax.explore.xla_terms import CPU_ONLY_TERMS, TERMS

    cols = ["layout", "term", "predicted MiB", "XLA MiB", "XLA/pred"]
    rows = []
    for p in predictions:
        result = (xla or {}).get(describe(p.layout)) or {}
        if "terms" not in result:
            continue
        predicted = by_term(p.memory)
        for term in TERMS:
            want, got = predicted[term], result["terms"][term]
            if not (want or got):
                continue
            name = term + (" (CPU only)" if term in CPU_ONLY_TERMS else "")
            rows.append([describe(p.layout), name, f"{want / MIB:.2f}", f"{got / MIB:.2f}",
                         f"{got / want:.2f}" if want else "-"])
        total = sum(predicted.values())
        rows.append([describe(p.layout), "total", f"{total / MIB:.2f}", f"{sum(result['terms'].values()) / MIB:.2f}",
                     f"{sum(result['terms'].values()) / total:.2f}"])
    return _aligned(cols, rows, left=(0, 1))


def _aligned(cols: list[str], rows: list[list[str]], left: tuple[int, ...]) -> str:
    """A plain-text table: columns as wide as their widest cell, the `left` ones left-aligned."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(cols)] + [line(r) for r in rows])


def _xla_cells(result: dict | None, p: Prediction) -> list[str]:
    if not result:
        return ["-", "-", "-"]
    if "error" in result:
        return ["not compiled", "", ""]
    state = p.memory.param_bytes + p.memory.optimizer_bytes
    return [f"{result['argument_bytes'] / GIB:.2f}", f"{result['temp_bytes'] / GIB:.2f}",
            f"{result['argument_bytes'] / state:.3f}"]


def write_json(path: str, predictions: list[Prediction], xla: dict | None = None) -> None:
    rows = []
    for p in predictions:
        row = p.to_json()
        if xla and describe(p.layout) in xla:
            row["xla"] = xla[describe(p.layout)]
        rows.append(row)
    # One layout per line: a thousand layouts stay greppable and diffable.
    write_json_lines(path, rows)


def write_plot(path: str, predictions: list[Prediction], run: Workload) -> None:
    """Memory per device against step time, one point per layout; the HBM limit as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ZayaError("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    for word, colour, label in (("yes", "tab:blue", "fits"), ("tight", "tab:orange", "tight (--validate it)"),
                                ("no", "tab:gray", "does not fit")):
        pts = [p for p in predictions if fit_word(p) == word]
        ax.scatter([p.time.step_time_s for p in pts], [p.memory.total_bytes / GIB for p in pts], s=12, c=colour,
                   label=label)
    for p in [p for p in predictions if p.fits][:5]:
        ax.annotate(describe(p.layout), (p.time.step_time_s, p.memory.total_bytes / GIB), fontsize=7)
    ax.axhline(run.hw.hbm_gb * 1e9 / GIB, color="tab:red", lw=1, label=f"{run.hw.name} HBM")
    ax.set_xscale("log")
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("predicted memory per device (GiB)")
    ax.set_title(f"{run.nodes} x {run.gpus_per_node} {run.hw.name}, {run.seq_len} tokens x {run.global_batch}")
    ax.legend(fontsize=8)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)


def check_writable(path: str) -> None:
    """Fail before the work, not after it, when an output's folder is missing."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ZayaError(f"cannot write {path}: folder {folder} does not exist")


def write_json_lines(path: str, records: list[dict]) -> None:
    """A JSON list with one record a line (easy to read, diff and concatenate), written atomically."""
    write_atomic(path, lambda f: f.write("[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n"))


def write_atomic(path: str, dump, binary: bool = False) -> None:
    """Write through a temporary file, so a failure never leaves half a file at `path`."""
    check_writable(path)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8") as f:
            dump(f)
        os.replace(tmp, path)
    except OSError as e:
        raise ZayaError(f"cannot write {path}: {e.strerror}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
