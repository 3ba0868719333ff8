"""RMSNorm (through the selected `zaya_jax.kernels.rms_norm` backend) and ZAYA1's residual scaling
`(x + b) * s`, both computed in fp32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax import kernels
from zaya_jax.model.params import constant, make_param
from zaya_jax.model.schedule import LOCAL, Schedule


class RMSNorm(nnx.Module):
    """HF ZayaRMSNorm: fp32 statistics, weight applied, result in `out_dtype`."""

    def __init__(self, size: int, eps: float, axis_name: str, *, kernel: str = "auto", rngs: nnx.Rngs):
        self.eps = eps
        self.kernel = kernel
        self.weight = make_param(rngs, constant(1.0), (size,), (axis_name,))

    def __call__(self, x: jax.Array, out_dtype=jnp.float32, schedule: Schedule = LOCAL) -> jax.Array:
        def norm(x, weight):
            return kernels.rms_norm(x, weight, eps=self.eps, out_dtype=out_dtype, backend=self.kernel)

        return schedule.run_kernel("rms_norm", self.kernel, norm, (x,), (self.weight[...],))


class Affine(nnx.Module):
    """`(x + bias) * scale` in fp32 — the code form of ZAYA1's residual scaling (not αx + β)."""

    def __init__(self, size: int, *, rngs: nnx.Rngs):
        self.scale = make_param(rngs, constant(1.0), (size,), ("embed",))
        self.bias = make_param(rngs, constant(0.0), (size,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        return affine(x, self.bias[...], self.scale[...])


@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
def affine(x, bias, scale):
    """`(x + bias) * scale` in fp32, made again in the backward from x: autodiff would keep the fp32
    sum, a new row of the width per token where x is the residual stream kept anyway (a checkpoint,
    not a written-out backward, for the reason `kernels.xla_backends.rms_norm` gives)."""
    return (x.astype(jnp.float32) + bias) * scale


class ResidualMerge(nnx.Module):
    """`out = (branch + b_h) * s_h + (residual + b_r) * s_r`, the fp32 residual add of each block."""

    def __init__(self, size: int, *, rngs: nnx.Rngs):
        self.branch = Affine(size, rngs=rngs)
        self.residual = Affine(size, rngs=rngs)

    def __call__(self, branch: jax.Array, residual: jax.Array) -> jax.Array:
        return self.branch(branch) + self.residual(residual)
