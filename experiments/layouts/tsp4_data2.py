"""TSP x data: TSP over 4 devices (1/4 of every weight, 1/4 of every sequence) inside each of
2 data-parallel replicas; on GPUs keep `tsp` inside a node.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 zaya train --config=experiments/layouts/tsp4_data2.py \\
        --workdir=/tmp/zaya_tsp4_data2
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), "base.py"))
    config.mesh.tsp = 4
    return config
