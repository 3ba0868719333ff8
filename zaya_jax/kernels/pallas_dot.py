"""What every Pallas kernel here shares: the block product (a 2-D matmul accumulated in fp32) and
the launch (`pallas_call` with the tuning row's Triton warps and stages)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def fp32_dot(a, b, contract=(1, 0), precision=None):
    """a · b contracting a's dim contract[0] with b's dim contract[1], fp32-accumulated."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def launch(kernel, plan, name: str, grid, in_specs, args, out_specs, out_shape):
    """`kernel(*refs, plan=plan)` over `grid` as the Triton call `name`; `plan` carries `interpret`
    and `blocks` (with `num_warps`, `num_stages`)."""
    return pl.pallas_call(
        functools.partial(kernel, plan=plan), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=plan.interpret, name=name,
        compiler_params=plgpu.CompilerParams(num_warps=plan.blocks.num_warps, num_stages=plan.blocks.num_stages),
    )(*args)
