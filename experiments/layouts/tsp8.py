"""TSP alone on 8 devices: each device stores 1/8 of every weight and holds 1/8 of every sequence.
Attention all-gathers one KV group's weights at a time and the K/V along the sequence; the
experts' weight slices circulate in a ppermute ring. No all-reduce on the activation path.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 zaya train --config=experiments/layouts/tsp8.py \\
        --workdir=/tmp/zaya_tsp8
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), "base.py"))
    config.mesh.tsp = 8
    return config
