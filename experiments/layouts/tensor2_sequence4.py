"""Tensor x sequence: Megatron tensor parallelism over 2 devices (one KV group each, experts split
on their width, one all-reduce per sublayer) times 4-way sequence parallelism.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 zaya train --config=experiments/layouts/tensor2_sequence4.py \\
        --workdir=/tmp/zaya_tensor2_sequence4
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), "base.py"))
    config.mesh.tensor = 2
    config.mesh.sequence = 4
    return config
