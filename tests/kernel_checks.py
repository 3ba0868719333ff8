"""Shared helpers of the kernel tests: random inputs, value and gradient comparison with tolerances.

The kernels are called with `interpret=None`, so the same tests run in interpret mode on CPU and
compiled on a GPU (`JAX_PLATFORMS=cuda pytest tests/test_kernels_*.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Max error allowed, relative to the reference's largest magnitude (at least 1).
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 4e-2}

# fp32 dots at full precision in every test that uses these helpers. On NVIDIA GPUs JAX computes
# fp32 matmuls in TF32 by default (~1e-3 relative): the references (and the xla backends) would
# miss the fp32 tolerance on their own side, while the Pallas kernels ask for HIGHEST. On CPU fp32
# dots are exact either way, so this changes nothing there.
jax.config.update("jax_default_matmul_precision", "highest")


def assert_close(actual, expected, dtype, what: str) -> None:
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), f"{what}: non-finite values"
    scale = max(1.0, float(np.max(np.abs(e))))
    err = float(np.max(np.abs(a - e))) if a.size else 0.0
    assert err <= TOLERANCE[dtype] * scale, f"{what}: max error {err:.3g} > {TOLERANCE[dtype]} × {scale:.3g}"


def check_values_and_grads(kernel, reference, args, diff_argnums, dtype, what: str, seed: int = 0) -> None:
    """kernel(*args) == reference(*args), and so are the gradients of a random projection of the output."""
    out = jax.jit(kernel)(*args)
    ref = jax.jit(reference)(*args)
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    assert_close(out, ref, dtype, f"{what} values")
    probe = jax.random.normal(jax.random.PRNGKey(seed + 1), ref.shape, jnp.float32)

    def projected(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * probe)

    grads = jax.jit(jax.grad(projected(kernel), diff_argnums))(*args)
    ref_grads = jax.jit(jax.grad(projected(reference), diff_argnums))(*args)
    for i, g, r in zip(diff_argnums, grads, ref_grads):
        assert g.dtype == r.dtype, f"{what}: grad {i} dtype {g.dtype} != {r.dtype}"
        assert_close(g, r, dtype, f"{what} grad of argument {i}")
