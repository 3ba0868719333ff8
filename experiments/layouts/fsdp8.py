"""FSDP (ZeRO-3) over 8 devices: every weight and its optimizer state split on the hidden dimension,
each device reads its own sequences.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 zaya train --config=experiments/layouts/fsdp8.py \\
        --workdir=/tmp/zaya_fsdp8
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), "base.py"))
    config.mesh.fsdp = 8
    return config
