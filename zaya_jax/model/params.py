"""Parameter creation with logical axis names, and the non-trained balancing-bias state.

Every weight is an `nnx.Param` carrying `logical_axes` metadata (`embed`, `heads`, `experts`,
...). The mesh rules table (parallel layer) maps those names to mesh axes; the model itself
never names a mesh axis.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

PARAM_DTYPE = jnp.float32  # master weights are always fp32; compute casts per the dtype policy


class BalancingBias(nnx.Variable):
    """ZAYA1's router `balancing_biases`: fp32 state moved by its own optimizer, never by grads."""


def make_param(rngs: nnx.Rngs, init: Callable, shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(init(rngs.params(), shape, PARAM_DTYPE), logical_axes=tuple(axes))


def normal(std: float) -> Callable:
    return jax.nn.initializers.normal(stddev=std)


def constant(value: float) -> Callable:
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def logical_axes(variable: nnx.Variable) -> tuple[str, ...] | None:
    """The logical axis names a variable was created with (None for unannotated state)."""
    return variable.get_metadata().get("logical_axes")
