"""tools/gpu_check.py and tools/gpu_wheels.py on CPU: bad input is one line and exit 2, the report's
Markdown from a made-up result, the pytest-output parsing, the layer step-down, and the wheel
closure from made-up metadata. Nothing is downloaded and no GPU is needed."""

import os
import subprocess
import sys

import pytest
from paths import ROOT, load_script
from zaya_jax.explore import rocm_standin



gpu_check = load_script("tools", "gpu_check")
gpu_wheels = load_script("tools", "gpu_wheels")


@pytest.mark.parametrize("args, words", [
    (["--parts=tests,gpu"], "--parts: unknown part 'gpu'"),
    (["--parts=,"], "--parts: no part given"),
    (["--budget-s=59"], "--budget-s must be at least 60"),
    (["--layers=0"], "--layers must be >= 1"),
    (["--seq-len=-4"], "--seq-len must be >= 1"),
    (["--platform=tpu"], "invalid choice: 'tpu'"),
    (["--budget-s=soon"], "invalid float value"),
    (["--frobnicate"], "unrecognized argument '--frobnicate'"),
    (["--config.train.steps"], "has no value"),
    (["--micro-batches=0"], "--micro-batches must be >= 1"),
    (["--batch=4", "--micro-batches=3"], "--batch 4 must be a multiple of --micro-batches 3"),
    (["--gpu-target=nowhere.txtpb"], "--gpu-target nowhere.txtpb: no such file"),
    ([f"--gpu-target={ROOT}/benchmarks/gpu_targets/mi300x.txtpb", "--parts=step,profile"],
     "--gpu-target compiles and runs nothing; --parts profile needs the GPU"),
    ([f"--gpu-target={ROOT}/benchmarks/gpu_targets/mi300x.txtpb", "--platform=rocm"],
     "--gpu-target names the GPU; leave out --platform and --allow-cpu"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, tmp_path, args, words):
    assert gpu_check.main(args + [f"--out-dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: error: ") and err.count("\n") == 1 and words in err, err


def test_unwritable_out_dir_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert gpu_check.main([f"--out-dir={blocker / 'sub'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not writable" in err


def test_cpu_only_machine_is_refused_without_allow_cpu(tmp_path):
    # A real subprocess (JAX starts in the probe): CPU is what JAX finds here, so this must refuse.
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--platform=cpu",
                             f"--out-dir={tmp_path}"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "JAX found no GPU" in result.stderr and "--allow-cpu" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, words", [
    (["--layers=0"], "--layers must be >= 1 (got 0)"),
    (["--steps=-1"], "--steps must be >= 1 (got -1)"),
])
def test_the_profiler_refuses_bad_numbers_in_one_line(tmp_path, args, words):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "profile_step.py"),
                             f"--out={tmp_path / 'p.json'}", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr == f"profile_step: error: {words}\n"
    assert not list(tmp_path.iterdir())


def _result():
    rows = [{"kernel": "attention", "variant": "causal", "backend": "pallas", "pass": "fwd", "baseline": "cudnn",
             "seconds": 0.0012, "tflops": 420.0, "gb_per_s": 90.0, "baseline_time_over_this": 0.8},
            {"kernel": "attention", "variant": "causal", "backend": "cudnn", "pass": "fwd+bwd", "baseline": "cudnn",
             "error": "XlaRuntimeError: cuDNN | broke"}]
    step = {"status": "ok", "seconds": 200.0, "layers": 15, "seq_len": 4096, "batch": 4, "micro_batches": 4,
            "model": {"hidden_size": 2048, "num_hidden_layers": 15, "num_experts": 16, "num_attention_heads": 8,
                      "num_key_value_heads": 2, "head_dim": 128, "moe_intermediate_size": 2048,
                      "vocab_size": 262272, "compute_dtype": "bfloat16"},
            "kernels": {"attention": "pallas", "grouped_matmul": "pallas", "rms_norm": "pallas"},
            "remat": "full", "params": 3.6e9, "compile_s": 95.2, "init_s": 4.0, "first_step_s": 2.5,
            "step_times_s": [0.61, 0.6, 0.62], "step_s": 0.61,
            "gradient_s": 0.25, "update_s": 0.32, "mfu_forward_backward": 0.25, "mfu_node_equivalent": 0.216, "tokens_per_s": 26860.0, "tflops_per_s": 101.0,
            "flops_per_token": 3.76e9, "mfu": 0.102, "peak_tflops": 989.4, "hardware": "h100", "nominal_peak": False,
            "peak_bytes": 61 * 2 ** 30, "limit_bytes": 73 * 2 ** 30, "first_loss": 12.6, "last_loss": 12.4,
            "attempts": [{"layers": 20, "status": "oom", "seconds": 80},
                         {"layers": 15, "status": "ok", "seconds": 120}]}
    return {"started": "2026-11-23T10:00:00", "budget_s": 540, "total_s": 530.4, "jax": "0.11.2", "jaxlib": "0.11.2",
            "python": "3.12.3",
            "device": {"device_kind": "NVIDIA H100 80GB HBM3", "target": "cuda", "device_count": 1, "slug": "h100"},
            "parts": {"tests": {"status": "failed", "seconds": 150.0, "passed": 60, "failed": 2, "skipped": 1,
                                "error": "2 failed, 0 errors",
                                "failures": ["FAILED tests/test_kernels_attention.py::test_x - AssertionError: big"]},
                      "bench": {"status": "failed", "seconds": 120.0, "size": "zaya1", "rows": rows,
                                "json": "benchmarks/kernels_zaya1_nvidia_h100_80gb_hbm3.json",
                                "error": "1 of 2 measurements failed"},
                      "profile": {"status": "ok", "seconds": 40.0, "layers": 4, "step_s": 0.4655,
                                  "json": "benchmarks/gpu_step_profile_h100.json",
                                  "rows": [{"part": "optimizer", "kind": "matmul (tf32)", "ms_per_step": 146.0},
                                           {"part": "loss", "kind": "elementwise", "ms_per_step": 13.0},
                                           {"part": "other", "kind": "elementwise", "ms_per_step": 50.0}]},
                      "step": step}}


def test_report_markdown_from_a_made_up_result(tmp_path):
    md = gpu_check.report_markdown(_result())
    assert md.startswith("# GPU check: NVIDIA H100 80GB HBM3\n")
    assert "jax 0.11.2 / jaxlib 0.11.2, platform cuda" in md
    assert "| tests | failed | 150 | 60 passed, 2 failed, 1 skipped |" in md
    assert "| step | ok | 200 | 15 layers: 26,860 tokens/s, MFU 10.2%, peak 61.0 GiB, compile 95 s |" in md
    assert "- tests: failed: 2 failed, 0 errors" in md and "- bench: failed: 1 of 2 measurements failed" in md
    assert "`FAILED tests/test_kernels_attention.py::test_x - AssertionError: big`" in md
    assert "| MFU, end to end on one device | 10.2% of 989.4 TFLOP/s (h100) |" in md
    assert "| MFU, forward + backward | 25.0% (gradient 0.250 s) |" in md
    assert "| MFU, node-equivalent (update / 8) | 21.6% (update 0.320 s) |" in md and "| attempts | 20 layers: oom, 15 layers: ok |" in md
    assert "| attention | causal | pallas | fwd | 1.200 | 420 | 90 | 0.80 vs cudnn |" in md
    assert ("| profile | ok | 40 | 4 layers, 466 ms a step: matmul (tf32) 146 ms, elementwise 63 ms "
            "(benchmarks/gpu_step_profile_h100.json) |") in md
    assert "failed: XlaRuntimeError: cuDNN / broke" in md  # a '|' in an error never breaks the table
    for line in md.splitlines():
        if line.startswith("|"):
            assert line.endswith("|"), line
    result = _result()
    result["parts"]["bench"] = {"status": "skipped"}
    stem = gpu_check.write_report(result, str(tmp_path))
    assert stem.endswith("gpu_h100") and "| bench | skipped | – | not run |" in open(stem + ".md").read()
    assert (tmp_path / "gpu_h100.json").exists()


def test_pytest_counts_from_summary_or_progress():
    done = ["....F.s", "FAILED tests/a.py::t - AssertionError", "2 failed, 40 passed, 3 skipped in 12.30s"]
    assert gpu_check.pytest_counts(done) == {"summary": "2 failed, 40 passed, 3 skipped in 12.30s", "failed": 2,
                                             "passed": 40, "skipped": 3}
    cut = ["..F.s...                [ 10%]", "..E", "Timeout"]
    assert gpu_check.pytest_counts(cut) == {"summary": "no summary (stopped early)", "passed": 8, "failed": 1,
                                            "errors": 1, "skipped": 1}


def test_layer_step_down():
    assert gpu_check.fewer_layers({"layers": 20, "needed_bytes": 100, "limit_bytes": 80}) == 15
    assert gpu_check.fewer_layers({"layers": 20, "needed_bytes": 70, "limit_bytes": 80}) == 19  # always fewer
    assert gpu_check.fewer_layers({"layers": 8}) == 6  # a runtime OOM: no numbers, take a quarter off
    assert gpu_check.fewer_layers({"layers": 1}) is None
    assert gpu_check.part_budget("step", ["step", "bench"], 350) == pytest.approx(350 * 0.45 / 0.75)
    assert gpu_check.device_slug("AMD Instinct MI300X", "rocm") == "mi300x"
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3", "cuda") == "h100"
    assert gpu_check.device_slug("NVIDIA A100-SXM4-40GB", "cuda") == "nvidia_a100_sxm4_40gb"


META = {
    "app": ["lib[fast]>=1", "numpy>=1.26", "pyarrow; extra == 'parquet'", "tool; python_version < '3.10'",
            "winonly; platform_system == 'Windows'", "hub>=0.1"],
    "lib": ["base", "speedup; extra == 'fast'", "jax>=0.5"],
    "base": [], "speedup": ["base"], "hub": [], "jax": [],
}


def test_wheel_closure_follows_extras_and_markers_and_skips_the_box():
    skip = gpu_wheels.box_skip({"numpy": None, "jax": "0.4.1", "hub": "0.2"})
    carried, skipped = gpu_wheels.closure(["app"], META.get, skip)
    assert set(carried) == {"app", "lib", "base", "speedup", "jax"}  # jax 0.4.1 on the box is too old for >=0.5
    assert carried["lib"] == {"fast"}
    assert skipped == {"numpy": "on the box", "hub": "on the box (0.2)"}
    carried, skipped = gpu_wheels.closure(["App"], lambda n: META[n] + (["pyarrow"] if n == "app" else []), skip)
    assert "pyarrow" not in carried and "lazily" in skipped["pyarrow"]


def test_wheel_plan_pins_this_environments_versions(capsys):
    plan, skipped = gpu_wheels.make_plan()
    names = dict(plan)
    assert set(gpu_wheels.ROOTS) <= set(names)
    assert not {"jax", "jaxlib", "numpy", "torch", "triton", "pyarrow", "huggingface-hub"} & set(names)
    assert all(version for version in names.values()), [n for n, v in plan if not v]
    assert gpu_wheels.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"carry {len(plan)} wheels: ") and "flax==" in out
    assert "not carried: huggingface-hub (tokenizers" in out


def test_wheel_script_bad_input_is_one_line(tmp_path, capsys):
    assert gpu_wheels.main(["--dry-run", f"--box-freeze={tmp_path / 'missing.txt'}"]) == 2
    assert gpu_wheels.main(["--nope"]) == 2
    (tmp_path / "empty.txt").write_text("# nothing\n")
    assert gpu_wheels.main(["--dry-run", f"--box-freeze={tmp_path / 'empty.txt'}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(x.startswith("gpu_wheels: error: ") for x in err), err
    assert "cannot read --box-freeze" in err[0] and "unrecognized arguments: --nope" in err[1]


def test_box_freeze_drops_what_the_box_has(tmp_path):
    (tmp_path / "freeze.txt").write_text("protobuf==7.40.0\nmsgpack==0.1\nFlax==0.1\n")
    plan, skipped = gpu_wheels.make_plan(str(tmp_path / "freeze.txt"))
    names = dict(plan)
    assert "protobuf" not in names and skipped["protobuf"] == "on the box (7.40.0)"
    assert "flax" in names  # a root is always carried, pinned


def test_wheel_versions_for_the_boxs_jax_and_pins(tmp_path, capsys):
    here = dict(gpu_wheels.make_plan()[0])
    on_011 = dict(gpu_wheels.make_plan(box_jax="0.11.2")[0])
    assert on_011["flax"] == "0.12.11" and {k: v for k, v in on_011.items() if k != "flax"} == \
        {k: v for k, v in here.items() if k != "flax"}
    (tmp_path / "freeze.txt").write_text("jax==0.11.2\njaxlib==0.11.2\n")
    assert dict(gpu_wheels.make_plan(str(tmp_path / "freeze.txt"))[0])["flax"] == "0.12.11"
    pinned = dict(gpu_wheels.make_plan(box_jax="0.11.2", pins=["Flax==0.12.10", "optax==0.2.7"])[0])
    assert (pinned["flax"], pinned["optax"]) == ("0.12.10", "0.2.7")
    assert gpu_wheels.main(["--dry-run", "--pin", "notcarried==1"]) == 2
    assert gpu_wheels.main(["--dry-run", "--pin", "flax"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "notcarried is not among the carried wheels" in err[0], err
    assert err[1] == "gpu_wheels: error: --pin takes NAME==VERSION, got 'flax'"


def test_a_dry_run_for_an_amd_gpu_without_the_set_up_is_one_line_naming_the_command(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"),
                             "--gpu-target=benchmarks/gpu_targets/mi300x.txtpb", f"--out-dir={tmp_path}"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "ZAYA_ROCM_COMPILE_DIR": str(tmp_path / "none")})
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert err.startswith("gpu_check: error: ") and err.count("\n") == 1 and "rocm_compile_setup.py" in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(rocm_standin.setup_dir(), rocm_standin.PLUGIN_LIBRARY)),
                    reason="no compile-only ROCm set-up here: python tools/rocm_compile_setup.py")
def test_a_dry_run_compiles_the_step_and_every_kernel_case_for_an_mi300x(tmp_path):
    """What an MI300X run would time, compiled here: the step (two layers) with XLA's peak against
    the target's HBM, and every kernel benchmark case with hipBLASLt's grouped GEMM among them."""
    import json

    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--layers=2",
                             "--gpu-target=benchmarks/gpu_targets/mi300x.txtpb", f"--out-dir={tmp_path}"],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads((tmp_path / "gpu_mi300x_dry_run.json").read_text())
    step, bench = report["parts"]["step"], report["parts"]["bench"]
    assert (step["status"], step["layers"], step["limit_bytes"]) == ("ok", 2, 206141652992)
    assert 0 < step["peak_bytes"] < step["limit_bytes"] and step["kernels"]["grouped_matmul"] == "pallas"
    assert bench["status"] == "ok" and all("compiled_s" in r for r in bench["rows"])
    assert {("grouped_matmul", "hipblaslt", p) for p in ("fwd", "fwd+bwd")} <= \
        {(r["kernel"], r["backend"], r["pass"]) for r in bench["rows"]}


def test_the_jax_plugin_wheels_are_carried_at_the_boxs_jax_version_unless_the_box_has_them(tmp_path):
    plan, _ = gpu_wheels.make_plan(box_jax="0.11.2", plugin="rocm")
    assert dict(plan)["jax-rocm7-plugin"] == dict(plan)["jax-rocm7-pjrt"] == "0.11.2"
    assert "jax-rocm7-plugin" not in dict(gpu_wheels.make_plan(box_jax="0.11.2")[0])
    (tmp_path / "freeze.txt").write_text("jax==0.11.2\njax-rocm7-plugin==0.11.2\njax-rocm7-pjrt==0.10.2\n")
    plan, skipped = gpu_wheels.make_plan(str(tmp_path / "freeze.txt"), plugin="rocm")
    assert skipped["jax-rocm7-plugin"] == "on the box (0.11.2)" and dict(plan)["jax-rocm7-pjrt"] == "0.11.2"
