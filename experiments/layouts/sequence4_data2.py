"""Sequence (context) parallel x data: each sequence cut into 8 chunks, device p of 4 holding
chunks p and 7-p (zigzag: causal balance), K/V all-gathered along the sequence with CCA's
2-token halo from the chunk before; weights replicated; 2 replicas.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 zaya train --config=experiments/layouts/sequence4_data2.py \\
        --workdir=/tmp/zaya_sequence4_data2
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), "base.py"))
    config.mesh.sequence = 4
    return config
