"""The hybrid tiny model (`tiny_hybrid_cpu.py`: LLLC) with its sequence split over 8 devices by `tsp`.

The linear-attention layers run LASP-2 (weights stored 1/8, each KV group's slices gathered once per use, one all-gather
of the heads' memory states per layer, independent of the sequence length); the CCA layer keeps its
K/V all-gather with the look-back halo (LASP-2H). Zigzag placement: device p holds chunks p and 15-p.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 zaya train --config=experiments/layouts/hybrid_tsp8.py \\
        --workdir=/tmp/zaya_hybrid_tsp8
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), "base.py"))
    config.model.layer_pattern = "LLLC"
    config.model.linear_decay = "retention"
    config.mesh.tsp = 8
    return config
