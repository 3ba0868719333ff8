"""Model state as flat `path → array` maps: the bridge between NNX modules, Orbax and converters.

Paths join NNX attribute names with '/', e.g. `layers/3/attn/wq`. Checkpoints store the nested
form of the same paths (string keys), so the on-disk tree mirrors the module tree exactly.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.errors import ZayaError


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


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in flat_arrays(abstract_model(cfg)).items()}


def build_model(cfg: ModelConfig, arrays: Mapping[str, Any], source: str = "checkpoint"):
    """A concrete model whose every variable comes from `arrays` (checked for names and shapes)."""
    graphdef, state = nnx.split(abstract_model(cfg))
    flat = list(state.flat_state())
    want = {path_key(p) for p, _ in flat}
    missing = sorted(want - set(arrays))
    unexpected = sorted(set(arrays) - want)
    if missing:
        raise ZayaError(f"{source} is missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise ZayaError(f"{source} has unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    filled = []
    for path, var in flat:
        key = path_key(path)
        value = arrays[key]
        if tuple(np.shape(value)) != tuple(var.get_value().shape):
            raise ZayaError(
                f"{source}: tensor {key!r} has shape {tuple(np.shape(value))}, the model config needs "
                f"{tuple(var.get_value().shape)}; the checkpoint and config.json disagree"
            )
        filled.append((path, var.replace(jax.numpy.asarray(value, var.get_value().dtype))))
    return nnx.merge(graphdef, nnx.State.from_flat_path(filled))
