"""XLA's ROCm compiler without an AMD GPU (explore/rocm_standin.py, tools/rocm_compile_setup.py):
stand-ins made from a library's undefined symbols, and compile-only MI300X devices."""

import os
import shutil
import subprocess
import sys

import pytest

from zaya_jax.explore import deviceless, rocm_standin
from paths import ROOT

needs_gcc = pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("nm") and shutil.which("readelf")),
                               reason="the stand-ins are built with gcc and binutils")
MI300X = os.path.join(ROOT, "benchmarks", "gpu_targets", "mi300x.txtpb")


def _gcc(*args):
    subprocess.run(["gcc", "-shared", "-fPIC", *args], check=True, capture_output=True)


# A consumer like the plugin: its loading registers a kernel, and one entry point calls the runtime.
_CONSUMER = r"""
extern void **__hipRegisterFatBinary(void *);
extern int hipMalloc(void **, unsigned long);
__attribute__((constructor)) static void load(void) { __hipRegisterFatBinary(0); }
int run(void) { void *p; return hipMalloc(&p, 16); }
"""
_RUN = """
import ctypes, sys
for path in sys.argv[1:-1]:
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
consumer = ctypes.CDLL(sys.argv[-1])
print("loaded", flush=True)
consumer.run()
"""


@needs_gcc
def test_stand_ins_export_what_a_library_takes_quiet_at_load_and_refusing_a_run(tmp_path):
    """Built from the undefined symbols (with their version nodes) of a library linked against a
    real `libamdhip64.so.7`: it loads on the stand-in alone (registration returns quietly), and
    calling the runtime stops with the one line that says the stand-in only compiles."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "hip.c").write_text("void **__hipRegisterFatBinary(void *d) { return 0; }\n"
                                "int hipMalloc(void **p, unsigned long n) { return 0; }\n")
    (real / "hip.map").write_text("hip_4.2 { global: hipMalloc; __hipRegisterFatBinary; };\n")
    _gcc("-o", str(real / "libamdhip64.so.7"), str(real / "hip.c"), "-Wl,-soname,libamdhip64.so.7",
         f"-Wl,--version-script={real / 'hip.map'}")
    (tmp_path / "consumer.c").write_text(_CONSUMER)
    consumer = tmp_path / "consumer.so"
    _gcc("-o", str(consumer), str(tmp_path / "consumer.c"), str(real / "libamdhip64.so.7"))

    needed, symbols = rocm_standin.undefined_symbols(str(consumer))
    assert "libamdhip64.so.7" in needed and ("hipMalloc", "hip_4.2") in symbols
    [made] = rocm_standin.build([str(consumer)], str(tmp_path / "standin"))
    assert os.path.basename(made) == "libamdhip64.so.7"
    run = subprocess.run([sys.executable, "-c", _RUN, made, str(consumer)], capture_output=True, text=True,
                         timeout=60)
    assert run.stdout.startswith("loaded")  # the constructor's registration was answered
    assert run.returncode != 0
    assert "hipMalloc called on the stand-in libamdhip64.so.7, which only lets XLA compile" in run.stderr


def test_a_symbol_goes_to_its_library_by_version_node_then_by_name():
    assert rocm_standin.library_of("miopenCreate", "MIOPEN_HIP_1") == "libMIOpen"
    assert rocm_standin.library_of("hipMemcpy", "hip_4.2") == "libamdhip64"
    assert rocm_standin.library_of("rocblas_create_handle", "") == "librocblas"
    assert rocm_standin.library_of("hipblasLtMatmul", "") == "libhipblaslt"
    assert rocm_standin.library_of("ncclCommInitRank", "") == "librccl"
    assert rocm_standin.library_of("PyDict_New", "") is None  # the process's, not ROCm's


def test_a_target_names_its_platform():
    assert deviceless.target_platform(deviceless.read_target(MI300X)) == "rocm"
    h100 = os.path.join(ROOT, "benchmarks", "gpu_targets", "h100_sxm.txtpb")
    assert deviceless.target_platform(deviceless.read_target(h100)) == "cuda"


def test_a_rocm_target_without_the_set_up_is_one_line_naming_the_command(tmp_path, monkeypatch):
    from zaya_jax.errors import ZayaError

    monkeypatch.setenv("ZAYA_ROCM_COMPILE_DIR", str(tmp_path))
    with pytest.raises(ZayaError, match="compile-only ROCm set-up in .* run python tools/rocm_compile_setup.py"):
        rocm_standin.register()


_COMPILE = """
import sys
import jax, jax.numpy as jnp
from zaya_jax import kernels
from zaya_jax.explore import deviceless
from zaya_jax.kernels.registry import device_target, targeting
deviceless.use_cpu_host()
[device] = deviceless.gpu_devices(deviceless.read_target(sys.argv[1]), 1, 1, sys.argv[1])
on = jax.sharding.SingleDeviceSharding(device)
x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=on)
w = jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=on)
with targeting(device_target(device)):
    norm = lambda x, w: kernels.rms_norm(x, w, eps=1e-6, out_dtype=jnp.bfloat16, backend="pallas")
    hlo = jax.jit(norm).trace(x, w).lower().compile().as_text()
print(device.device_kind, device_target(device), "triton" in hlo)
"""


@pytest.mark.skipif(not os.path.exists(os.path.join(rocm_standin.setup_dir(), rocm_standin.PLUGIN_LIBRARY)),
                    reason="no compile-only ROCm set-up here: python tools/rocm_compile_setup.py")
@pytest.mark.parametrize("target", ["mi300x", "mi325x", "mi355x"])
def test_a_pallas_kernel_compiles_for_an_amd_gpu_without_one(target):
    path = os.path.join(ROOT, "benchmarks", "gpu_targets", f"{target}.txtpb")
    run = subprocess.run([sys.executable, "-c", _COMPILE, path], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": ""}, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == f"AMD Instinct {target.upper()} rocm True"


_EVERY_KERNEL = """
import sys, time
import jax, jax.numpy as jnp
from zaya_jax.explore import deviceless
from zaya_jax.kernels import gpu_lowering
from zaya_jax.kernels.registry import device_target, targeting
deviceless.use_cpu_host()
[device] = deviceless.gpu_devices(deviceless.read_target(sys.argv[1]), 1, 1, sys.argv[1])
on = jax.sharding.SingleDeviceSharding(device)
for dtype in (jnp.bfloat16, jnp.float32):
    for case in gpu_lowering.kernel_cases(dtype):
        args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on) for a in case.args)
        start = time.perf_counter()
        with targeting(device_target(device)):
            hlo = jax.jit(case.fn).trace(*args).lower().compile().as_text()
        found = all(name in hlo for name in case.expected)
        print(f"CASE {jnp.dtype(dtype).name}|{case.name}|{found}|{time.perf_counter() - start:.1f}", flush=True)
"""


@pytest.mark.skipif(not os.path.exists(os.path.join(rocm_standin.setup_dir(), rocm_standin.PLUGIN_LIBRARY)),
                    reason="no compile-only ROCm set-up here: python tools/rocm_compile_setup.py")
def test_every_kernel_compiles_to_amdgpu_code_at_zaya1_shapes_forward_and_backward():
    """Flash attention (causal, GQA, packed documents, a split sequence's second half), the grouped
    matmul (both transposes), RMSNorm and linear attention, with the block sizes the registry picks
    for ROCm: XLA's ROCm compiler builds each within the MI300X's 64 KiB of LDS (a row that asks
    for more is refused there: RESOURCE_EXHAUSTED), and the compiled program calls our kernels."""
    run = subprocess.run([sys.executable, "-c", _EVERY_KERNEL, MI300X], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": ""}, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    cases = [line.split("|") for line in run.stdout.splitlines() if line.startswith("CASE ")]
    assert len(cases) == 20, run.stdout
    assert all(found == "True" for _, _, found, _ in cases), cases


_VENDOR_GEMM = """
import re, sys
from zaya_jax.kernels import xla_flags
flags = xla_flags.require({"moe_kernel": "hipblaslt"})  # before JAX starts, as `zaya train` does
import jax, jax.numpy as jnp
from zaya_jax import kernels
from zaya_jax.explore import deviceless
from zaya_jax.kernels.registry import device_target, targeting
deviceless.use_cpu_host()
[device] = deviceless.gpu_devices(deviceless.read_target(sys.argv[1]), 1, 1, sys.argv[1])
on = jax.sharding.SingleDeviceSharding(device)
args = (jax.ShapeDtypeStruct((16384, 2048), jnp.bfloat16, sharding=on),
        jax.ShapeDtypeStruct((16, 2048, 2048), jnp.bfloat16, sharding=on),
        jax.ShapeDtypeStruct((16,), jnp.int32, sharding=on))
for backend in ("hipblaslt", "pallas"):
    def loss(lhs, rhs, sizes):
        out = kernels.grouped_matmul(lhs, rhs, sizes, preferred_element_type=jnp.float32, backend=backend)
        return jnp.sum(out)
    with targeting(device_target(device)):
        hlo = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(*args).lower().compile().as_text()
    grouped = hlo.count('custom_call_target="__cublas$lt$groupedMatmul"')
    # XLA's padded dense form multiplies [rows, experts x hidden]: a 32768-wide operand.
    dense = len(re.findall(r"= bf16\\[16384,32768\\]", hlo))
    print(f"GEMM {backend}|{grouped}|{dense}|{'triton' in hlo}", flush=True)
print("FLAGS " + " ".join(flags))
"""


@pytest.mark.skipif(not os.path.exists(os.path.join(rocm_standin.setup_dir(), rocm_standin.PLUGIN_LIBRARY)),
                    reason="no compile-only ROCm set-up here: python tools/rocm_compile_setup.py")
def test_the_hipblaslt_experts_compile_to_hipblaslt_grouped_gemms_beside_the_pallas_kernel():
    """`moe_kernel=hipblaslt` at ZAYA1's expert shape, forward and both gradients, compiled for an
    MI300X: XLA emits hipBLASLt's grouped GEMM for all three (no padded dense GEMM over every
    expert), while in the same process the Pallas backend is still our Triton kernel."""
    run = subprocess.run([sys.executable, "-c", _VENDOR_GEMM, MI300X], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "", "XLA_FLAGS": ""}, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line[5:].split("|")[0]: line[5:].split("|")[1:] for line in run.stdout.splitlines()
            if line.startswith("GEMM ")}
    assert rows == {"hipblaslt": ["3", "0", "False"], "pallas": ["0", "0", "True"]}, run.stdout
    assert run.stdout.splitlines()[-1] == ("FLAGS --xla_gpu_experimental_use_ragged_dot_grouped_gemm=true "
                                           "--xla_gpu_enable_cublaslt=true")


@pytest.mark.parametrize("args, words", [
    (["--dir", "/proc/zaya/rocm"], "--dir /proc/zaya/rocm is not writable"),
    (["--dri", "/tmp/x"], "unrecognized arguments: --dri"),
])
def test_the_set_up_tool_refuses_bad_input_in_one_line_before_installing(args, words):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "rocm_compile_setup.py"), *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rocm_compile_setup: error:") and words in lines[0], lines
    assert "installing" not in run.stdout


def test_zaya_mesh_with_an_amd_target_and_no_set_up_is_one_line_naming_the_command(tmp_path):
    from zaya_process import zaya, zaya_env
    from paths import TINY

    result = zaya("mesh", f"--config={TINY}", "--hardware=mi300x", "--top=1", "--validate", f"--gpu-target={MI300X}",
                  env=zaya_env(ZAYA_ROCM_COMPILE_DIR=str(tmp_path)))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"zaya: error: a ROCM --gpu-target needs the compile-only ROCm set-up in {tmp_path}, which is not there: "
        "run python tools/rocm_compile_setup.py")
