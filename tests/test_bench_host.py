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
    done = zaya("bench", "host", f"--out={path}", "--iters=2")
    assert done.returncode == 0, done.stderr
    assert f"use it with zaya mesh --host={path}" in done.stdout
    return path, json.loads(path.read_text())


def test_the_record_holds_positive_rates_per_dtype(record):
    _, r = record
    assert r["tool"] == "zaya bench host" and r["platform"] == "cpu"
    assert set(r["matmul_tflops"]) == {"float32", "bfloat16"}
    assert all(v > 0 for v in r["matmul_tflops"].values()) and r["memory_gb_per_s"] > 0


def test_a_measured_profile_is_the_rate_of_the_runs_dtype_at_full_efficiency(record):
    path, r = record
    hw = hardware.measured(hardware.profile("cpu"), str(path), "float32")
    assert hw.peak_bf16_tflops == r["matmul_tflops"]["float32"] and hw.compute_efficiency == 1.0
    assert hw.hbm_tb_per_s == pytest.approx(r["memory_gb_per_s"] / 1e3) and not hw.nominal


def test_the_explorer_prices_a_layout_at_the_measured_rate(record):
    path, _ = record
    done = zaya("mesh", f"--config={TINY}", "--hardware=cpu", "--gpus-per-node=2", "--top=1", f"--host={path}")
    assert done.returncode == 0, done.stderr
    assert "[nominal hardware numbers]" not in done.stdout  # the measured profile is not the nominal one


def test_bad_host_files_and_flags_are_one_line_errors(tmp_path):
    (tmp_path / "bad.json").write_text('{"matmul_tflops": {"bfloat16": 1.0}}')
    with pytest.raises(ZayaError, match="is not a zaya bench host record"):
        hardware.measured(hardware.profile("cpu"), str(tmp_path / "bad.json"), "float32")
    for args, words in ((["mesh", f"--config={TINY}", "--hardware=cpu", f"--host={tmp_path}/none.json"],
                         "does not exist; write it with zaya bench host"),
                        (["bench", "host", f"--out={tmp_path}/no/such/h.json"], "does not exist"),
                        (["bench", "host", f"--out={tmp_path}/h.json", "--iters=0"], "--iters must be at least 1")):
        done = zaya(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], (args, done.stderr)
