"""The common base of the layout experiments: the tiny CPU model with 256-token rows, 100 steps.

Not a layout itself (every mesh axis as in `tiny_cpu.py`); each file beside it sets its mesh.
`mesh.data` stays -1, so on more devices the layout is replicated over the rest.
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), os.pardir, "tiny_cpu.py"))
    config.train.seq_len = 256
    config.train.steps = 100
    config.eval.every_steps = 50
    config.train.hardware = "auto"  # the MFU denominator of whatever runs it
    return config
