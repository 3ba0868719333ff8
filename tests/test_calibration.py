"""`zaya mesh --calibrate` (`explore/calibration.py`) on the report an H200 run wrote
(benchmarks/gpu_h200.json): each kernel kind's FLOPs are priced at the share of the peak its
measured backend reached, the profiled step's rows price the elementwise work and Newton–Schulz,
the measured step's residual makes the calibrated model meet that step, and every file that
cannot calibrate the question is one line, exit status 2."""

import copy
import dataclasses
import json
import os

import pytest

from paths import ROOT
from zaya_jax import hardware
from zaya_jax.errors import ZayaError
from zaya_jax.experiment import load_experiment
from zaya_jax.explore import calibration, step_time
from zaya_jax.explore.collectives import Network
from zaya_jax.explore.workload import Workload, share
from zaya_process import zaya

H200 = os.path.join(ROOT, "benchmarks", "gpu_h200.json")
PHASE1 = os.path.join(ROOT, "experiments", "zaya1_base_phase1.py")
STEP = ["--config.model.num_hidden_layers=31", "--config.train.seq_len=4096", "--config.train.global_batch_size=4",
        "--config.train.grad_accum_steps=4",  # the shape gpu_check timed on the H200
        "--config.optim.muon_ns_dtype=float32"]  # and its Newton–Schulz, which ran before bf16 became the default
ONE = dict(data=1, fsdp=1, expert=1, tsp=1, tensor=1, sequence=1)


def _run(overrides=STEP, hw="h200", devices=1):
    return Workload.from_experiment(load_experiment(PHASE1, overrides), hardware.profile(hw), 1, devices)


def test_the_calibrated_model_meets_the_measured_step_and_prices_each_kernel_at_its_share():
    report = json.load(open(H200))
    run, cal = calibration.calibrate(_run(), H200)
    measured = report["parts"]["step"]["step_s"]
    assert step_time.predict(run, ONE, Network(run.hw)).step_time_s == pytest.approx(measured, rel=1e-6)
    rows = {(r["kernel"], r["backend"], r["pass"], r["variant"]): r["fraction_of_peak_flops"]
            for r in report["parts"]["bench"]["rows"]}
    close = pytest.approx  # the report's own fractions: its TFLOP/s over the same datasheet peak
    assert run.efficiency("attention") == close(rows[("attention", "pallas", "fwd+bwd", "causal+documents")])
    assert run.efficiency("grouped_matmul") == close(rows[("grouped_matmul", "pallas", "fwd+bwd", "top-1, 16 experts")])
    assert run.efficiency("matmul") == close(rows[("grouped_matmul", "dense", "fwd+bwd", "top-1, 16 experts")])
    # Compute is each kind's FLOPs at its own share, times the residual.
    work = step_time.flops_by_kernel(run, ONE, share(run, ONE))
    peak = run.hw.peak_bf16_tflops * 1e12
    want = cal.residual * sum(f / (peak * run.efficiency(kind)) for kind, f in work.items())
    assert step_time.compute_seconds(run, work) == pytest.approx(want)
    assert cal.residual != 1.0  # fitted: the step's 31 layers are not the profile's 4


def test_a_profiled_step_prices_the_elementwise_work_and_newton_schulz_from_its_rows():
    """The profile's elementwise work and copies outside the optimizer (summed here from its rows)
    over the model's for the profiled shape; Newton–Schulz's FLOPs over its fp32 GEMMs' time, as a
    share of the H200's TF32 peak (494.7 TFLOP/s)."""
    profile = json.load(open(H200))["parts"]["profile"]
    run, cal = calibration.calibrate(_run(), H200)
    ms = lambda keep: sum(r["ms_per_step"] for r in profile["rows"] if keep(r)) / 1e3  # noqa: E731
    elementwise = ms(lambda r: r["kind"] in ("elementwise", "copy") and r["part"] != "optimizer")
    fp32 = ms(lambda r: r["kind"] == "matmul (tf32)")
    profiled = _run([f"--config.model.num_hidden_layers={profile['layers']}"] + STEP[1:])
    assert cal.elementwise_scale == pytest.approx(
        elementwise / step_time.elementwise_seconds(profiled, ONE, share(profiled, ONE)))
    assert run.elementwise_scale == cal.elementwise_scale > 2.5  # the CPU's 26 passes are too few on a GPU (2.69)
    assert run.efficiency("newton_schulz") == pytest.approx(
        step_time.newton_schulz_flops(profiled, ONE) / fp32 / 494.7e12)
    assert "elementwise work x" in cal.summary() and "newton_schulz 0.69" in cal.summary()


def test_the_kernels_and_the_profile_predict_two_measured_steps_without_the_residual():
    """Measured on the H200: the profiled step (4 layers) and the timed one (31 layers). Priced from
    the report's kernel timings and profile alone, no residual fitted, each is within 10% of its
    measurement (uncalibrated: 0.64 of each)."""
    report = json.load(open(H200))
    for layers, measured in ((4, report["parts"]["profile"]["step_s"]), (31, report["parts"]["step"]["step_s"])):
        run = _run([f"--config.model.num_hidden_layers={layers}"] + STEP[1:])
        calibrated, _ = calibration.calibrate(run, H200)
        unfitted = dataclasses.replace(calibrated, residual=1.0)
        assert step_time.predict(unfitted, ONE, Network(run.hw)).step_time_s == pytest.approx(measured, rel=0.10)
        assert step_time.predict(run, ONE, Network(run.hw)).step_time_s < 0.7 * measured


def test_without_a_file_every_kind_runs_at_the_profiles_efficiency():
    run = _run()
    work = step_time.flops_by_kernel(run, ONE, share(run, ONE))
    assert set(work) == {"matmul", "grouped_matmul", "attention", "linear_attention"}
    assert sum(work.values()) == pytest.approx(step_time.hardware_flops(run, ONE, share(run, ONE)))
    peak = run.hw.peak_bf16_tflops * 1e12 * run.hw.compute_efficiency
    assert step_time.compute_seconds(run, work) == pytest.approx(sum(work.values()) / peak)


def test_a_layout_of_many_devices_is_scaled_by_the_same_measured_numbers():
    run8 = _run(STEP[:1] + ["--config.train.seq_len=4096", "--config.train.global_batch_size=32"], devices=8)
    calibrated, _ = calibration.calibrate(run8, H200)
    sizes = dict(ONE, fsdp=8)
    plain = step_time.predict(run8, sizes, Network(run8.hw))
    fitted = step_time.predict(calibrated, sizes, Network(run8.hw))
    assert fitted.compute_s > 2 * plain.compute_s  # measured kernels and the residual: slower than 0.8 of peak


def _write(tmp_path, edit):
    report = copy.deepcopy(json.load(open(H200)))
    edit(report)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return str(path)


@pytest.mark.parametrize("edit, hw, words", [
    (lambda r: None, "mi300x", "was measured on h200, the question is for mi300x; pass --hardware h200"),
    (lambda r: r.update(tool="something"), "h200", "is not a tools/gpu_check.py report"),
    (lambda r: r["parts"].pop("bench"), "h200", "has no kernel benchmark rows"),
    (lambda r: r["parts"]["bench"].update(rows=[x for x in r["parts"]["bench"]["rows"] if x["backend"] != "pallas"]),
     "h200", "has no fwd+bwd timing of attention with the pallas backend"),
    (lambda r: r["parts"]["step"]["model"].pop("hidden_size"), "h200", "its timed step does not say its shape"),
    (lambda r: r["parts"]["profile"].pop("remat"), "h200", "its profiled step does not say its shape"),
    (lambda r: r["parts"]["profile"]["rows"][0].pop("kind"), "h200", "its profile's rows are not tools/profile_step.py's"),
    (lambda r: r["parts"]["profile"].update(rows=[x for x in r["parts"]["profile"]["rows"]
                                                  if x["kind"] != "matmul (tf32)"]),
     "h200", "its profile times no Newton–Schulz products"),
], ids=["device", "tool", "no-bench", "no-backend", "no-shape", "no-profile-shape", "bad-rows", "no-fp32"])
def test_a_file_that_cannot_calibrate_the_question_is_refused(tmp_path, edit, hw, words):
    with pytest.raises(ZayaError, match=words.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        calibration.calibrate(_run(hw=hw), _write(tmp_path, edit))


def test_a_report_without_a_timed_step_calibrates_the_kernels_only(tmp_path):
    run, cal = calibration.calibrate(_run(), _write(tmp_path, lambda r: r["parts"].pop("step")))
    assert cal.residual == 1.0 and run.residual == 1.0 and "no timed step" in cal.summary()


def test_cli_prints_the_calibration_and_refuses_a_missing_file(tmp_path):
    args = ["mesh", f"--config={PHASE1}", "--hardware=h200", "--nodes=1", "--gpus-per-node=8", "--top=2",
            "--config.train.seq_len=4096", "--config.train.global_batch_size=32"]
    done = zaya(*args, f"--calibrate={H200}")
    assert done.returncode == 0, done.stderr
    assert f"calibrated from {H200} (h200): share of peak attention 0.15, grouped_matmul 0.31, matmul 0.87" in done.stdout  # the file's fwd+bwd rows / 989.4
    missing = zaya(*args, f"--calibrate={tmp_path}/none.json")
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "does not exist; pass the JSON tools/gpu_check.py wrote" in missing.stderr


def test_a_report_made_on_this_cpu_calibrates_the_cpu_profile_to_its_own_step(tmp_path):
    """tools/gpu_check.py's bench, profile and step parts on CPU (small shapes) write a report; the
    calibrated explorer prices the elementwise work and Newton–Schulz from its profile and then
    predicts that report's step at its measured time. The budget is a cap, not a wait: alone the
    parts take about 75 s, but beside CI's other worker the profile ran past a 69 s share."""
    import subprocess
    import sys

    shape = ["--config.model.hidden_size=256", "--config.model.vocab_size=1024", "--config.model.num_experts=4",
             "--config.model.moe_intermediate_size=256", "--config.model.num_attention_heads=4",
             "--config.model.head_dim=64"]
    made = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--platform=cpu", "--allow-cpu",
                           "--parts=bench,profile,step", "--layers=1", "--seq-len=256", "--batch=4", "--steps=1",
                           "--budget-s=900", f"--out-dir={tmp_path}", *shape],
                          capture_output=True, text=True, timeout=1000, cwd=ROOT)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    path = str(tmp_path / "gpu_cpu.json")
    measured = json.load(open(path))["parts"]["step"]["step_s"]
    question = _run(shape + ["--config.model.num_hidden_layers=1", "--config.train.seq_len=256",
                             "--config.train.global_batch_size=4", "--config.train.grad_accum_steps=4"], hw="cpu")
    run, cal = calibration.calibrate(question, path)
    assert set(cal.efficiencies) >= {"attention", "grouped_matmul", "matmul", "newton_schulz"}
    assert all(0 < v for v in cal.efficiencies.values())
    profile = json.load(open(path))["parts"]["profile"]  # the profiler's own JSON beside the report, its rows in it
    assert profile["status"] == "ok" and os.path.isfile(tmp_path / "gpu_step_profile_cpu.json")
    assert any(r["part"] == "optimizer" and r["kind"] == "matmul" for r in profile["rows"])  # Newton–Schulz's scope
    assert cal.elementwise_scale != 1.0 and cal.efficiencies["newton_schulz"] != cal.efficiencies["matmul"]
    assert step_time.predict(run, ONE, Network(run.hw)).step_time_s == pytest.approx(measured, rel=1e-6)
