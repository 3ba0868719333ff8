"""Fused RMSNorm against the reference, values and gradients (x and weight)."""

import jax
import jax.numpy as jnp
import pytest

from kernel_checks import check_values_and_grads
from zaya_jax import kernels
from zaya_jax.kernels import reference
from zaya_jax.kernels.tuning import RmsNormBlocks


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("shape,dtype,out_dtype", [
    ((3, 7, 48), jnp.float32, jnp.float32),  # rows not a multiple of the block, width not a power of 2
    ((5, 64), jnp.float32, jnp.bfloat16),  # the model's form: fp32 residual in, bf16 out
    ((2, 9, 20), jnp.bfloat16, jnp.bfloat16),
])
def test_matches_reference(backend, shape, dtype, out_dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    x = 3.0 * jax.random.normal(keys[0], shape, dtype)
    weight = 1.0 + 0.1 * jax.random.normal(keys[1], shape[-1:], jnp.float32)

    def kernel(x, weight):
        return kernels.rms_norm(x, weight, eps=1e-5, out_dtype=out_dtype, backend=backend,
                                blocks=RmsNormBlocks(block_rows=4))

    def ref(x, weight):
        return reference.rms_norm(x, weight, eps=1e-5, out_dtype=out_dtype)

    tol_dtype = jnp.bfloat16 if jnp.bfloat16 in (dtype, out_dtype) else jnp.float32
    check_values_and_grads(kernel, ref, (x, weight), (0, 1), tol_dtype, f"{backend} rms_norm {shape}")


def test_weight_shape_is_checked():
    with pytest.raises(ValueError, match="weight must have shape"):
        kernels.rms_norm(jnp.ones((2, 8)), jnp.ones((4,)), eps=1e-5)
