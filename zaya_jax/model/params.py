"""Parameter creation with logical axis names, and the non-trained balancing-bias state.

Every weight is an `nnx.Param` carrying `logical_axes` metadata (`embed`, `heads`, `experts`,
...). The mesh rules table (parallel layer) maps those names to mesh axes; the model itself
never names a mesh axis. A weight the model only ever reads in the compute dtype says so
(`read_in_compute_dtype`), and the layer stack casts it once per step rather than once per layer
and again in the backward (`in_compute_dtype`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

PARAM_DTYPE = jnp.float32  # master weights are always fp32; compute casts per the dtype policy


class BalancingBias(nnx.Variable):
    """ZAYA1's router `balancing_biases`: fp32 state moved by its own optimizer, never by grads."""


def make_param(rngs: nnx.Rngs, init: Callable, shape: tuple[int, ...], axes: tuple[str, ...],
               read_in_compute_dtype: bool = False) -> nnx.Param:
    assert len(shape) == len(axes), (shape, axes)
    extra = {"read_in_compute_dtype": True} if read_in_compute_dtype else {}
    return nnx.Param(init(rngs.params(), shape, PARAM_DTYPE), logical_axes=tuple(axes), **extra)


def normal(std: float) -> Callable:
    return jax.nn.initializers.normal(stddev=std)


def constant(value: float) -> Callable:
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def logical_axes(variable: nnx.Variable) -> tuple[str, ...] | None:
    """The logical axis names a variable was created with (None for unannotated state)."""
    return variable.get_metadata().get("logical_axes")


def in_compute_dtype(state: nnx.State, dtype) -> nnx.State:
    """`state` with every weight made `read_in_compute_dtype` cast to `dtype`: the values its
    readers would cast it to themselves, made once (its gradient comes back in fp32 through the cast)."""
    flat = [(path, var.replace(var.get_value().astype(dtype)) if var.get_metadata().get("read_in_compute_dtype")
             else var) for path, var in state.flat_state()]
    return nnx.State.from_flat_path(flat)
