"""The explorer's memory on model shapes it was not fitted to, term by term against XLA's buffers.

For each seed, `zaya_jax.explore.held_out.draw` gives a model shape (hidden, layers, heads and KV
groups, head width, experts and their width, sequence length, micro-batches, remat policy, hybrid
pattern) on top of `experiments/tiny_cpu.py`; `--layouts` of its 8-device layouts are picked with
the same seed, each compiled on 8 fake CPU devices with XLA's buffer dump on, and XLA's bytes at
the step's peak attributed to the explorer's terms (`explore/xla_terms.py`, as `zaya mesh --validate
--terms` prints them). Prints one row per layout (XLA / predicted total, the largest misses) and
the worst cases, and writes JSON and Markdown.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/explorer_drawn_shapes.py --first-seed 12 --seeds 12 --out=benchmarks/explorer_drawn_shapes.json

On a machine with one GPU, `--mock-gpus` presents it as 8 devices whose collectives do nothing
(XLA's mocked NCCL: JAX's `mock_num_gpu_processes`, 8 mocked processes of one GPU each, as JAX's
own mock-GPU test sets it): each layout is compiled for the GPU, with the GPU's own kernels, and
predicted for the device's hardware profile (first runs: `benchmarks/explorer_drawn_shapes_h200_mock_seeds24_47*.md`,
with `XLA_FLAGS=--xla_gpu_autotune_level=0` so that it ran beside `tools/gpu_check.py`). Nothing runs, so the mocked collectives never matter: only the compiled
program's buffers are read. The report is rewritten after every layout, so a run stopped at a
time limit keeps what it compiled.

With no GPU at all, `--gpu-target FILE` compiles for 8 GPUs that an XLA GPU target config describes
(`benchmarks/gpu_targets/h100_sxm.txtpb`: the device's limits, compute capability and kind) through
JAX's deviceless AOT compilation (`jax.experimental.topologies`): XLA's own GPU compiler, Pallas
kernels lowered to Triton and assembled by ptxas, its buffer assignment read as above. The target's
HBM is given as 1 MiB (`_pressed`): XLA's GPU scheduler overlaps freely while a step is far below
its memory limit and orders for memory near it, and the prediction is for a layout near the HBM's
size, where whether it fits is decided (seeds 24–35 under the H100's own 80 GB:
`explorer_drawn_shapes_h100_roomy_seeds24_35.md`, a step of 13 MiB peaking at 18, every layer's
Newton–Schulz at once). A real GPU (`--mock-gpus`) is compiled with its own HBM. It needs
JAX's CUDA plugin beside the same jax, best in a venv of its own (it is 5 GB; no driver is used):

    python -m venv .venv-cuda && .venv-cuda/bin/pip install -e . "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
    .venv-cuda/bin/python benchmarks/explorer_drawn_shapes.py --gpu-target benchmarks/gpu_targets/h100_sxm.txtpb \\
        --first-seed 24 --seeds 12 --out benchmarks/explorer_drawn_shapes_h100_seeds24_35.json

`--widths zaya1` draws at the scale the explorer is for, on top of `experiments/zaya1_base_phase1.py`
(8–40 layers of 1K–2.5K hidden, 2K–8K tokens, ZAYA1's vocabulary: `explore/held_out.py`), and
compiles only layouts the explorer says fit the GPU's memory, for the GPU with its own HBM: these
steps are sized for it, so XLA schedules them as it would a real run's (each compile is 20–40 s here).

`--nearly-full REPORT` compiles the layouts of such a report again, the same shapes and meshes, for
the same deviceless GPUs told their HBM is nearly full (`_pressed`): a step of 4–38 GiB on an 80 GB
H100 is scheduled with memory to spare, and one near the limit, the one whose fit the prediction
decides, is scheduled for memory. The two reports side by side say how much of XLA's total is the
scheduler's choice (`benchmarks/explorer_drawn_shapes_h100_zaya1_nearly_full_seeds*.md`):

    .venv-cuda/bin/python benchmarks/explorer_drawn_shapes.py --gpu-target benchmarks/gpu_targets/h100_sxm.txtpb \\
        --nearly-full benchmarks/explorer_drawn_shapes_h100_zaya1_seeds48_59.json \\
        --out benchmarks/explorer_drawn_shapes_h100_zaya1_nearly_full_seeds48_59.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MIB = 2 ** 20
SIZED = ", steps sized for their HBM"  # `--widths zaya1`: compiled for the device's own memory
NEARLY_FULL = ", scheduled as if nearly full"  # a deviceless GPU compiled with `PRESSED_MEMORY` of HBM
PRESSED_MEMORY = 2 ** 20  # a deviceless GPU's HBM: XLA schedules as if the step nearly filled it (`_pressed`)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON path; the Markdown table goes beside it")
    p.add_argument("--seeds", type=int, default=12, help="shapes drawn (seeds FIRST .. FIRST+N-1)")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--layouts", type=int, default=2, help="8-device layouts compiled per shape")
    p.add_argument("--mock-gpus", action="store_true", help="one GPU seen as 8 (compile only; see above)")
    p.add_argument("--gpu-target", metavar="FILE", help="no GPU: compile for 8 GPUs this XLA target config "
                   "describes (deviceless; needs JAX's CUDA plugin, see above)")
    p.add_argument("--widths", choices=("cpu", "gpu", "zaya1"), default="cpu", help="the draw's sizes: cpu "
                   "(default; what a CPU compiles in seconds), gpu (the same draw at ZAYA1-like widths) or zaya1 "
                   "(ZAYA1-base's neighbourhood, on its experiment); gpu and zaya1 are for a GPU's compiler "
                   "(explore/held_out.py)")
    p.add_argument("--nearly-full", metavar="JSON", help="with --gpu-target: compile the layouts of this report of "
                   "steps sized for their HBM again, scheduled as if the HBM were nearly full (see above)")
    p.add_argument("--repredict", metavar="JSON", help="no compile: this file's XLA numbers against the current "
                   "model's predictions, written to --out")
    args = p.parse_args(argv)
    if args.repredict:
        return _repredict(args.repredict, args.out)
    if args.widths != "cpu" and not (args.gpu_target or args.mock_gpus):
        _fail(f"--widths {args.widths} is for a GPU's compiler: add --gpu-target FILE (no GPU) or --mock-gpus "
              "(one GPU)")
    if args.nearly_full and not args.gpu_target:
        _fail("--nearly-full compiles for deviceless GPUs: add --gpu-target FILE")
    if args.gpu_target:
        os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin then registers without looking for a driver
    if args.nearly_full:
        return _nearly_full(args.nearly_full, args.gpu_target, args.out)

    import jax

    if args.mock_gpus:
        jax.config.update("mock_num_gpu_processes", 8)  # before the backend starts

    from zaya_jax import hardware
    from zaya_jax.explore import memory
    from zaya_jax.explore.explorer import candidates
    from zaya_jax.explore.held_out import BASE, draw
    from zaya_jax.explore.placement import describe

    roomy = args.widths == "zaya1"  # steps sized for the GPU: compiled for its own HBM, as a run is
    config = f"experiments/{BASE[args.widths]}"
    devices = _deviceless_gpus(args.gpu_target, pressed=not roomy) if args.gpu_target else jax.devices()
    if len(devices) < 8:
        _fail("run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (on one GPU: --mock-gpus)")
    device = devices[0]
    hw = hardware.detect(device)
    if hw is None:
        _fail(f"no hardware profile for {device.device_kind}; the prediction needs one (zaya_jax/hardware.py)")
    on_gpu = device.platform != "cpu"
    where = ((f"8 deviceless {device.device_kind} devices" + (SIZED if roomy else NEARLY_FULL))
             if args.gpu_target else f"8 mocked {device.device_kind} devices") if on_gpu else "8 fake CPU devices"
    header = {"device": where, "hardware": hw.name, "jax": jax.__version__, "config": config}
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        # On a GPU its own kernels (auto: Pallas), not the CPU's stand-in for them.
        overrides = draw(seed, args.widths) + (["--config.model.moe_kernel=auto"] if on_gpu else [])
        run = _workload(overrides, hw, config)
        fitting, _ = candidates(run)
        if roomy:  # the layouts a user would run: those the explorer says fit the device
            fitting = [s for s in fitting if memory.fits(run, memory.predict(run, s).total_bytes)]
            if not fitting:
                print(f"seed {seed}: no layout fits {hw.name}'s memory: none compiled", flush=True)
        for sizes in random.Random(seed).sample(fitting, min(args.layouts, len(fitting))):
            row = _compiled_row(seed, overrides, describe(sizes), header, devices)
            if row:
                rows.append(row)
                print(f"seed {seed:2d}  {row['layout']:28s} XLA/predicted {row['ratio']:.2f}  "
                      f"({row['compile_s']:.0f} s)", flush=True)
                _write(args.out, header | {"rows": rows}, quiet=True)
    _write(args.out, header | {"rows": rows})
    return 0


def _nearly_full(path: str, gpu_target: str, out: str) -> int:
    """The rows of a report of steps sized for their HBM (`--widths zaya1`), each layout compiled again
    for the same deviceless GPUs scheduled as if their HBM were nearly full (`_pressed`), as a step
    that decides whether a layout fits is scheduled; predicted by the current model."""
    try:
        with open(path, encoding="utf-8") as f:
            source = json.load(f)
        rows_in, hw_name = source["rows"], source["hardware"]
    except (OSError, ValueError, KeyError) as e:
        _fail(f"--nearly-full {path}: not a report this script wrote ({e})")
    if not source["device"].endswith(SIZED):
        _fail(f"--nearly-full {path}: its steps were not sized for their HBM ({source['device']}); "
              "it is for a --widths zaya1 report")
    import jax

    devices = _deviceless_gpus(gpu_target)
    header = {"device": f"8 deviceless {devices[0].device_kind} devices, the layouts of {os.path.basename(path)}"
                        f"{NEARLY_FULL}", "hardware": hw_name, "jax": jax.__version__, "config": report_config(source)}
    rows = []
    for before in rows_in:
        row = _compiled_row(before["seed"], before["overrides"], before["layout"], header, devices)
        if row:
            rows.append(row)
            print(f"seed {row['seed']:2d}  {row['layout']:28s} XLA/predicted {row['ratio']:.2f}  XLA's total "
                  f"{sum(row['xla'].values()) / 2 ** 30:.2f} GiB ({sum(before['xla'].values()) / 2 ** 30:.2f} with "
                  f"its own HBM)  ({row['compile_s']:.0f} s)", flush=True)
            _write(out, header | {"rows": rows}, quiet=True)
    _write(out, header | {"rows": rows})
    return 0


def _compiled_row(seed: int, overrides: list[str], layout: str, header: dict, devices) -> dict | None:
    """One layout compiled on the 8 `devices` (its kernels built for them), on top of the experiment
    `header` names, beside the current model's prediction for its hardware (`predict_row`), as a
    report's row; None (said why) when it cannot be built here."""
    from zaya_jax.explore.against_xla import compile_layout

    start = time.perf_counter()
    got = compile_layout(os.path.join(ROOT, report_config(header)), overrides, _sizes(layout), devices[:8], terms=True)
    if "error" in got:
        print(f"seed {seed} {layout}: {got['error']}", flush=True)
        return None
    row = {"seed": seed, "overrides": overrides, "layout": layout, "xla": got["terms"],
           "compile_s": round(time.perf_counter() - start, 1)}
    predict_row(row, header)
    return row


def _write(out: str, report: dict, quiet: bool = False) -> None:
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    markdown = _markdown(report["rows"], report["jax"], report["device"], report.get("reattributed", ()))
    with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(markdown)
    if not quiet:
        print(markdown)


def _repredict(path: str, out: str) -> int:
    """The rows of an earlier run, each layout predicted again by the current model (XLA's side as it was)."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        repredicted(report)
    except (OSError, ValueError, KeyError) as e:
        _fail(f"--repredict {path}: not a report this script wrote ({e})")
    _write(out, report)
    return 0


def repredicted(report: dict) -> dict:
    """`report` (a run's JSON) with each row's prediction and ratio made again by the current model."""
    for row in report["rows"]:
        predict_row(row, report)
    return report


def predict_row(row: dict, report: dict) -> None:
    """One row's prediction and ratio made again by the current model, for its report's hardware."""
    from zaya_jax import hardware
    from zaya_jax.explore import memory

    run = _workload(row["overrides"], hardware.profile(report.get("hardware") or "cpu"),  # first reports: CPU
                    report_config(report))
    row["predicted"] = memory.by_term(memory.predict(run, _sizes(row["layout"])))
    row["ratio"] = sum(row["xla"].values()) / sum(row["predicted"].values())


def _kernels_for(hw):
    """The kernels built and checked for the hardware's target, not this machine's (which is a CPU
    when the GPUs are deviceless or the report is read again here)."""
    from zaya_jax.kernels.registry import targeting

    return targeting(None if hw.target == "cpu" else hw.target)


def report_config(report: dict) -> str:
    """The experiment a report's overrides go on top of (reports before `--widths zaya1`: tiny_cpu's)."""
    return report.get("config", "experiments/tiny_cpu.py")


def _workload(overrides: list[str], hw, config: str):
    """The explorer's view of a drawn shape on 8 devices of `hw` (on top of `config`, relative to the
    repository), as `compile_layout` compiles it."""
    from zaya_jax.experiment import load_experiment
    from zaya_jax.explore.against_xla import compiled_overrides
    from zaya_jax.explore.workload import Workload

    with _kernels_for(hw):
        return Workload.from_experiment(load_experiment(os.path.join(ROOT, config), compiled_overrides(overrides)),
                                        hw, 1, 8)


def _sizes(layout: str) -> dict[str, int]:
    """`placement.describe`'s "data 2 x tsp 4" back into every axis's size."""
    from zaya_jax.parallel.axes import MESH_AXES

    named = dict(part.split() for part in layout.split(" x ") if part != "one device")
    return {axis: int(named.get(axis, 1)) for axis in MESH_AXES}


def _deviceless_gpus(path: str, pressed: bool = True) -> list:
    """8 compile-only CUDA devices of the GPU `path` describes (an XLA GPU target config, text proto),
    scheduled as if their memory were nearly full (`_pressed`) unless `pressed` is false."""
    from zaya_jax.errors import ZayaError
    from zaya_jax.explore import deviceless

    try:
        target = deviceless.read_target(path)
        return deviceless.gpu_devices(_pressed(target) if pressed else target, 1, 8, path)
    except ZayaError as e:
        _fail(str(e))


def _pressed(config: str) -> str:
    """The target with `PRESSED_MEMORY` of HBM. XLA's GPU scheduler spends memory freely below its
    limit (80% of the HBM less the step's arguments and outputs: overlapping, say, every weight's
    Newton–Schulz) and works to stay under it above: a step of a few MiB on a roomy H100 peaks
    higher than the same step would on one it nearly fills, the case whose prediction matters.
    Below the step's own arguments, the limit keeps XLA working to lower the peak all the way."""
    pressed, count = re.subn(r"device_memory_size:\s*\d+", f"device_memory_size: {PRESSED_MEMORY}", config)
    if not count:
        _fail("--gpu-target: the config names no device_memory_size (XLA's GPU target configs do)")
    return pressed


def _fail(message: str) -> None:
    print(f"explorer_drawn_shapes: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _shape(overrides: list[str]) -> str:
    v = dict(o.removeprefix("--config.").split("=", 1) for o in overrides)
    return (f"h{v['model.hidden_size']} L{v['model.num_hidden_layers']} {v['model.layer_pattern']} "
            f"heads {v['model.num_attention_heads']}/{v['model.num_key_value_heads']}x{v['model.head_dim']} "
            f"E{v['model.num_experts']}x{v['model.moe_intermediate_size']} S{v['train.seq_len']} "
            f"B{v['train.global_batch_size']}/A{v['train.grad_accum_steps']} remat {v['train.remat']}")


def _largest_misses(row: dict, n: int = 3) -> str:
    diffs = {t: row["xla"][t] - row["predicted"][t] for t in row["xla"]}
    worst = sorted(diffs, key=lambda t: -abs(diffs[t]))[:n]
    return ", ".join(f"{t} {diffs[t] / MIB:+.1f}" for t in worst)


def _markdown(rows: list[dict], jax_version: str, where: str = "8 fake CPU devices", reattributed=()) -> str:
    ratios = [r["ratio"] for r in rows]
    seeds = sorted({r["seed"] for r in rows})
    lines = [f"# The explorer's memory on drawn shapes ({where}, jax {jax_version})", "",
             f"{len(rows)} layouts of {len(seeds)} drawn shapes (seeds {seeds[0]}–{seeds[-1]}); XLA / predicted total "
             f"{min(ratios):.2f}–{max(ratios):.2f}, within 10%: {sum(abs(x - 1) <= 0.1 for x in ratios)}.", "",
             "| seed | shape | layout | predicted MiB | XLA MiB | XLA / predicted | largest misses (XLA − predicted, MiB) |",
             "|---:|---|---|---:|---:|---:|---|"]
    for note in reattributed:  # `tools/reattribute_drawn.py`: the same programs, XLA's totals unchanged
        lines[3:3] = ["", f"Terms attributed again ({note}), XLA's totals unchanged but where marked *."]
    again = sorted({r["recompiled"] for r in rows if r.get("recompiled")})
    if again:  # rows whose program changed after the run: compiled again and predicted by the model then
        lines[3:3] = ["", f"Marked *: compiled again, {'; '.join(again)}, and predicted by the model of then."]
    for r in rows:
        lines.append(f"| {r['seed']}{'*' if r.get('recompiled') else ''} | {_shape(r['overrides'])} | {r['layout']} | "
                     f"{sum(r['predicted'].values()) / MIB:.1f} | {sum(r['xla'].values()) / MIB:.1f} | "
                     f"{r['ratio']:.2f} | {_largest_misses(r)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
