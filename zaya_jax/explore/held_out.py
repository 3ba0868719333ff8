"""Model shapes drawn from a seeded generator: what the explorer is checked on, none of its constants
fitted to them.

`draw(seed)` gives `zaya train`/`zaya mesh` overrides on top of `experiments/tiny_cpu.py`: hidden
width, layers, heads and KV groups, head width, experts and their width, sequence length, global
batch and micro-batches, remat policy, hybrid pattern and the layer scan's unrolling, each drawn
from ranges a CPU compiles in seconds. Every draw passes the model's own validation (`config.validate`) and leaves at least one
8-device layout. `draw(seed, widths="gpu")` is the same draw at ZAYA1-like sizes, for a GPU's
compiler (compiled, not run: `benchmarks/explorer_drawn_shapes.py --gpu-target`): widths ×8, heads
×4 as wide, sequences ×16 (1K–4K tokens), bf16 compute and a 16K vocabulary, so that activations,
weights and the loss weigh as they do in a real step rather than beside XLA's small buffers.
`draw(seed, widths="zaya1")` is a draw of its own on top of `experiments/zaya1_base_phase1.py`, at
the scale the explorer is for: 8–40 layers of 1K–2.5K hidden, ZAYA1's vocabulary and loss chunks,
2K–8K-token sequences, bf16; steps of several GiB to tens of GiB per device of an 80 GB GPU.
"""

from __future__ import annotations

import random

REMAT = ("none", "full", "dots", "moe")
PATTERNS = ("C", "C", "LC", "CL")  # CCA-only twice as often: the released models are


# widths="gpu": each drawn size times this, and what a GPU step computes in.
GPU_SCALE = {"model.hidden_size": 8, "model.head_dim": 4, "model.moe_intermediate_size": 8,
             "model.max_position_embeddings": 16, "train.seq_len": 16}
GPU_EXTRA = {"model.compute_dtype": "bfloat16", "model.vocab_size": 16384}
WIDTHS = ("cpu", "gpu", "zaya1")
# The experiment (in experiments/) each draw's overrides go on top of.
BASE = {"cpu": "tiny_cpu.py", "gpu": "tiny_cpu.py", "zaya1": "zaya1_base_phase1.py"}


def draw(seed: int, widths: str = "cpu") -> list[str]:
    """One drawn shape as `--config.KEY=VALUE` overrides (deterministic in `seed`)."""
    if widths not in WIDTHS:
        raise ValueError(f"widths must be one of {WIDTHS}, not {widths!r}")
    rng = random.Random(seed)
    if widths == "zaya1":
        return _overrides(_zaya1_sizes(rng))
    head_dim = rng.choice((16, 32))
    heads = rng.choice((2, 4, 8))
    kv = rng.choice([k for k in (1, 2, 4) if heads % k == 0 and (k * head_dim) % 2 == 0])
    pattern = rng.choice(PATTERNS)
    layers = len(pattern) * rng.choice((1, 2)) if len(pattern) > 1 else rng.choice((1, 2, 3, 4))
    seq = rng.choice((64, 128, 256))
    accum = rng.choice((1, 1, 2))
    values = {
        "model.hidden_size": 32 * rng.randint(3, 8),
        "model.num_hidden_layers": layers,
        "model.num_attention_heads": heads,
        "model.num_key_value_heads": kv,
        "model.head_dim": head_dim,
        "model.num_experts": rng.choice((4, 8, 16)),
        "model.moe_intermediate_size": 32 * rng.randint(2, 12),
        "model.layer_pattern": pattern,
        "model.max_position_embeddings": seq,
        "train.seq_len": seq,
        "train.global_batch_size": 8 * accum * rng.choice((1, 2)),
        "train.grad_accum_steps": accum,
        "train.remat": rng.choice(REMAT),
        # Drawn last, so every seed's other fields are what they were before it was drawn (reports
        # before 2026-11-28 all hold 1). All the units in one iteration is `tiny_cpu`'s own regime.
        "train.scan_unroll": rng.choice((1, 1, layers // len(pattern))),
    }
    if widths == "gpu":
        values = {key: value * GPU_SCALE.get(key, 1) for key, value in values.items()} | GPU_EXTRA
    return _overrides(values)


def _zaya1_sizes(rng: random.Random) -> dict:
    """ZAYA1-base's neighbourhood (2048 hidden, 40 layers, 16 experts of 2048, 8 heads of 128 in 2 KV
    groups, 4K tokens): the fields `draw` draws, at sizes 8 GPUs of 80 GB train. The layer scan
    stays rolled, as a run at this depth compiles it."""
    heads = rng.choice((8, 16))
    pattern = rng.choice(PATTERNS)
    accum = rng.choice((1, 2, 4))
    return {
        "model.hidden_size": rng.choice((1024, 1536, 2048, 2560)),
        "model.num_hidden_layers": rng.choice((8, 16, 24, 40)),
        "model.num_attention_heads": heads,
        "model.num_key_value_heads": rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
        "model.head_dim": rng.choice((64, 128)),
        "model.num_experts": rng.choice((8, 16)),
        "model.moe_intermediate_size": rng.choice((1024, 2048, 3072)),
        "model.layer_pattern": pattern,
        "train.seq_len": rng.choice((2048, 4096, 8192)),
        "train.global_batch_size": 8 * accum * rng.choice((1, 2)),
        "train.grad_accum_steps": accum,
        "train.remat": rng.choice(REMAT),
        "train.scan_unroll": 1,
    }


def _overrides(values: dict) -> list[str]:
    return [f"--config.{key}={value}" for key, value in values.items()]
