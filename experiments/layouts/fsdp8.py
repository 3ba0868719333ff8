"""FSDP (ZeRO-3) over 8 devices: every weight and its optimizer state split on the hidden dimension,
each device reads its own sequences.

The tiny CPU model (`experiments/tiny_cpu.py`) with sequences of 256 tokens, laid out as fsdp=8.
On one machine without GPUs, fake 8 devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        zaya train --config=experiments/layouts/fsdp8.py --workdir=/tmp/zaya_fsdp8

On GPUs the same file runs as is; `mesh.data` is -1 and takes the devices the layout leaves.
Every layout trains like one device (tests/test_train_step.py, tests/test_layouts.py).
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), os.pardir, "tiny_cpu.py"))
    config.train.seq_len = 256
    config.train.steps = 100
    config.eval.every_steps = 50
    config.train.hardware = "auto"  # the MFU denominator of whatever runs it
    config.mesh.fsdp = 8
    return config
