"""The built-in default: a small ZAYA1 (4 layers, 4 experts + skip, CCA) that trains on 2 CPU cores.

Data is the English documentation that ships with Python (no download), tokenized as bytes.
About a minute and a half on a 2-core CPU; the loss falls from ~5.6 (uniform over 259 byte tokens)
to ~1.4 in 300 steps (held-out ~1.5).

    zaya train --config=experiments/tiny_cpu.py --workdir=/tmp/zaya_tiny
"""

from zaya_jax.experiment import base_config


def get_config():
    config = base_config("tiny_cpu")
    config.model.vocab_size = 272  # 259 byte-level ids, padded to a multiple of 16
    config.model.pad_token_id, config.model.bos_token_id, config.model.eos_token_id = 0, 1, 2
    config.model.compute_dtype = "float32"  # bf16 matmuls are slower than fp32 on most CPUs

    config.train.steps = 300
    config.train.global_batch_size = 16
    config.train.seq_len = 128
    config.train.log_every = 10
    config.train.scan_unroll = 4  # all 4 blocks in one scan iteration: XLA fuses across them (8% more tokens/s here)
    config.train.hardware = "auto"  # the MFU denominator of whatever runs it: this CPU, or a GPU's peak
    config.train.cpu_devices = 2  # one XLA device per core, data-parallel: XLA:CPU runs small matmuls on one thread
    config.eval.every_steps = 100
    config.eval.batches = 4

    config.optim.lr = 3e-3
    config.optim.min_lr = 3e-4
    config.optim.warmup_steps = 30
    config.optim.weight_decay = 0.0

    config.data.source = "builtin:python-docs"
    config.data.tokenizer = "bytes"
    return config
