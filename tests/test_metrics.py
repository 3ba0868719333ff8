"""Hardware table, analytic FLOPs / MFU, and the metrics writer (JSONL + TensorBoard)."""

import contextlib
import ctypes
import json
import math
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_outputs import tensorboard_events

from zaya_jax import hardware
from zaya_jax.config import ModelConfig, preset
from zaya_jax.errors import ZayaError
from zaya_jax.train import flops
from zaya_jax.train.metrics_writer import MetricsWriter
from zaya_process import python_probe

# ---------------------------------------------------------------------------------------------
# hardware


def test_profiles_hold_the_datasheet_peaks():
    assert hardware.profile("mi300x").peak_bf16_tflops == 1307.4
    assert hardware.profile("MI355X").hbm_gb == 288
    assert hardware.profile("h100").hbm_tb_per_s == 3.35
    assert hardware.profile("cpu").nominal and not hardware.profile("h200").nominal
    assert all(p.source for p in hardware.PROFILES.values())


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ZayaError, match="mi300x"):
        hardware.profile("tpu-v5p")


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    ("AMD Instinct MI300X", "mi300x"),
    ("AMD Instinct MI300X VF", "mi300x"),
    ("MI325X", "mi325x"),
    ("AMD Instinct MI355X", "mi355x"),
    ("NVIDIA H100 PCIe", None),  # lower clocks than the SXM peak
    ("NVIDIA GH200 480GB", None),
    ("TPU v5p", None),
])
def test_detect_maps_device_kinds(kind, name):
    found = hardware.detect(types.SimpleNamespace(platform="gpu", device_kind=kind))
    assert (found.name if found else None) == name


def test_detect_cpu_device_is_nominal():
    found = hardware.detect(jax.devices("cpu")[0])
    assert found.name == "cpu" and found.nominal


# ---------------------------------------------------------------------------------------------
# flops


def test_zaya1_base_flops_match_the_digest():
    cfg = ModelConfig()
    macs = flops.matmul_params_per_token(cfg)
    assert macs == pytest.approx(1.290e9, rel=5e-3)
    at4k = flops.training_flops_per_token(cfg, 4096)
    assert at4k.dense == pytest.approx(7.74e9, rel=5e-3)
    assert at4k.attention == pytest.approx(1.007e9, rel=5e-3)
    assert at4k.total == at4k.dense + at4k.attention
    assert flops.training_flops_per_token(cfg, 32768).attention == pytest.approx(8.05e9, rel=5e-3)
    # The LM head is ≈42% of the dense work: ZAYA1's 262K-token vocabulary against
    # only 760M active parameters a token (top-1 experts).
    assert cfg.vocab_size * cfg.hidden_size / macs == pytest.approx(0.416, abs=0.005)


def test_tiny_flops_by_hand():
    cfg = preset("tiny")  # H=64, L=2, nq=4, nk=2, d=16, E=4, I=32, R=16, V=256, t0=t1=2
    attn_proj = 64 * 64 + 64 * 32 + 2 * 64 * 16 + 64 * 64  # 12288
    convs = 2 * 6 * 16 * 16 + 2 * 96  # 3072 + 192
    router = 64 * 16 + 2 * 16 * 16 + 16 * 5  # 1616
    expert = 3 * 64 * 32  # 6144
    assert attn_proj + convs + router + expert == 23312
    assert flops.matmul_params_per_token(cfg) == 2 * 23312 + 256 * 64  # 63008
    f = flops.training_flops_per_token(cfg, 128)
    assert f.dense == 6 * 63008
    assert f.attention == 3 * 2 * 4 * 128 * 4 * 16 / 2  # 98304
    assert f.total == 6 * 63008 + 98304


def test_training_flops_rejects_bad_seq_len():
    with pytest.raises(ZayaError, match="seq_len"):
        flops.training_flops_per_token(preset("tiny"), 0)


def test_mfu_reproduces_the_zaya1_estimate():
    # ZAYA1's pretraining throughput (the ZAYA1 technical report: 2.5 s a step of 4096 × 4096 tokens on
    # 1,024 MI300X, 6.55 K tok/s/GPU) at 8.75 GFLOP/token is ≈4.4% MFU.
    f = flops.training_flops_per_token(ModelConfig(), 4096)
    value = flops.mfu(f.total, 6.55e3 * 1024, 1024, hardware.profile("mi300x").peak_bf16_tflops)
    assert value == pytest.approx(0.044, abs=0.001)
    assert flops.mfu(2e12, 1.0, 2, 1.0) == 1.0
    with pytest.raises(ValueError):
        flops.mfu(1.0, 1.0, 0, 1.0)


# ---------------------------------------------------------------------------------------------
# metrics writer


def scalar_points(events):
    """{tag: [(step, value), ...]} from the scalar summaries."""
    points = {}
    for event in events:
        for value in event.summary.value:
            points.setdefault(value.tag, []).append((event.step, value.simple_value))
    return points


RECORDS = [
    (1, {"loss": 5.5, "lr": np.float32(0.25), "tokens": 4096,
         "experts": {"max_load": jnp.float32(1.5), "skip_frac": 0.125}, "load": np.array([0.5, 1.5])}),
    (2, {"loss": jnp.asarray(4.75), "lr": 0.5, "tokens": np.int64(8192), "note": "warm",
         "experts": {"max_load": 1.25, "skip_frac": 0.0}, "load": [1.0, 1.0]}),
    (3, {"loss": float("nan"), "lr": 0.5, "tokens": 12288, "grad_norm": float("inf")}),
]


def write_records(workdir):
    with MetricsWriter(str(workdir)) as writer:
        for step, record in RECORDS:
            writer.write(step, record)


def test_jsonl_one_object_per_line_with_exact_values(tmp_path):
    write_records(tmp_path)
    with open(tmp_path / "metrics.jsonl") as f:
        lines = f.read().splitlines()
    rows = [json.loads(line) for line in lines]
    assert rows[0] == {"step": 1, "loss": 5.5, "lr": 0.25, "tokens": 4096,
                       "experts": {"max_load": 1.5, "skip_frac": 0.125}, "load": [0.5, 1.5]}
    assert rows[1] == {"step": 2, "loss": 4.75, "lr": 0.5, "tokens": 8192, "note": "warm",
                       "experts": {"max_load": 1.25, "skip_frac": 0.0}, "load": [1.0, 1.0]}
    assert rows[2] == {"step": 3, "loss": None, "lr": 0.5, "tokens": 12288, "grad_norm": None}
    assert isinstance(rows[1]["tokens"], int)


def test_jsonl_appends_and_is_flushed_before_close(tmp_path):
    write_records(tmp_path)
    writer = MetricsWriter(str(tmp_path))
    writer.write(4, {"loss": 1.0})
    with open(tmp_path / "metrics.jsonl") as f:  # read while still open: already on disk
        assert json.loads(f.read().splitlines()[-1]) == {"step": 4, "loss": 1.0}
    writer.close()
    writer.close()
    with pytest.raises(ValueError):
        writer.write(5, {"loss": 1.0})


def test_tensorboard_scalars_read_back(tmp_path):
    write_records(tmp_path)
    points = scalar_points(tensorboard_events(tmp_path / "tensorboard"))
    # A flat list of numbers (per-layer values) is one tag per entry.
    assert set(points) == {"loss", "lr", "tokens", "experts/max_load", "experts/skip_frac", "grad_norm",
                           "load/0", "load/1"}
    assert points["load/1"] == [(1, 1.5), (2, 1.0)]
    assert points["loss"][:2] == [(1, 5.5), (2, 4.75)]
    assert math.isnan(points["loss"][2][1])
    assert points["lr"] == [(1, 0.25), (2, 0.5), (3, 0.5)]
    assert points["tokens"] == [(1, 4096.0), (2, 8192.0), (3, 12288.0)]
    assert points["experts/max_load"] == [(1, 1.5), (2, 1.25)]
    assert points["grad_norm"] == [(3, math.inf)]


def test_record_with_step_key_or_bad_value_is_rejected(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        with pytest.raises(ValueError, match="step"):
            writer.write(1, {"step": 1})
        with pytest.raises(TypeError):
            writer.write(1, {"z": 1j})


def test_workdir_under_a_file_raises_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    workdir = str(blocker / "run")
    with pytest.raises(ZayaError, match=re.escape(workdir)):
        MetricsWriter(workdir)


@contextlib.contextmanager
def _file_permissions_bind_root():
    """Root (CI's user) writes anywhere through CAP_DAC_OVERRIDE (and reads through
    CAP_DAC_READ_SEARCH). Inside this block the calling thread runs without them, so a directory
    without write permission stops it as it stops anyone; for other users, a no-op. capset(2) with
    pid 0 changes this thread only, and the capabilities stay permitted, so they come back after."""
    if os.geteuid() != 0:
        yield
        return

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip(f"capget failed: {os.strerror(ctypes.get_errno())}")
    effective = data[0].effective
    data[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        data[0].effective = effective
        assert libc.capset(ctypes.byref(header), data) == 0, "could not restore this thread's capabilities"


def test_unwritable_workdir_is_a_one_line_error_naming_it(tmp_path):
    """A workdir inside a directory the user may not write to (root included, its override dropped):
    the metrics writer names it, and `zaya train`'s check (`prepare_workdir`) says why in one line,
    as a ZayaError, which the CLI prints and exits with status 2 on."""
    from zaya_jax.train.loop import prepare_workdir

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    workdir = str(locked / "run")
    try:
        with _file_permissions_bind_root():
            with pytest.raises(ZayaError, match=re.escape(workdir)):
                MetricsWriter(workdir)
            with pytest.raises(ZayaError) as error:
                prepare_workdir(workdir)
    finally:
        locked.chmod(0o700)
    assert str(error.value) == (f"--workdir {workdir} is not writable (Permission denied); "
                                "choose a directory you can write")
    assert error.value.exit_code == 2
    assert not os.path.exists(workdir)


def test_the_metrics_writer_loads_tensorboardx_without_torch_and_leaves_torch_importable():
    """tensorboardX imports torch (a second of every start) only to name torch tensors in hints."""
    pytest.importorskip("torch")
    probe = ("import sys; import zaya_jax.train.metrics_writer; print('torch' in sys.modules); "
             "import torch; print(torch.zeros(1).shape == (1,))")
    out = python_probe(probe)
    assert out.stdout.split() == ["False", "True"], out.stderr
