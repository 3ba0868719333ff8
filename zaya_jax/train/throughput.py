"""A run's step records: throughput and MFU over each logging window, and the run's averages.

MFU = model FLOPs per token (`train/flops.py`: active parameters only, causal attention
halved) × tokens per second / (devices × the device's peak dense BF16 FLOP/s from
`zaya_jax/hardware.py`). Tokens per second counts every position of every sequence. The console
shows the records (`train/progress.py`); `metrics.jsonl` and TensorBoard keep them.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from zaya_jax import hardware as hw
from zaya_jax.train.flops import mfu


def device_profile(name: str, device) -> hw.HardwareProfile | None:
    """The peak-FLOPs profile for MFU: the configured one, or detected from the device."""
    if name != "auto":
        return hw.profile(name)
    found = hw.detect(device)
    if found is None:
        print(f"zaya train: warning: no peak-FLOPs entry for device kind {device.device_kind!r}; "
              "MFU will be null (set train.hardware to one of " + ", ".join(sorted(hw.PROFILES)) + ")",
              file=sys.stderr)
    return found


class StepTimer:
    """Turns the step's device metrics into a log record with throughput over the last window."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, num_devices: int, profile,
                 start_step: int = 0):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.num_devices = num_devices
        self.profile = profile
        self.start = self.last_time = time.perf_counter()
        self.first_step = self.last_step = start_step
        self.steps_timed = 0
        self.time_timed = 0.0

    def record(self, metrics: dict, step: int) -> dict:
        now = time.perf_counter()
        steps, seconds = step - self.last_step, max(now - self.last_time, 1e-9)
        self.last_step, self.last_time = step, now
        if step > self.first_step + 1:  # the first step carries one-off start-up work; keep it out of the average
            self.steps_timed += steps
            self.time_timed += seconds
        tps = steps * self.tokens_per_step / seconds
        load = np.asarray(metrics["expert_load"], np.float64)
        return {
            "loss": float(metrics["loss"]), "lr": float(metrics["lr"]), "grad_norm": float(metrics["grad_norm"]),
            "tokens_per_sec": tps, "tokens_per_sec_per_device": tps / self.num_devices,
            "step_time_sec": seconds / steps, "mfu": self._mfu(tps),
            "tflops_per_device": tps * self.flops_per_token / self.num_devices / 1e12,
            "load_entropy": float(metrics["load_entropy"]), "load_max": float(metrics["load_max"]),
            "layer_load_entropy": np.asarray(metrics["layer_load_entropy"], np.float64).round(4).tolist(),
            "layer_prob_spread": np.asarray(metrics["layer_prob_spread"], np.float64).round(5).tolist(),
            "skip_fraction": float(metrics["skip_fraction"]), "expert_load": load.round(5).tolist(),
            "tokens_seen": step * self.tokens_per_step, "elapsed_sec": now - self.start,
            "bad_steps": int(metrics["bad_steps"]), "consecutive_bad_steps": int(metrics["consecutive_bad_steps"]),
        }

    def _mfu(self, tps: float) -> float | None:
        if self.profile is None:
            return None
        return mfu(self.flops_per_token, tps, self.num_devices, self.profile.peak_bf16_tflops)

    def summary(self) -> dict:
        tps = self.steps_timed * self.tokens_per_step / self.time_timed if self.time_timed else float("nan")
        return {"tokens_per_sec": tps, "mfu": self._mfu(tps) if self.time_timed else None}
