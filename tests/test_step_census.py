"""The step census (explore/step_census.py, tools/gpu_census.py): launches times loop trips, GEMM
FLOPs and dtypes, slice-sized bytes, model parts, and the rates that price them
(explore/census_pricing.py)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_test_flags import cuda_plugin_installed

from zaya_jax.explore import census_pricing, step_census
from paths import ROOT

TOOL = os.path.join(ROOT, "tools", "gpu_census.py")


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def _gemms(ops):
    return [o for o in ops if o.kind == "gemm"]


def test_an_op_in_a_loop_body_runs_once_per_trip():
    w = jnp.ones((64, 48), jnp.float32)

    def looped(x):
        return jax.lax.fori_loop(0, 7, lambda i, x: jnp.tanh(x @ w @ w.T), x)

    ops = step_census.census(_compiled(looped, jnp.ones((32, 64), jnp.float32)))
    runs = sorted(o.runs for o in _gemms(ops))
    assert runs and set(runs) == {7}, runs
    # Two products a trip: [32,64]x[64,48] and [32,48]x[48,64], 2·m·n·k FLOPs each.
    assert sum(o.runs * o.flops for o in _gemms(ops)) == 7 * 2 * (2 * 32 * 64 * 48)
    assert {o.dtype for o in _gemms(ops)} == {"f32"}


needs_plugin = pytest.mark.skipif(not cuda_plugin_installed(),
                                  reason="needs JAX's CUDA plugin (no GPU): pip install jax[cuda12]")

# In a process of its own: the CUDA plugin registers its compiler only where JAX starts with it.
_VENDOR_GEMM = """
import sys, jax, jax.numpy as jnp
from zaya_jax.explore import deviceless, step_census
deviceless.use_cpu_host()
target = sys.argv[1]
[device] = deviceless.gpu_devices(deviceless.read_target(target), 1, 1, target)
on = jax.sharding.SingleDeviceSharding(device)
dtype = getattr(jnp, sys.argv[2])
a, x = (jax.ShapeDtypeStruct(s, dtype, sharding=on) for s in ((4, 256, 128), (4, 64, 256)))
hlo = jax.jit(lambda a, x: x @ a).trace(a, x).lower().compile({"xla_gpu_enable_triton_gemm": False}).as_text()
for op in step_census.census(hlo):
    if op.kind == "gemm":
        print("GEMM", op.target, op.flops, op.dtype)
"""


@needs_plugin
@pytest.mark.parametrize("dtype, named", [("bfloat16", "bf16"), ("float32", "f32")])
def test_a_vendor_gemm_counts_its_flops_and_operand_dtype(dtype, named):
    target = os.path.join(ROOT, "benchmarks", "gpu_targets", "h100_sxm.txtpb")
    run = subprocess.run([sys.executable, "-c", _VENDOR_GEMM, target, dtype], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": ""}, cwd=ROOT)
    gemms = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("GEMM")]
    assert len(gemms) == 1, run.stdout + run.stderr[-2000:]
    target_name, flops, got = gemms[0]
    assert "cublas" in target_name
    assert (int(flops), got) == (2 * 4 * 64 * 256 * 128, named)


_NEWTON_SCHULZ = """
import sys, jax, jax.numpy as jnp
from zaya_jax.explore import deviceless, step_census
from zaya_jax.train.muon import newton_schulz
deviceless.use_cpu_host()
target = sys.argv[1]
[device] = deviceless.gpu_devices(deviceless.read_target(target), 1, 1, target)
g = jax.ShapeDtypeStruct((8, 256, 256), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
fn = lambda g: newton_schulz(g, steps=5, dtype=jnp.bfloat16)
hlo = jax.jit(fn).trace(g).lower().compile({"xla_gpu_enable_triton_gemm": False}).as_text()
for op in step_census.census(hlo):
    print("OP", op.kind, op.runs, op.bytes)
"""


@needs_plugin
def test_newton_schulz_compiled_for_an_h100_is_three_gemms_an_iteration_and_no_elementwise_pass():
    """Its scalars are cuBLASLt alphas and its sums the GEMMs' addends: what is left besides the 15
    GEMMs is the normalisation before and the scale after, not a pass over [rows, rows] each iteration."""
    target = os.path.join(ROOT, "benchmarks", "gpu_targets", "h100_sxm.txtpb")
    run = subprocess.run([sys.executable, "-c", _NEWTON_SCHULZ, target], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": ""}, cwd=ROOT)
    ops = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("OP")]
    assert ops, run.stdout + run.stderr[-2000:]
    gemms = [op for op in ops if op[0] == "gemm"]
    others = [op for op in ops if op[0] != "gemm"]
    assert sum(int(runs) for _, runs, _ in gemms) == 15
    assert len(others) <= 5, others  # the norm's reduction and clamp, the scaled cast in, the scale out


def test_a_dynamic_update_in_a_scan_moves_the_row_not_the_stack():
    rows, width = 64, 1024

    def stacked(x):
        def body(carry, i):
            return carry * 1.5, carry
        return jax.lax.scan(body, x, jnp.arange(rows))[1]

    ops = step_census.census(_compiled(stacked, jnp.ones((width,), jnp.float32)))
    looped = [o for o in ops if o.runs == rows]
    assert looped
    stack = rows * width * 4
    # A row is read and written once a trip; the [rows, width] stack is never read whole per trip.
    assert max(o.bytes for o in looped) < stack / 4, [(o.name, o.bytes) for o in looped]
    assert sum(o.runs * o.bytes for o in looped) < 8 * stack


def test_a_gather_from_a_masked_array_reads_the_gathered_elements_not_the_array():
    """The loss picks each token's target logit out of a masked [tokens, vocab] chunk: one fused
    kernel that reads one logit a token, as XLA evaluates the mask only where the gather asks."""
    rows, vocab = 1024, 512

    def picked(logits, target):
        masked = jnp.where(logits > 0, logits, -jnp.inf)
        return jnp.take_along_axis(masked, target[:, None], axis=-1)[:, 0] + 1.0

    ops = step_census.census(_compiled(picked, jnp.ones((rows, vocab), jnp.float32), jnp.zeros((rows,), jnp.int32)))
    [op] = ops
    assert op.bytes == 3 * rows * 4  # the result, the targets, one logit a row


def test_parts_come_from_named_scopes_and_the_backward_is_told_apart():
    w = jnp.ones((32, 32), jnp.float32)

    def step(x):
        def loss(w):
            with jax.named_scope("attention"):
                y = jnp.tanh(x @ w)
            with jax.named_scope("loss"):
                return jnp.sum(y ** 2)
        g = jax.grad(loss)(w)
        with jax.named_scope("newton_schulz"):
            return g @ g.T @ g

    parts = {o.part for o in step_census.census(_compiled(step, jnp.ones((16, 32))))}
    assert {"attention", "attention bwd", "newton-schulz"} <= parts, parts


def _op(kind, flops=0, nbytes=0, dtype="", target="", runs=1):
    return step_census.Op("x", "fusion", kind, "p", runs, nbytes, flops, dtype, target)


def test_rates_fitted_to_a_profile_reproduce_it_and_scale_with_the_work():
    ops = [_op("gemm", 4e12, dtype="bf16", runs=2), _op("gemm", 1e12, dtype="f32"),
           _op("kernel", 2e12, target="zaya_grouped_matmul"), _op("kernel", 1e12, target="zaya_dq_kernel"),
           _op("elementwise", nbytes=3e9, runs=10), _op("kernel", nbytes=1e9, target="zaya_rms_norm_fwd")]
    rows = [{"part": "x", "kind": "matmul", "ms_per_step": 10.0}, {"part": "y", "kind": "matmul (tf32)", "ms_per_step": 5.0},
            {"part": "experts bwd", "kind": "kernel", "ms_per_step": 8.0},
            {"part": "attention bwd", "kind": "kernel", "ms_per_step": 4.0},
            {"part": "other", "kind": "elementwise", "ms_per_step": 6.0}, {"part": "norms", "kind": "kernel", "ms_per_step": 1.0}]
    rates = census_pricing.fit_rates(ops, rows)
    assert rates["gemm bf16"] == pytest.approx(8e12 / 0.010)
    assert rates["memory"] == pytest.approx(31e9 / 0.007)  # fusions and the norm kernel: by bytes
    predicted = census_pricing.predict(ops, rates)
    assert sum(predicted.values()) == pytest.approx(0.034)
    doubled = census_pricing.predict([_op("gemm", 8e12, dtype="bf16", runs=2)], rates)
    assert doubled["gemm bf16"] == pytest.approx(0.020)
    # cuDNN's attention, which the profiled step did not run: the benchmark's fwd+bwd rate.
    bench = [{"kernel": "attention", "backend": "cudnn", "pass": "fwd+bwd", "tflops": 300.0},
             {"kernel": "attention", "backend": "cudnn", "pass": "fwd", "tflops": 250.0}]
    rates = census_pricing.fit_rates(ops, rows, bench)
    cudnn = [_op("kernel", 6e12, target="__cudnn$fmhaScaleBiasSoftmaxBackward")]
    assert census_pricing.predict(cudnn, rates) == {"cudnn attention": pytest.approx(0.020)}


def _tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_the_calibration_compiles_a_reports_step_as_it_ran_not_as_asked():
    """The profiled step is compiled with the report's kernels, remat and Newton–Schulz dtype: an
    asked `--config.model.attention_kernel=cudnn` predicts a cuDNN step from a Pallas profile, it
    does not turn the profile into a cuDNN one."""
    import json
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import gpu_census

    with open(os.path.join(ROOT, "benchmarks", "gpu_h200.json"), encoding="utf-8") as f:
        profile = json.load(f)["parts"]["profile"]
    overrides = gpu_census.as_it_ran(profile)
    assert "--config.model.attention_kernel=pallas" in overrides and "--config.train.remat=full" in overrides
    assert overrides[-1] == "--config.optim.muon_ns_dtype=float32"  # before bf16 was the default: none named
    assert gpu_census.as_it_ran({**profile, "muon_ns_dtype": "bfloat16"})[-1].endswith("=bfloat16")


@pytest.mark.parametrize("args, words", [
    (["--layers", "0"], "--layers must be >= 1"),
    (["--batch", "4", "--micro-batches", "3"], "multiple of --micro-batches"),
    (["--calibrate", "/nonexistent/report.json"], "--calibrate /nonexistent/report.json"),
    (["--calibrate", os.path.join(ROOT, "benchmarks", "gpu_h200_16_layers.json")], "has no profiled step"),
    (["--layer", "3"], "unrecognized arguments"),
    (["--gpu-target", "/nonexistent/target.txtpb"], "--gpu-target /nonexistent/target.txtpb"),
    (["--out", "/proc/census/out.json"], "--out /proc/census is not writable"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    run = _tool(*args)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("gpu_census: error:")]
    assert len(lines) == 1 and words in lines[0], run.stderr[-2000:]
    assert "Traceback" not in run.stderr


TINY = ["--config.model.hidden_size=256", "--config.model.num_experts=4", "--config.model.moe_intermediate_size=256",
        "--config.model.vocab_size=1024", "--config.model.num_attention_heads=4", "--config.model.num_key_value_heads=2",
        "--config.model.head_dim=64"]


@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("attention", ["pallas", "cudnn"])
def test_the_census_of_a_small_step_compiled_for_an_h100(tmp_path, attention):
    out = tmp_path / "census.json"
    run = _tool("--layers", "2", "--seq-len", "256", "--batch", "2", "--out", str(out), *TINY,
                f"--config.model.attention_kernel={attention}")
    assert run.returncode == 0, run.stderr[-3000:]
    import json
    r = json.loads(out.read_text())
    assert r["device"].startswith("NVIDIA H100")
    parts = r["parts"]
    assert parts["newton-schulz"]["launches"] > 0 and parts["experts"]["kernels"]
    assert r["total"]["gemm_flops"]["bf16"] > 0
    assert np.isclose(r["launches_per_layer"], r["total"]["launches"] / 2)
    assert (tmp_path / "census.md").read_text().startswith("# GPU census")
    attention_kernels = {k for part in ("attention", "attention bwd") for k in parts[part]["kernels"]}
    if attention == "cudnn":  # packed documents as cuDNN's mask, forward and backward, counted
        assert attention_kernels == {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"}
        # 2 layers x (2 forward + 2 recomputed forward + 5 backward products) x B·S²·heads·d
        assert parts["attention"]["kernel_flops"] + parts["attention bwd"]["kernel_flops"] == 2 * 9 * 2 * 256 ** 2 * 4 * 64
        # The solve balancer's forward is its own part: its attention, cuDNN's too.
        assert "__cudnn$fmhaScaleBiasSoftmax" in parts["re-route"]["kernels"]
    else:
        assert "zaya_forward_kernel" in attention_kernels
