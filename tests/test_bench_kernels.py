"""tools/bench_kernels.py runs end to end (small shapes, interpret mode) and writes its table files."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_unknown_kernel_is_a_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_kernels.py"), "--kernels", "matmul",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "unknown kernel" in result.stderr
