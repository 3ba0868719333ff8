"""ZAYA1-base mid-training at 32K context, RoPE θ 1e6 (the ZAYA1 technical report), continuing phase 1.

Phase 1's experiment (`zaya1_base_phase1.py`: model, optimizer, layout) with context 32,768
tokens, RoPE θ 1e6 and the same 16.8M-token global batch (512 sequences). Not published, so
chosen here: the length (~1T tokens: 59,605 steps), the learning rate (cosine 2e-4 → 2e-5 after
a short warmup). Schedule: as ZAYA1 ran this phase, all-gather-KV context parallelism over two
devices (mesh.sequence = 2, which `zaya mesh` places across a node pair so FSDP keeps the node):
512 sequences then fill 1,024 GPUs as data 64 x sequence 2 x fsdp 8.
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "zaya1_base_phase1.py"))
    config.model.rope_theta = 1_000_000.0

    config.train.steps = 59_605
    config.train.global_batch_size = 512
    config.train.seq_len = 32_768
    config.train.grad_accum_steps = 1
    config.checkpoint.every_steps = 500

    config.optim.lr = 2e-4
    config.optim.min_lr = 2e-5
    config.optim.warmup_steps = 200

    config.mesh.sequence = 2
    return config
