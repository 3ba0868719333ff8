"""`zaya bench host` (`bench/host.py`): this machine's matmul rate and memory bandwidth, written for
`zaya mesh --host`, which prices the explorer's compute and memory streams at them
(`hardware.measured`); bad input is one line and exit status 2."""

import json

import pytest

from paths import TINY
from zaya_jax import hardware
from zaya_jax.errors import ZayaError
from zaya_process import zaya


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    path = tmp_path_factory.mktemp("host") / "host.json"
    done = zaya("bench", "host", f"--out={path}", "--iters=2", "--cpu-devices=2", devices=None)
    assert done.returncode == 0, done.stderr
    assert f"use it with zaya mesh --host={path}" in done.stdout
    return path, json.loads(path.read_text())


def test_the_record_holds_positive_rates_per_dtype(record):
    _, r = record
    assert r["tool"] == "zaya bench host" and r["platform"] == "cpu"
    assert set(r["matmul_tflops"]) == {"float32", "bfloat16"}
    assert all(v > 0 for v in r["matmul_tflops"].values()) and r["memory_gb_per_s"] > 0
    assert r["devices"] == 2 and r["elementwise_gb_per_s"] > 0  # per device, both running at once
    for dtype, curve in r["matmul_curve"].items():  # 64 to 2048 wide, the last point the rate
        assert [f for f, _ in curve] == [2 * n ** 3 for n in (64, 128, 256, 512, 1024, 2048)]
        assert curve[-1][1] == r["matmul_tflops"][dtype] and all(rate > 0 for _, rate in curve)


def test_a_measured_profile_is_the_rate_of_the_runs_dtype_at_full_efficiency(record):
    path, r = record
    hw = hardware.measured(hardware.profile("cpu"), str(path), "float32")
    assert hw.peak_bf16_tflops == r["matmul_tflops"]["float32"] and hw.compute_efficiency == 1.0
    assert hw.hbm_tb_per_s == pytest.approx(r["memory_gb_per_s"] / 1e3) and not hw.nominal
    assert hw.matmul_curve == tuple(tuple(p) for p in r["matmul_curve"]["float32"])
    assert hw.elementwise_tb_per_s == pytest.approx(r["elementwise_gb_per_s"] / 1e3)


def test_a_record_from_before_the_curve_prices_every_matmul_at_its_one_rate():
    old = {"matmul_tflops": {"float32": 0.2}, "memory_gb_per_s": 30.0}
    hw = hardware.measured_from(hardware.profile("cpu"), old, "float32")
    assert hw.matmul_curve == () and hw.elementwise_tb_per_s == 0.0 and hw.peak_bf16_tflops == 0.2


def test_the_explorer_prices_a_layout_at_the_measured_rate(record):
    path, _ = record
    done = zaya("mesh", f"--config={TINY}", "--hardware=cpu", "--gpus-per-node=2", "--top=1", f"--host={path}")
    assert done.returncode == 0, done.stderr
    assert "[nominal hardware numbers]" not in done.stdout  # the measured profile is not the nominal one


def test_bad_host_files_and_flags_are_one_line_errors(tmp_path):
    (tmp_path / "bad.json").write_text('{"matmul_tflops": {"bfloat16": 1.0}}')
    with pytest.raises(ZayaError, match="is not a zaya bench host record"):
        hardware.measured(hardware.profile("cpu"), str(tmp_path / "bad.json"), "float32")
    base = {"matmul_tflops": {"float32": 0.2}, "memory_gb_per_s": 30.0}
    for extra, words in (({"matmul_curve": {"float32": [[1e6]]}}, "malformed matmul_curve"),
                         ({"matmul_curve": {"float32": [[1e6, -1.0]]}}, "not positive"),
                         ({"elementwise_gb_per_s": "fast"}, "malformed")):
        (tmp_path / "bad.json").write_text(json.dumps(base | extra))
        with pytest.raises(ZayaError, match=words):
            hardware.measured(hardware.profile("cpu"), str(tmp_path / "bad.json"), "float32")
    for args, words in ((["mesh", f"--config={TINY}", "--hardware=cpu", f"--host={tmp_path}/none.json"],
                         "does not exist; write it with zaya bench host"),
                        (["bench", "host", f"--out={tmp_path}/no/such/h.json"], "does not exist"),
                        (["bench", "host", f"--out={tmp_path}/h.json", "--iters=0"], "--iters must be at least 1"),
                        (["bench", "host", f"--out={tmp_path}/h.json", "--cpu-devices=-1"], "--cpu-devices must be 0")):
        done = zaya(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], (args, done.stderr)
