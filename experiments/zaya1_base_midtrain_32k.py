"""ZAYA1-base mid-training at 32K context, RoPE θ 1e6 (reference/zaya1.md §4), continuing phase 1.

Same model and optimizer as `zaya1_base_phase1.py`; context 32,768 tokens with RoPE θ 1e6 and
the same 16.8M-token global batch (512 sequences). Not published, so chosen here: the length
(~1T tokens: 59,605 steps), the learning rate (cosine 2e-4 → 2e-5 after a short warmup).
ZAYA1 ran this phase with all-gather-KV context parallelism; at 1,024 GPUs each sequence then
spans two devices (mesh.sequence), which arrives with the parallel-layouts work.
"""

from zaya_jax.experiment import base_config


def get_config():
    config = base_config("zaya1_base")
    config.model.rope_theta = 1_000_000.0
    config.model.compute_dtype = "bfloat16"

    config.train.steps = 59_605
    config.train.global_batch_size = 512
    config.train.seq_len = 32_768
    config.train.grad_accum_steps = 1
    config.train.remat = "full"
    config.train.loss_vocab_chunk = 16_392
    config.eval.every_steps = 1000
    config.checkpoint.every_steps = 500

    config.optim.lr = 2e-4
    config.optim.min_lr = 2e-5
    config.optim.warmup_steps = 200
    config.optim.weight_decay = 0.1

    config.mesh.data = -1
    config.mesh.fsdp = 8
    return config
