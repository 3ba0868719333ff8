"""Write a random Hugging Face ZAYA checkpoint of any preset shape, streaming tensor by tensor.

For testing conversion at real scale without downloading weights, e.g. a ZAYA1-base-shaped
checkpoint with 4 of its 40 layers (5.5 GB in fp32):

    python tools/make_hf_checkpoint.py --preset=zaya1_base --layers=4 --out=/tmp/zaya_hf

Peak memory is one tensor. Values are N(0, 0.02) except norms/scales (1), biases (0) and the
router balancing biases (0, skip class -1), so the result is also a sane model to load.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from zaya_jax.checkpoint import hf_mapping
from zaya_jax.checkpoint import safetensors_io as st
from zaya_jax.checkpoint.convert import DEFAULT_MAX_SHARD_BYTES, EXPORT_DTYPES
from zaya_jax.config import PRESETS, preset, write_hf_config
from zaya_jax.errors import ZayaError


def value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("balancing_biases"):
        return np.concatenate([np.zeros(shape[0] - 1, np.float32), [-1.0]]).astype(np.float32)
    if name.endswith(("_scale", "norm.weight", ".temp")):
        return np.ones(shape, np.float32)
    if name.endswith("bias"):
        return np.zeros(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="zaya1_base", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--dtype", default="float32", choices=sorted(EXPORT_DTYPES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        cfg = preset(args.preset, **({"num_hidden_layers": args.layers} if args.layers else {}))
    except ZayaError as e:
        print(f"make_hf_checkpoint: error: {e}", file=sys.stderr)
        return 2
    if os.path.exists(args.out):
        print(f"make_hf_checkpoint: error: {args.out} already exists; choose a new --out", file=sys.stderr)
        return 2
    os.makedirs(args.out)
    rng = np.random.default_rng(args.seed)
    specs = [(name, np.dtype(np.float32) if name.endswith("balancing_biases") else EXPORT_DTYPES[args.dtype], shape)
             for rule in hf_mapping.rules(cfg) for name, shape in zip(rule.hf, rule.hf_shapes)]
    values = {name: shape for name, _, shape in specs}
    files = st.write_sharded(args.out, specs, lambda name: value(name, values[name], rng), DEFAULT_MAX_SHARD_BYTES)
    print(f"wrote {len(specs)} tensors in {len(files)} file(s) under {args.out}")
    write_hf_config(cfg, args.out, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
