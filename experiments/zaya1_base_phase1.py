"""ZAYA1-base, pretraining phase 1: the published recipe at full size (the ZAYA1 technical report).

8.8B parameters (760M active), 4K context, RoPE θ 1e4, global batch 4096 × 4096 tokens
(16.8M), Muon + AdamW with a cosine 6e-4 → 2e-4, bf16 compute with the fp32 islands.
Phase 1 is 8T tokens: 476,837 steps of 16.8M tokens. Not published, so chosen here: warmup
(2,000 steps), weight decay (0.1), Muon momentum (0.95), the router's initialisation and the
balancer. The balancer is the default `solve`: after each update it routes the step's first
micro-batch again through the new weights and solves the biases on that, one forward of a
micro-batch a step (~6% of this recipe's model FLOPs, with full remat). `spread`, which
measures the step's own routing and so lags the router by one optimizer step, reached 3-6.5x the fair share at 16 experts on a CPU while the
router settles (benchmarks/routing_seeds_spread.md); whether that lag matters at 16.8M tokens a
step is unmeasured. The report's Adam rule herds a layer's tokens from expert to expert while the
router's probabilities are close.

Point `data.source` and `data.tokenizer` at your corpus and the ZAYA1 tokenizer.json:

    zaya train --config=experiments/zaya1_base_phase1.py --workdir=/ckpt/zaya1_p1 \\
        --config.data.source=/data/corpus --config.data.tokenizer=/models/ZAYA1-base

Schedule: FSDP over the 8 GPUs of a node, data parallel across nodes, 4 micro-batches so each
device holds one 4K sequence at a time (1,024 GPUs as in the ZAYA1 run). Compile it for one
node without a GPU: `python tools/compile_step.py --config=experiments/zaya1_base_phase1.py`.
"""

from zaya_jax.experiment import base_config


def get_config():
    config = base_config("zaya1_base")
    config.model.rope_theta = 10_000.0
    config.model.compute_dtype = "bfloat16"

    config.train.steps = 476_837
    config.train.global_batch_size = 4096
    config.train.seq_len = 4096
    config.train.grad_accum_steps = 4
    config.train.remat = "full"
    config.train.loss_vocab_chunk = 16_392  # 262,272 = 16 × 16,392: no padded copy of the table
    config.train.log_every = 10
    config.eval.every_steps = 1000
    config.checkpoint.every_steps = 1000

    config.optim.lr = 6e-4
    config.optim.min_lr = 2e-4
    config.optim.warmup_steps = 2000
    config.optim.weight_decay = 0.1

    config.mesh.data = -1
    config.mesh.fsdp = 8
    return config
