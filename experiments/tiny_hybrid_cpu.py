"""A hybrid ZAYA on 2 CPU cores: the built-in tiny model with three linear-attention layers per CCA layer.

`model.layer_pattern="LLLC"` over 4 layers: layers 0–2 are linear attention (elu+1 feature map,
RetNet's per-head decay, `model/linear_attn.py`), layer 3 is CCA. Everything else — data, MoE,
optimizer, schedule — is `tiny_cpu.py`'s, so the two runs' losses compare directly.

    zaya train --config=experiments/tiny_hybrid_cpu.py --workdir=/tmp/zaya_tiny_hybrid
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), "tiny_cpu.py"))
    config.model.layer_pattern = "LLLC"
    config.model.linear_feature_map = "elu1"
    config.model.linear_decay = "retention"
    return config
