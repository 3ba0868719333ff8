"""The drawn model shapes the explorer is checked on (`explore/held_out.py`): deterministic in the
seed, each a valid experiment with at least one 8-device layout, and spread over what they draw;
the benchmark that compiles them refuses bad input in one line."""

import json
import os
import re
import subprocess
import sys

import pytest
from xla_test_flags import cuda_plugin_installed, xla_flags

from zaya_jax import hardware
from zaya_jax.experiment import load_experiment
from zaya_jax.explore import memory
from zaya_jax.explore.explorer import candidates
from zaya_jax.explore.held_out import draw
from zaya_jax.explore.workload import Workload
from paths import ROOT, TINY, load_script

MIB = 2 ** 20

SEEDS = range(40)


def test_each_draw_is_a_valid_run_with_an_8_device_layout():
    for seed in SEEDS:
        exp = load_experiment(TINY, draw(seed))
        fitting, refused = candidates(Workload.from_experiment(exp, hardware.profile("cpu"), 1, 8))
        assert fitting, (seed, refused.most_common(2))


def test_draws_repeat_per_seed_and_cover_what_they_draw():
    assert draw(7) == draw(7) and draw(7) != draw(8)
    values = [dict(o.split("=", 1) for o in draw(seed)) for seed in SEEDS]
    for key, at_least in {"--config.train.remat": 4, "--config.model.layer_pattern": 3,
                          "--config.train.grad_accum_steps": 2, "--config.model.num_experts": 3,
                          "--config.model.hidden_size": 5, "--config.train.seq_len": 3,
                          "--config.train.scan_unroll": 3}.items():
        assert len({v[key] for v in values}) >= at_least, key


def test_gpu_widths_are_the_same_draw_scaled_and_fit_8_h100s():
    from zaya_jax.explore.held_out import GPU_EXTRA, GPU_SCALE

    for seed in range(12):
        cpu, gpu = (dict(o.removeprefix("--config.").split("=", 1) for o in draw(seed, w)) for w in ("cpu", "gpu"))
        assert gpu == {k: str(int(v) * GPU_SCALE[k]) if k in GPU_SCALE else v for k, v in cpu.items()} | {
            k: str(v) for k, v in GPU_EXTRA.items()}
        exp = load_experiment(TINY, draw(seed, "gpu"))
        fitting, refused = candidates(Workload.from_experiment(exp, hardware.profile("h100"), 1, 8))
        assert fitting, (seed, refused.most_common(2))


def test_zaya1_widths_draw_around_zaya1_base_and_most_fit_8_h100s():
    """`widths="zaya1"`: ZAYA1-base's neighbourhood on its own experiment, every draw a valid run,
    spread over what it draws, and most with a layout the explorer says fits 8 H100s' memory."""
    from zaya_jax.explore.held_out import BASE
    from zaya_jax.kernels.registry import targeting

    base = os.path.join(ROOT, "experiments", BASE["zaya1"])
    assert draw(7, "zaya1") == draw(7, "zaya1") != draw(8, "zaya1")
    values = [dict(o.removeprefix("--config.").split("=", 1) for o in draw(seed, "zaya1")) for seed in range(24)]
    for key, at_least in {"train.remat": 4, "model.layer_pattern": 3, "train.grad_accum_steps": 3,
                          "model.hidden_size": 4, "model.num_hidden_layers": 4, "train.seq_len": 3}.items():
        assert len({v[key] for v in values}) >= at_least, key
    fit_somewhere = 0
    for seed in range(12):
        with targeting("cuda"):
            run = Workload.from_experiment(load_experiment(base, draw(seed, "zaya1")), hardware.profile("h100"), 1, 8)
        fitting, refused = candidates(run)
        assert fitting, (seed, refused.most_common(2))
        fit_somewhere += any(memory.fits(run, memory.predict(run, s).total_bytes) for s in fitting)
    assert fit_somewhere >= 9, fit_somewhere


@pytest.mark.parametrize("args, words", [
    (["--widths=gpu"], "--widths gpu is for a GPU's compiler: add --gpu-target FILE"),
    (["--widths=zaya1"], "--widths zaya1 is for a GPU's compiler: add --gpu-target FILE"),
    (["--repredict=/nonexistent.json"], "--repredict /nonexistent.json: not a report this script wrote"),
    (["--nearly-full=benchmarks/explorer_drawn_shapes_h100_zaya1_seeds24_35.json"],
     "--nearly-full compiles for deviceless GPUs: add --gpu-target FILE"),
    (["--nearly-full=/nonexistent.json", "--gpu-target=benchmarks/gpu_targets/h100_sxm.txtpb"],
     "--nearly-full /nonexistent.json: not a report this script wrote"),
    (["--nearly-full=benchmarks/explorer_drawn_shapes_seeds204_215.json",
      "--gpu-target=benchmarks/gpu_targets/h100_sxm.txtpb"], "its steps were not sized for their HBM (8 fake CPU devices)"),
    (["--gpu-target=/nonexistent.txtpb"], "--gpu-target /nonexistent.txtpb: No such file or directory"),
    # Without JAX's CUDA plugin (CI installs none) the real target config is refused for that.
    (["--gpu-target=benchmarks/gpu_targets/h100_sxm.txtpb"], "--gpu-target needs JAX's CUDA plugin for this jax"),
])
def test_the_drawn_shapes_benchmarks_bad_inputs_are_one_line_and_exit_2(tmp_path, args, words):
    if "CUDA plugin" in words and cuda_plugin_installed():
        pytest.skip("a JAX plugin is installed here: the target config may compile")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "explorer_drawn_shapes.py"),
                           f"--out={tmp_path / 'out.json'}", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().count("\n") == 0 and words in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("report, words", [
    ("/nonexistent.json", "/nonexistent.json: not a drawn-shapes report"),
    ("benchmarks/explorer_drawn_shapes_seeds204_215.json", "for a set compiled for deviceless GPUs (this one: 8 fake CPU"),
    ("benchmarks/explorer_drawn_shapes_h200_mock_seeds24_47.json", "(this one: 8 mocked NVIDIA H200 devices)"),
])
def test_the_phase_by_phase_benchmarks_bad_inputs_are_one_line_and_exit_2(tmp_path, report, words):
    """XLA:CPU spreads the loss through the backward, and a mocked GPU needs its GPU: refused in words."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "explorer_phases.py"), report,
                           "--gpu-target=benchmarks/gpu_targets/h100_sxm.txtpb", f"--out={tmp_path / 'out.json'}"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().count("\n") == 0 and words in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out.json").exists()


def test_a_deviceless_gpu_is_compiled_as_if_its_memory_were_nearly_full():
    drawn = load_script("benchmarks", "explorer_drawn_shapes")
    with open(os.path.join(ROOT, "benchmarks", "gpu_targets", "h100_sxm.txtpb"), encoding="utf-8") as f:
        config = f.read()
    pressed = drawn._pressed(config)
    assert f"device_memory_size: {drawn.PRESSED_MEMORY}\n" in pressed and "84929347584" not in pressed
    assert pressed.replace(str(drawn.PRESSED_MEMORY), "84929347584") == config  # nothing else changed
    with pytest.raises(SystemExit) as refused:
        drawn._pressed(config.replace("device_memory_size", "memory_size"))
    assert refused.value.code == 2


@pytest.fixture(scope="module")
def summary():
    """Every stored drawn-shapes report predicted again by today's model (`benchmarks/drawn_shapes_summary.py`)."""
    script = load_script("benchmarks", "drawn_shapes_summary")
    return script.summarize(script.report_paths())


@pytest.mark.slow
def test_the_underestimate_the_explorer_warns_of_is_the_largest_measured_on_the_drawn_shapes(summary):
    assert {c: t["underestimate"] for c, t in summary["compilers"].items()} == memory.UNDERESTIMATE


@pytest.mark.slow
def test_the_committed_summary_of_the_drawn_shapes_is_todays_models(summary):
    """The counts docs/mesh_explorer.md quotes: a model change (or a new report) without
    `python benchmarks/drawn_shapes_summary.py` run again fails here."""
    with open(os.path.join(ROOT, "benchmarks", "drawn_shapes_summary.json"), encoding="utf-8") as f:
        committed = json.load(f)
    assert committed == json.loads(json.dumps(summary)), "stale: run python benchmarks/drawn_shapes_summary.py"


def _row(live_mib: float, gap_mib: float, ratio: float) -> dict:
    return {"xla": {"parameters": live_mib * MIB, "fragmentation": gap_mib * MIB}, "ratio": ratio}


def test_the_summary_counts_within_10_percent_and_the_gaps_ceiling():
    """Counted on planted rows: the band is 0.90-1.10, and the ceiling prices a live-exact
    model's gaps at one share: a row whose gaps are 30% of its total is out of reach at a share that
    keeps the gapless rows in."""
    script = load_script("benchmarks", "drawn_shapes_summary")
    rows = [_row(100, 0, 1.0), _row(95, 5, 1.099), _row(70, 30, 0.899), _row(100, 0, 1.101)]
    counted = script.tally(rows, 0.0)
    assert (counted["layouts"], counted["within"], counted["ratio_min"], counted["ratio_max"]) == (4, 2, 0.899, 1.101)
    assert counted["ceiling"] == 3  # the 30% gap: 100 / 70 = 1.43 of a gapless live-exact prediction
    assert script.ceiling_ratio(rows[2], 0.3) == pytest.approx(1.0)
    assert script.best_gap_share(rows) == 0.0  # 0 to 0.1 keep three (above, the gapless rows leave); the smallest
    assert script.best_gap_share([_row(78, 22, 1.0)]) == 0.145  # the smallest that brings 100 / 78 to 1.1


def _reattribute(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "reattribute_drawn.py"), "--why=a test", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          # The reports' own XLA flags: the tests' would compile other buffers.
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(8, base="")})


def test_reattributing_a_missing_report_is_one_line_and_exit_2():
    done = _reattribute("/nonexistent.json")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().count("\n") == 0 and "/nonexistent.json: not a drawn-shapes report" in done.stderr


def test_reattributing_a_deviceless_gpu_report_without_its_target_skips_it_untouched(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(open(os.path.join(ROOT, "benchmarks", "explorer_drawn_shapes_h100_seeds24_35.json")).read())
    stored = path.read_text()
    done = _reattribute(str(path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "skipped (deviceless GPUs need --gpu-target" in done.stderr
    assert path.read_text() == stored


@pytest.mark.slow
def test_reattributing_a_row_whose_program_changed_stops_or_marks_it_recompiled(tmp_path):
    """`tools/reattribute_drawn.py` only re-reads XLA's buffers of an unchanged program: a stored
    total one byte off stops it with the report untouched; `--recompile-changed` takes the
    compiled numbers, predicts the row again and marks it."""
    with open(os.path.join(ROOT, "benchmarks", "explorer_drawn_shapes_seeds144_155.json"), encoding="utf-8") as f:
        report = json.load(f)
    row = next(r for r in report["rows"] if r["seed"] == 149 and r["layout"] == "tsp 8")  # the smallest step
    row["xla"]["fragmentation"] += 1  # a byte more than XLA ever reserved for it
    stored_total = sum(row["xla"].values())
    report["rows"] = [row]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    stored = path.read_text()

    refused = _reattribute(str(path))
    assert refused.returncode == 2, refused.stderr[-2000:]
    now = re.search(rf"seed 149 tsp 8: XLA's total is (\d+) bytes now, {stored_total} stored: the program "
                    r"changed; add --recompile-changed", refused.stderr)
    assert now and refused.stderr.strip().count("\n") == 0, refused.stderr[-2000:]
    compiled_total = int(now.group(1))
    assert path.read_text() == stored and not (tmp_path / "report.md").exists()

    done = _reattribute("--recompile-changed", str(path))
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads(path.read_text())
    (row,) = again["rows"]
    assert sum(row["xla"].values()) == compiled_total and row["xla_total_at_run"] == stored_total
    assert "programs had changed since the run" in row["recompiled"]
    assert row["ratio"] == pytest.approx(compiled_total / sum(row["predicted"].values()))
    assert again["reattributed"][-1].endswith("a test (1 rows)")
    assert "Terms attributed again" in (tmp_path / "report.md").read_text()
