"""The `xla` and vendor backends: the kernels expressed through XLA's own primitives.

Attention's `cudnn` backend goes through `jax.nn.dot_product_attention` (NVIDIA; no segment ids;
the `xla` attention is `xla_attention`, with a written-out backward); the grouped matmul through `jax.lax.ragged_dot` /
`ragged_dot_general`, whose transposes XLA derives, for the `xla`, `cudnn` and `hipblaslt`
backends alike (an XLA flag, `registry.XLA_FLAGS`, decides which GEMM XLA emits for them).
RMSNorm has no separate XLA primitive: the `xla` backend is the reference expression, which XLA
fuses, with a written-out backward that keeps only the input and each row's inverse RMS.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zaya_jax.errors import ZayaError
from zaya_jax.kernels import reference


def cudnn_attention(q, k, v, segment_ids=None, *, causal=True, scale=None, kv_segment_ids=None, q_offset=None):
    """`reference.attention` through `jax.nn.dot_product_attention(implementation='cudnn')`: whole,
    unpacked sequences only."""
    if q_offset is not None or kv_segment_ids is not None:
        raise ZayaError("the cudnn attention backend takes no query offset (sequence-sharded queries); "
                        "use the pallas or xla attention backend with mesh.tsp or mesh.sequence > 1")
    if segment_ids is not None:
        raise ZayaError("the cudnn attention backend has no packed-document (segment_ids) mask here; "
                        "use the 'pallas' backend for packed sequences")
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale, implementation="cudnn")


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """`reference.grouped_matmul` through `jax.lax.ragged_dot`; rows past the groups are zeroed."""
    out_dtype = preferred_element_type or lhs.dtype
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return _zero_past_groups(out, group_sizes).astype(out_dtype)


@jax.custom_vjp
def vendor_grouped_matmul(lhs, rhs, group_sizes):
    """`grouped_matmul` into fp32 for the `cudnn` / `hipblaslt` backends, whose backward GEMMs take
    the operands' dtype: the fp32 cotangent is cast to it first (as the Pallas backward does), since
    hipBLASLt's grouped GEMM takes only bf16/fp16 and a wider input would drop XLA back to the
    padded dense form for the whole backward."""
    return grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


def _vendor_fwd(lhs, rhs, group_sizes):
    return vendor_grouped_matmul(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _vendor_bwd(residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(lhs.dtype)
    dlhs = grouped_matmul(dout, jnp.swapaxes(rhs, 1, 2), group_sizes, preferred_element_type=lhs.dtype)
    drhs = grouped_matmul_transposed(lhs, dout, group_sizes, rhs.shape[0], preferred_element_type=rhs.dtype)
    return dlhs, drhs, None


vendor_grouped_matmul.defvjp(_vendor_fwd, _vendor_bwd)


def grouped_matmul_transposed(lhs, dout, group_sizes, num_groups: int, *, preferred_element_type=None):
    """`reference.grouped_matmul_transposed` through `ragged_dot_general` (ragged contraction)."""
    del num_groups  # implied by group_sizes
    out_dtype = preferred_element_type or lhs.dtype
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    # Rows past the groups must not contribute: ragged_dot_general leaves them unspecified.
    lhs = _zero_past_groups(lhs, group_sizes)
    out = jax.lax.ragged_dot_general(lhs, dout.astype(lhs.dtype), group_sizes, dims,
                                     preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


@jax.custom_vjp
def _zero_past_groups(out, group_sizes):
    """Rows past the groups set to 0. The backward masks again from the group sizes: autodiff would
    keep the mask broadcast to the rows' width (a byte per element) and the rows themselves."""
    return _masked(out, group_sizes)


def _masked(rows, group_sizes):
    live = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], rows, jnp.zeros((), rows.dtype))


def _zero_past_groups_fwd(out, group_sizes):
    return _masked(out, group_sizes), group_sizes


def _zero_past_groups_bwd(group_sizes, dout):
    return _masked(dout, group_sizes), None


_zero_past_groups.defvjp(_zero_past_groups_fwd, _zero_past_groups_bwd)


def rms_norm(x, weight, *, eps, out_dtype=None):
    """`reference.rms_norm`, whose backward keeps x and each row's inverse RMS: autodiff would keep
    the fp32 normalised rows and the weighted ones besides (two more rows of the width per token)."""
    return _rms_norm(x, weight, eps, jnp.dtype(out_dtype or x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, weight, eps, out_dtype):
    return reference.rms_norm(x, weight, eps=eps, out_dtype=out_dtype)


def _inverse_rms(x32, eps):
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _rms_norm_fwd(x, weight, eps, out_dtype):
    inv = _inverse_rms(x.astype(jnp.float32), eps)
    out = (weight.astype(jnp.float32) * (x.astype(jnp.float32) * inv)).astype(out_dtype)
    return out, (x, weight, inv)


def _rms_norm_bwd(eps, out_dtype, residuals, dout):
    x, weight, inv = residuals
    y = x.astype(jnp.float32) * inv
    dy = dout.astype(jnp.float32) * weight.astype(jnp.float32)
    dx = inv * (dy - y * jnp.mean(dy * y, axis=-1, keepdims=True))
    dw = jnp.sum((dout.astype(jnp.float32) * y).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
