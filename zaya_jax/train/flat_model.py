"""The model as flat `path → array` dicts for training, and back to an NNX module inside a step.

Training keeps parameters and balancing biases as plain dicts keyed by module path
(`embedding`, `layers/attn/wq` — the blocks stacked on a leading `layers` axis, see
`model/layer_stack.py`): optimizer partitions, weight-decay masks and sharding rules are then
simple functions of the path and of each parameter's logical axes. `ModelDef` remembers the
module structure so the jitted step can rebuild the `Zaya` module from those dicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.params import BalancingBias, logical_axes
from zaya_jax.model.state import path_key

Arrays = dict[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDef:
    """Static structure: graphdef plus (path, variable template) for params and biases."""

    cfg: ModelConfig
    graphdef: Any
    param_vars: tuple  # ((path tuple, abstract Variable), ...)
    bias_vars: tuple

    @property
    def param_axes(self) -> dict[str, tuple[str, ...]]:
        return {path_key(p): logical_axes(v) for p, v in self.param_vars}

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {path_key(p): tuple(v.get_value().shape) for p, v in self.param_vars}

    @property
    def bias_key(self) -> str:
        """The path of the stacked balancing biases, [L, E+1]."""
        (path, _), = self.bias_vars
        return path_key(path)

    def merge(self, params: Arrays, biases: Arrays):
        """The Zaya module whose variables are these arrays (traceable inside jit)."""
        param_state = _state(self.param_vars, params)
        bias_state = _state(self.bias_vars, biases)
        return nnx.merge(self.graphdef, param_state, bias_state)


def _state(template, arrays: Arrays) -> nnx.State:
    return nnx.State.from_flat_path([(p, v.replace(arrays[path_key(p)])) for p, v in template])


def split(model) -> tuple[ModelDef, Arrays, Arrays]:
    graphdef, params, biases = nnx.split(model, nnx.Param, BalancingBias)
    param_vars = tuple(params.flat_state())
    bias_vars = tuple(biases.flat_state())
    modeldef = ModelDef(model.cfg, graphdef, param_vars, bias_vars)
    return modeldef, _arrays(param_vars), _arrays(bias_vars)


def _arrays(flat) -> Arrays:
    return {path_key(p): v.get_value() for p, v in flat}


def model_def(cfg: ModelConfig) -> ModelDef:
    """Structure only (abstract shapes): nothing is allocated."""
    from zaya_jax.model.zaya import Zaya

    return split(nnx.eval_shape(lambda: Zaya(cfg, rngs=nnx.Rngs(0))))[0]


def init_arrays(cfg: ModelConfig, seed: int) -> tuple[Arrays, Arrays]:
    """Freshly initialised parameters and balancing biases (call under jit to place them)."""
    from zaya_jax.model.zaya import Zaya

    _, params, biases = split(Zaya(cfg, rngs=nnx.Rngs(seed)))
    return params, biases
