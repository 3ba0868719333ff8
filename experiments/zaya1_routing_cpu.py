"""ZAYA1's routing shape on 2 CPU cores: 16 experts + skip, top-1, the ZAYA1 router with its depth
averaging, 8,192 tokens a step; the rest of `tiny_cpu.py` (4 layers of 128, byte tokens).

What the balancer is measured on at ZAYA1's expert count (`benchmarks/routing_health.py`): the
experts are 16 where `tiny_cpu` has 4, so the fair share is 1/16 and a batch gives each expert
about 500 tokens, as a ZAYA1 micro-batch of 4K tokens × 2 gives its 16.

    zaya train --config=experiments/zaya1_routing_cpu.py --workdir=/tmp/zaya_routing
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), "tiny_cpu.py"))
    config.model.num_experts = 16
    config.model.moe_intermediate_size = 64  # 16 narrow experts: about tiny_cpu's expert parameters x 2
    config.train.global_batch_size = 32
    config.train.seq_len = 256
    config.train.steps = 200
    config.optim.warmup_steps = 20
    return config
