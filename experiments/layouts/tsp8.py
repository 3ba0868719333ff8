"""TSP alone on 8 devices: each device stores 1/8 of every weight and holds 1/8 of every sequence.
Attention all-gathers one KV group's weights at a time and the K/V along the sequence; the
experts' weight slices circulate in a ppermute ring. No all-reduce on the activation path.

The tiny CPU model (`experiments/tiny_cpu.py`) with sequences of 256 tokens, laid out as tsp=8.
On one machine without GPUs, fake 8 devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        zaya train --config=experiments/layouts/tsp8.py --workdir=/tmp/zaya_tsp8

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
    config.mesh.tsp = 8
    return config
