"""`load(path)`: a ready model from a zaya-jax Orbax checkpoint or a Hugging Face ZAYA directory."""

from __future__ import annotations

import os

from zaya_jax.errors import ZayaError


def load(path: str, compute_dtype: str = "float32", *, attention_kernel: str = "auto", moe_kernel: str = "auto",
         norm_kernel: str = "auto", linear_kernel: str = "auto"):
    """Return a `Zaya` model; call it as `model(input_ids, segment_ids=None, positions=None)`.

    `path` is either a checkpoint written by `zaya convert from-hf` (or training; hybrid models
    with linear-attention layers too, `linear_kernel` choosing their backend), or an HF directory with `config.json` and `*.safetensors`. Wrap the call in `flax.nnx.jit` for speed.
    The kernel backends are those of `model.*_kernel` (`zaya_jax.kernels.registry`), e.g.
    `attention_kernel="cudnn"` on NVIDIA for rows without segment ids; a backend that needs an XLA
    flag (`moe_kernel="cudnn"` or `"hipblaslt"`) gets it here, so load before anything starts JAX.
    """
    from zaya_jax.checkpoint import convert, orbax_store
    from zaya_jax.checkpoint import safetensors_io as st
    from zaya_jax.config import read_hf_config
    from zaya_jax.kernels.registry import KERNEL_FIELDS
    from zaya_jax.kernels import registry, xla_flags
    from zaya_jax.model.state import build_model, expected_shapes

    kernels = dict(attention_kernel=attention_kernel, moe_kernel=moe_kernel, norm_kernel=norm_kernel,
                   linear_kernel=linear_kernel)
    for field, kernel in KERNEL_FIELDS.items():
        registry.check_name(kernel, kernels[field], where=field)
    xla_flags.require(kernels)  # before the checkpoint is read: that starts JAX
    if not os.path.isdir(path):
        raise ZayaError(f"{path} does not exist or is not a directory")
    if orbax_store.is_checkpoint(path):
        cfg = orbax_store.read_config(path)
        shapes = convert.check_stored(path, cfg)
        arrays = orbax_store.load_arrays(path, expected_shapes(cfg), shapes)
    elif os.path.isfile(os.path.join(path, "config.json")):
        cfg = read_hf_config(path)
        reader = st.SafetensorsReader(path)
        convert.check_hf_tensors(cfg, reader)
        arrays = {k: v for group in convert.hf_groups(cfg, reader) for k, v in group.items()}
    else:
        raise ZayaError(f"{path} is neither a zaya-jax checkpoint nor a Hugging Face model directory (no config.json)")
    return build_model(cfg.replace(compute_dtype=compute_dtype, **kernels), arrays, source=path)
