"""The block product every Pallas kernel here is built from: a 2-D matmul accumulated in fp32."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def fp32_dot(a, b, contract=(1, 0), precision=None):
    """a · b contracting a's dim contract[0] with b's dim contract[1], fp32-accumulated."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
