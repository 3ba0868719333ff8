"""Model state as flat `path → array` maps: the bridge between NNX modules, Orbax and converters.

Paths join NNX attribute names with '/'. The module stores its blocks stacked (`layers/attn/wq`,
[L, ...]; `model/layer_stack.py`); the model's interchange form, which Orbax model checkpoints,
HF conversion and `zaya_jax.load` use, names each layer (`layers/3/attn/wq`). `expected_shapes`
and `build_model` speak the per-layer form.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.errors import ZayaError
from zaya_jax.model.layer_stack import per_layer, stack_entries


def path_key(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def abstract_model(cfg: ModelConfig):
    """The model with ShapeDtypeStruct leaves: shapes and metadata, no memory."""
    from zaya_jax.model.zaya import Zaya

    return nnx.eval_shape(lambda: Zaya(cfg, rngs=nnx.Rngs(0)))


def flat_variables(model) -> dict[str, nnx.Variable]:
    return {path_key(p): v for p, v in nnx.state(model).flat_state()}


def flat_arrays(model) -> dict[str, Any]:
    return {k: v.get_value() for k, v in flat_variables(model).items()}


def stacked_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The module's own shapes (blocks stacked)."""
    return {k: tuple(v.shape) for k, v in flat_arrays(abstract_model(cfg)).items()}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer names and shapes of the model's interchange form."""
    return per_layer(stacked_shapes(cfg), cfg.layer_kinds, take=lambda shape, i: shape[1:])


def build_model(cfg: ModelConfig, arrays: Mapping[str, Any], source: str = "checkpoint"):
    """A concrete model whose every variable comes from the per-layer `arrays` (checked for names and shapes)."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(arrays))
    unexpected = sorted(set(arrays) - set(want))
    if missing:
        raise ZayaError(f"{source} is missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise ZayaError(f"{source} has unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    for key, shape in want.items():
        if tuple(np.shape(arrays[key])) != shape:
            raise ZayaError(
                f"{source}: tensor {key!r} has shape {tuple(np.shape(arrays[key]))}, the model config needs "
                f"{shape}; the checkpoint and config.json disagree"
            )
    graphdef, state = nnx.split(abstract_model(cfg))
    flat = list(state.flat_state())
    stacked = stack_entries(arrays, {path_key(p): tuple(v.get_value().shape) for p, v in flat}, cfg.layer_kinds)
    filled = [(p, v.replace(jax.numpy.asarray(stacked[path_key(p)], v.get_value().dtype))) for p, v in flat]
    return nnx.merge(graphdef, nnx.State.from_flat_path(filled))
