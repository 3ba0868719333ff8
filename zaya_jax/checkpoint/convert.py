"""HF safetensors ⇄ zaya-jax Orbax conversion, streamed one layer at a time.

Host memory stays near one layer (or the embedding, the largest tensor), never the whole
model, so ZAYA1-base (8.8B parameters) converts on a 24 GB host. Every name and shape is
checked against the config before a single byte is written.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Iterator

import ml_dtypes
import numpy as np
from tqdm import tqdm

from zaya_jax.checkpoint import hf_mapping, orbax_store
from zaya_jax.checkpoint import safetensors_io as st
from zaya_jax.data import tokenizer
from zaya_jax.config import ModelConfig, read_hf_config, write_hf_config
from zaya_jax.errors import ZayaError
from zaya_jax.model.state import expected_shapes

EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
FP32_ALWAYS = ("balancing_biases",)  # fp32 buffers in HF whatever the model dtype
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # "5GB", as transformers counts it


def check_hf_tensors(cfg: ModelConfig, reader: st.SafetensorsReader) -> None:
    """Missing, unexpected or wrongly shaped HF tensors → an error naming the first one."""
    want = {name: shape for rule in hf_mapping.rules(cfg) for name, shape in zip(rule.hf, rule.hf_shapes)}
    have = reader.tensors
    for name, shape in want.items():
        if name not in have:
            raise ZayaError(f"{reader.directory} is missing tensor {name!r} required by its config.json")
        if have[name].shape != shape:
            hf_mapping.raise_shape(reader.directory, name, have[name].shape, shape)
    extra = [n for n in have if n not in want and n not in hf_mapping.TIED_ALIASES]
    if extra:
        raise ZayaError(f"{reader.directory} has unexpected tensor {extra[0]!r} ({len(extra)} in all) for its config.json")


def hf_groups(cfg: ModelConfig, reader: st.SafetensorsReader, progress: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """Our fp32 arrays, one rules group (top, then each layer) at a time."""
    shapes = expected_shapes(cfg)
    groups = hf_mapping.grouped_rules(cfg)
    fetch = lambda name: reader.read(name).astype(np.float32, copy=False)  # noqa: E731
    for group in tqdm(groups.values(), desc="convert", unit="group", disable=not progress, file=sys.stderr):
        yield hf_mapping.convert_group_to_ours(group, fetch, shapes, reader.directory)


def from_hf(hf_dir: str, out: str, progress: bool = True) -> ModelConfig:
    cfg = read_hf_config(hf_dir)
    reader = st.SafetensorsReader(hf_dir)
    check_hf_tensors(cfg, reader)
    orbax_store.save_groups(out, cfg, hf_groups(cfg, reader, progress))
    tokenizer.copy_hf_files(hf_dir, out)
    return cfg


def check_stored(ckpt: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = orbax_store.stored_shapes(ckpt)
    for key, shape in expected_shapes(cfg).items():
        if key not in shapes:
            raise ZayaError(f"{ckpt} is missing tensor {key!r} required by its model config")
        if shapes[key] != shape:
            raise ZayaError(f"{ckpt}: tensor {key!r} has shape {shapes[key]}, its model config needs {shape}")
    return shapes


def to_hf(ckpt: str, out: str, dtype: str = "float32", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
          progress: bool = True) -> ModelConfig:
    if dtype not in EXPORT_DTYPES:
        raise ZayaError(f"--dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ZayaError(f"{out} already exists and is not empty; choose a new --out directory")
    cfg = orbax_store.read_config(ckpt)
    if cfg.is_hybrid:
        raise ZayaError(f"{ckpt} holds a hybrid model (model.layer_pattern={cfg.layer_pattern!r}) and Hugging Face's "
                        "ZAYA has no linear-attention layers, so it has no HF form; read it with zaya_jax.load")
    shapes = check_stored(ckpt, cfg)
    rules = list(hf_mapping.rules(cfg))
    specs = [(name, _export_dtype(name, dtype), shape)
             for rule in rules for name, shape in zip(rule.hf, rule.hf_shapes)]
    group_of = {name: rule.group for rule in rules for name in rule.hf}
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write_shards(ckpt, cfg, shapes, specs, group_of, tmp, max_shard_bytes, progress)
        write_hf_config(cfg, tmp, dtype)
        _carry_tokenizer(ckpt, tmp, cfg)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cfg


def _carry_tokenizer(ckpt: str, out: str, cfg: ModelConfig) -> None:
    """The checkpoint's tokenizer into the HF directory, with the tokenizer_config.json HF needs."""
    if tokenizer.copy_hf_files(ckpt, out):
        tokenizer.write_hf_config(out, cfg.max_position_embeddings)
    elif os.path.isfile(os.path.join(ckpt, "tokenizer.txt")):
        print(f"zaya convert: {ckpt} was trained with the bytes tokenizer, which has no Hugging Face form; "
              f"{out} has no tokenizer", file=sys.stderr)


def _export_dtype(name: str, dtype: str) -> np.dtype:
    return np.dtype(np.float32) if name.endswith(FP32_ALWAYS) else EXPORT_DTYPES[dtype]


def _write_shards(ckpt, cfg, shapes, specs, group_of, directory, max_shard_bytes, progress):
    groups = hf_mapping.grouped_rules(cfg)
    cache: dict = {"group": None, "tensors": {}}

    def tensor(name: str) -> np.ndarray:
        group = group_of[name]
        if cache["group"] != group:
            keys = [k for rule in groups[group] for k in rule.ours]
            ours = orbax_store.load_arrays(ckpt, keys, shapes)
            cache.update(group=group, tensors=hf_mapping.convert_group_to_hf(groups[group], ours.__getitem__))
            bar.update(1)
        return cache["tensors"].pop(name)

    with tqdm(total=len(groups), desc="export", unit="group", disable=not progress, file=sys.stderr) as bar:
        st.write_sharded(directory, specs, tensor, max_shard_bytes)
