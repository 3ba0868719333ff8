"""tools/bench_kernels.py runs end to end (small shapes, interpret mode) and writes its table files."""

import json
import os
import subprocess
import sys

import pytest
from paths import ROOT



def test_small_run_writes_json_and_markdown(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_kernels.py"), "--size", "small", "--iters", "1",
         "--kernels", "grouped_matmul,rms_norm", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "kernels_small_cpu.json").read_text())
    seen = {(r["kernel"], r["backend"], r["pass"]) for r in data["rows"]}
    assert {("grouped_matmul", b, p) for b in ("xla", "pallas", "dense") for p in ("fwd", "fwd+bwd")} <= seen
    assert {("rms_norm", b, p) for b in ("xla", "pallas") for p in ("fwd", "fwd+bwd")} <= seen
    assert all("seconds" in r and r["tflops"] > 0 for r in data["rows"]), [r for r in data["rows"] if "error" in r]
    assert "interpret mode" in (tmp_path / "kernels_small_cpu.md").read_text()


@pytest.mark.parametrize("args, words", [(["--kernels", "matmul"], "unknown kernel"),
                                         (["--iters", "0"], "--iters must be >= 1")])
def test_bad_flags_are_one_line_errors(tmp_path, args, words):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_kernels.py"), *args,
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and words in result.stderr


_VENDOR_ROW = """
import json, sys
sys.path.insert(0, sys.argv[1])
from zaya_jax.kernels import xla_flags
xla_flags.require({"moe_kernel": "hipblaslt"})  # what --platform rocm does before JAX starts
import bench_kernels
from zaya_jax.kernels.registry import targeting
with targeting("rocm"):  # on CPU the vendor backend is the same ragged_dot, so it runs here
    cases = bench_kernels.grouped_matmul_cases(bench_kernels.SIZES["small"])
    [vendor] = [c for c in cases if c.backend == "hipblaslt"]
    rows = bench_kernels.measure(vendor, 1)
print(json.dumps([c.backend for c in cases]) + " " + json.dumps(rows[0]["pass"]))
"""


def test_the_vendor_grouped_gemm_is_timed_where_its_flags_were_set_before_jax_started():
    result = subprocess.run([sys.executable, "-c", _VENDOR_ROW, os.path.join(ROOT, "tools")], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == '["xla", "pallas", "hipblaslt", "dense"] "fwd"'  # tiled: the CPU target's


def test_without_its_flags_at_the_start_the_vendor_grouped_gemm_is_left_out():
    import jax

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_kernels
    from zaya_jax.kernels.registry import targeting

    jax.devices()  # started, without the hipBLASLt flags: XLA would not read them now
    with targeting("rocm"):
        assert bench_kernels.vendor_gemm() == ()
