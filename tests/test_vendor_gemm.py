"""Vendor grouped GEMMs for the experts (`model.moe_kernel=cudnn` on NVIDIA, `hipblaslt` on ROCm):
which target takes which backend, the XLA flag each needs (set before JAX starts, refused after),
that they lower for their GPU as XLA's ragged_dot with no Pallas call, and the banner line.
Also: cuDNN attention is refused for training (packed rows) and kept for inference.

Nothing here runs on a GPU: programs for a GPU target are lowered, not run, and the flag tests
start fresh Python processes (XLA reads XLA_FLAGS once, when JAX starts).
"""

import io
import json
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.errors import ZayaError
from zaya_jax.experiment import load_experiment
from zaya_jax.kernels import gpu_lowering, ops, reference, registry, xla_flags
from zaya_jax.kernels.registry import targeting
from paths import ROOT, TINY

BASE = os.path.join(ROOT, "experiments", "layouts", "base.py")
CUDNN_FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"
HIPBLASLT_FLAG = "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true"
CUBLASLT_FLAG = "--xla_gpu_enable_cublaslt=true"  # XLA's rewriter takes the grouped GEMM only with it
VENDOR = {"cuda": "cudnn", "rocm": "hipblaslt"}


# ---------------------------------------------------------------------------------------------
# The registry


@pytest.mark.parametrize("target", registry.TARGETS)
def test_each_vendor_gemm_resolves_on_its_target_only_and_says_what_to_use_instead(target):
    refusals = {
        ("cudnn", "cpu"): "needs an NVIDIA GPU (the target is cpu); use 'pallas' or 'xla'",
        ("cudnn", "rocm"): "needs an NVIDIA GPU (the target is rocm); use 'hipblaslt', 'pallas' or 'xla'",
        ("cudnn", "tpu"): "needs an NVIDIA GPU (the target is tpu); use 'xla'",
        ("hipblaslt", "cpu"): "needs an AMD GPU (ROCm) (the target is cpu); use 'pallas' or 'xla'",
        ("hipblaslt", "cuda"): "needs an AMD GPU (ROCm) (the target is cuda); use 'cudnn', 'pallas' or 'xla'",
        ("hipblaslt", "tpu"): "needs an AMD GPU (ROCm) (the target is tpu); use 'xla'",
    }
    with targeting(target):
        for backend in ("cudnn", "hipblaslt"):
            if VENDOR.get(target) == backend:
                assert registry.resolve("grouped_matmul", backend) == backend
                continue
            with pytest.raises(ZayaError) as e:
                registry.resolve("grouped_matmul", backend)
            assert str(e.value) == f"the {backend} grouped_matmul backend " + refusals[backend, target]


def test_the_flag_table_is_the_one_source_and_no_default_needs_a_flag():
    assert registry.XLA_FLAGS == {("grouped_matmul", "cudnn"): CUDNN_FLAG,
                                  ("grouped_matmul", "hipblaslt"): f"{HIPBLASLT_FLAG} {CUBLASLT_FLAG}"}
    for kernel, backend in registry.XLA_FLAGS:
        assert backend in registry.BACKENDS[kernel] and (kernel, backend) in registry.VENDOR_BACKENDS
    assert not any((k, b) in registry.XLA_FLAGS for row in registry.DEFAULTS.values() for k, b in row.items())
    assert registry.describe("grouped_matmul", "cudnn") == \
        f"cudnn (XLA ragged_dot → cuDNN grouped GEMM; {CUDNN_FLAG})"
    assert registry.describe("grouped_matmul", "pallas") == "pallas"
    assert registry.describe("attention", "cudnn") == "cudnn"
    with pytest.raises(ZayaError, match=r"must be one of \('auto', 'reference', 'xla', 'pallas'\)"):
        registry.resolve("rms_norm", "hipblaslt")


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_vendor_backends_compute_the_xla_ragged_dot_values(target):
    """The vendor names route to the same ragged_dot (only XLA's GPU compiler tells them apart), so
    under their target they run on CPU too, with the xla backend's values."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs, rhs = jax.random.normal(k1, (40, 16)), jax.random.normal(k2, (3, 16, 24))
    dout, sizes = jax.random.normal(k3, (40, 24)), jnp.array([10, 0, 25], jnp.int32)  # 5 rows past the groups
    with targeting(target):
        out = ops.grouped_matmul(lhs, rhs, sizes, backend=VENDOR[target])
        wgrad = ops.grouped_matmul_transposed(lhs, dout, sizes, backend=VENDOR[target])
    np.testing.assert_allclose(out, reference.grouped_matmul(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(wgrad, reference.grouped_matmul_transposed(lhs, dout, sizes, 3), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The XLA flags


def test_require_appends_once_before_jax_starts_and_refuses_after(monkeypatch):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    monkeypatch.setattr(xla_flags, "backends_started", lambda: False)
    assert xla_flags.require({"moe_kernel": "cudnn", "attention_kernel": "auto"}, env) == [CUDNN_FLAG]
    assert xla_flags.require({"moe_kernel": "cudnn"}, env) == [CUDNN_FLAG]  # already there: not again
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {CUDNN_FLAG}"
    assert xla_flags.require({"moe_kernel": "pallas", "attention_kernel": "cudnn"}, env) == []
    both = {"XLA_FLAGS": CUBLASLT_FLAG}
    assert xla_flags.require({"moe_kernel": "hipblaslt"}, both) == [HIPBLASLT_FLAG, CUBLASLT_FLAG]
    assert both["XLA_FLAGS"] == f"{CUBLASLT_FLAG} {HIPBLASLT_FLAG}"  # the one missing, once
    with pytest.raises(ZayaError, match=r"^model.moe_kernel=hipblaslt needs .*_grouped_gemm=true, but XLA_FLAGS "
                                        r"sets .*_grouped_gemm=false; remove that from XLA_FLAGS$"):
        xla_flags.require({"moe_kernel": "hipblaslt"}, {"XLA_FLAGS": HIPBLASLT_FLAG.replace("true", "false")})
    monkeypatch.setattr(xla_flags, "backends_started", lambda: True)
    assert xla_flags.require({"moe_kernel": "cudnn"}, env) == [CUDNN_FLAG]  # set before the start: fine
    with pytest.raises(ZayaError, match=rf"^model.moe_kernel=hipblaslt needs XLA_FLAGS={HIPBLASLT_FLAG}, which XLA "
                                        r"reads only when JAX starts, .*; set XLA_FLAGS=.* before starting Python$"):
        xla_flags.require({"moe_kernel": "hipblaslt"}, env)


def _fresh_python(code: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_in_a_fresh_process_the_flag_is_appended_and_jax_starts_with_it():
    seen = _fresh_python("""
import json, os
from zaya_jax.errors import ZayaError
from zaya_jax.kernels import xla_flags
out = {"started_before": xla_flags.backends_started()}
xla_flags.require({"moe_kernel": "cudnn"})
xla_flags.require({"moe_kernel": "cudnn"})
out["flags"] = os.environ["XLA_FLAGS"]
import jax
out["devices"] = len(jax.devices())  # XLA parsed XLA_FLAGS (an unknown flag aborts the process)
try:
    xla_flags.require({"moe_kernel": "hipblaslt"})
except ZayaError as e:
    out["after"] = str(e)
print(json.dumps(out))
""")
    assert seen["started_before"] is False
    assert seen["flags"] == f"--xla_force_host_platform_device_count=2 {CUDNN_FLAG}"
    assert seen["devices"] == 2
    assert "JAX has already started in this process" in seen["after"]


def test_zaya_train_sets_the_flag_before_jax_starts():
    """`zaya train` on a (simulated) NVIDIA machine: the XLA_FLAGS JAX starts with hold the cuDNN flag."""
    seen = _fresh_python(f"""
import json, os, jax
from jax._src import xla_bridge
from zaya_jax import cli
from zaya_jax.kernels import registry
from zaya_jax.train import loop

seen = {{}}
start = xla_bridge._init_backend
def recording_start(platform):
    seen.setdefault("flags_at_start", os.environ.get("XLA_FLAGS", ""))
    return start(platform)
xla_bridge._init_backend = recording_start
registry.machine_target = lambda: (jax.devices(), "cuda")[1]  # starts JAX, as the real one does
def train(exp, workdir, **placement):
    seen["moe_kernel"] = exp.model.moe_kernel
    return {{"stopped_by": None, "exit_code": 0}}
loop.train = train
seen["rc"] = cli.main(["train", "--config={TINY}", "--workdir=unused", "--config.model.moe_kernel=cudnn"])
print(json.dumps(seen))
""")
    assert seen == {"flags_at_start": f"--xla_force_host_platform_device_count=2 {CUDNN_FLAG}",
                    "moe_kernel": "cudnn", "rc": 0}


# ---------------------------------------------------------------------------------------------
# Lowering for the GPU: XLA's ragged_dot, no Pallas


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_grouped_matmul_forward_and_backward_lower_to_ragged_dot_without_triton(platform):
    spec = jax.ShapeDtypeStruct

    def loss(lhs, rhs, sizes):
        out = ops.grouped_matmul(lhs, rhs, sizes, preferred_element_type=jnp.float32, backend=VENDOR[platform])
        return jnp.sum(out)

    args = (spec((256, 64), jnp.bfloat16), spec((4, 64, 128), jnp.bfloat16), spec((4,), jnp.int32))
    text = gpu_lowering.lower(jax.value_and_grad(loss, (0, 1)), args, platform)
    assert not gpu_lowering.triton_calls(text)
    assert text.count('"chlo.ragged_dot"') == 3  # forward, input gradient, weight gradient
    # All three GEMMs take bf16 operands and write bf16: XLA hands a ragged_dot with any fp32 among
    # them, its result included, to the padded dense form instead of the vendor's grouped GEMM.
    types = re.findall(r'"chlo\.ragged_dot".*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>, [^)]*\) -> '
                       r'tensor<[^>]*x(\w+)>', text)
    assert types == [("bf16", "bf16", "bf16")] * 3, types


def test_train_step_with_cudnn_experts_lowers_for_cuda_with_no_pallas_grouped_matmul(monkeypatch):
    from zaya_jax.kernels import gpu_lowering
    from zaya_jax.train.program import program_for_target

    ok, why = gpu_lowering.can_lower("cuda")
    if not ok:
        pytest.skip(why)

    # This process's JAX has started, so the flag must already be in XLA_FLAGS (it only names it here).
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {CUDNN_FLAG}")
    program = program_for_target(BASE, ["--config.model.num_hidden_layers=1", "--config.model.compute_dtype=bfloat16",
                                        "--config.train.remat=none", "--config.model.moe_kernel=cudnn"], "cuda",
                                 jax.devices()[:1])
    text = program.lower_train_step().as_text()
    calls = gpu_lowering.triton_calls(text)
    assert not any("grouped_matmul" in name for name in calls)
    # Attention and norms are still Pallas, in the step's forward and the solve balancer's re-route.
    assert calls["zaya_forward_kernel"] == 2 and calls["zaya_rms_norm_fwd"] == 7
    # gate/up, down: forward, input and weight gradients, and the solve balancer's re-route forward
    assert text.count('"chlo.ragged_dot"') == 8


def test_banner_names_the_vendor_gemm_and_its_flag(monkeypatch):
    from zaya_jax.parallel.topology import Topology
    from zaya_jax.train import console

    monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {CUDNN_FLAG}")
    from zaya_jax.train.program import program_for_target

    program = program_for_target(TINY, ["--config.model.moe_kernel=cudnn"], "cuda", jax.devices()[:1])
    out = io.StringIO()
    console.banner(out, program.exp, program, types.SimpleNamespace(describe=lambda: "docs"), "/w", None, Topology())
    line = next(l for l in out.getvalue().splitlines() if l.startswith("  kernels"))
    assert line == (f"  kernels attention pallas, experts cudnn (XLA ragged_dot → cuDNN grouped GEMM; {CUDNN_FLAG}), "
                    "norm pallas")


# ---------------------------------------------------------------------------------------------
# cuDNN attention: not for training, still for inference


def test_cudnn_attention_trains_on_nvidia_and_is_refused_elsewhere_in_one_sentence():
    with targeting("cuda"):  # packed rows are its mask now: it validates for training on NVIDIA
        load_experiment(TINY, ["--config.model.attention_kernel=cudnn"])
    for target in ("cpu", "rocm"):
        with targeting(target), pytest.raises(ZayaError) as e:
            load_experiment(TINY, ["--config.model.attention_kernel=cudnn"])
        assert str(e.value) == (
            f"{TINY} with overrides: model.attention_kernel: the cudnn attention backend needs an NVIDIA GPU "
            f"(the target is {target}); use 'pallas' or 'xla'")


def test_load_takes_kernel_backends_for_inference(tmp_path):
    import zaya_jax
    from zaya_jax.checkpoint import orbax_store
    from zaya_jax.config import preset
    from zaya_jax.model.state import expected_shapes

    cfg = preset("tiny", num_hidden_layers=1)
    path = str(tmp_path / "model")
    orbax_store.save_groups(path, cfg, [{k: np.zeros(s, np.float32) for k, s in expected_shapes(cfg).items()}])
    model = zaya_jax.load(path, attention_kernel="cudnn")
    assert (model.cfg.attention_kernel, model.cfg.moe_kernel) == ("cudnn", "auto")
    with pytest.raises(ZayaError, match="cudnn attention backend needs an NVIDIA GPU"):  # this machine has none
        model(jnp.array([[3, 4, 5]]))
    with pytest.raises(ZayaError, match="model.moe_kernel=hipblaslt needs XLA_FLAGS=.*JAX has already started"):
        zaya_jax.load(path, moe_kernel="hipblaslt")  # this process started JAX without the flag
    with pytest.raises(ZayaError, match="moe_kernel must be one of"):
        zaya_jax.load(path, moe_kernel="cublas")
