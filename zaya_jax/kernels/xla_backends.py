"""The `xla` and vendor backends: the kernels expressed through XLA's own primitives.

Attention's `cudnn` backend goes through `jax.nn.dot_product_attention` (NVIDIA): packed documents
and sequence-sharded queries as a [B, 1, Sq, Sk] mask, which cuDNN takes as a bias beside its own
causal mask (the `xla` attention is `xla_attention`, with a written-out backward); the grouped matmul through `jax.lax.ragged_dot` /
`ragged_dot_general`, whose transposes XLA derives, for the `xla`, `cudnn` and `hipblaslt`
backends alike (an XLA flag, `registry.XLA_FLAGS`, decides which GEMM XLA emits for them).
RMSNorm has no separate XLA primitive: the `xla` backend is the reference expression, which XLA
fuses, made again in the backward from its input.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zaya_jax.kernels import reference


def cudnn_attention(q, k, v, segment_ids=None, *, causal=True, scale=None, kv_segment_ids=None, q_offset=None,
                    implementation: str = "cudnn"):
    """`reference.attention` through `jax.nn.dot_product_attention(implementation='cudnn')`.

    Whole sequences use cuDNN's own causal mask (its fully masked blocks skipped). Packed documents
    (`segment_ids`, and `kv_segment_ids` for the keys of sequence-sharded queries) and a query
    offset become one boolean [B, 1, Sq, Sk] mask, which cuDNN applies as a bias. `implementation`
    'xla' runs the same call through XLA's attention (how the mask is tested without a GPU)."""
    mask = attention_mask(segment_ids, kv_segment_ids, q_offset, causal, q.shape[1], k.shape[1])
    own_causal = causal and q_offset is None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=own_causal, scale=scale,
                                        implementation=implementation)


def attention_mask(segment_ids, kv_segment_ids, q_offset, causal: bool, sq: int, sk: int):
    """[B or 1, 1, Sq, Sk] bool: query i (at `q_offset` + i) may see key j: the same document, and
    j <= i when causal with an offset (without one, the kernel's own causal mask does it); None when
    nothing beyond that is masked."""
    mask = None
    if segment_ids is not None:
        keys = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = (segment_ids[:, :, None] == keys[:, None, :])[:, None]
    if causal and q_offset is not None:
        rows = q_offset + jnp.arange(sq)
        ordered = (rows[:, None] >= jnp.arange(sk)[None, :])[None, None]
        mask = ordered if mask is None else mask & ordered
    return mask


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """`reference.grouped_matmul` through `jax.lax.ragged_dot`; rows past the groups are zeroed."""
    out_dtype = preferred_element_type or lhs.dtype
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return _zero_past_groups(out, group_sizes).astype(out_dtype)


@jax.custom_vjp
def vendor_grouped_matmul(lhs, rhs, group_sizes):
    """`grouped_matmul` for the `cudnn` / `hipblaslt` backends, returned in fp32.

    XLA hands a ragged_dot to the vendor's grouped GEMM only when its operands and its result are
    all bf16 (or all fp16); any fp32 among them, the result included, and it falls back to the
    padded dense form (`RaggedDotRewriter`). So each of the three GEMMs writes the operands' dtype
    (accumulating in fp32 inside the GEMM) and is widened after, and the fp32 cotangent is cast to
    the operands' dtype first, as the Pallas backward does."""
    return _vendor_dot(lhs, rhs, group_sizes).astype(jnp.float32)


def _vendor_dot(lhs, rhs, group_sizes):
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)
    return _zero_past_groups(out, group_sizes)


def _vendor_fwd(lhs, rhs, group_sizes):
    return vendor_grouped_matmul(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _vendor_bwd(residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(lhs.dtype)
    dlhs = _vendor_dot(dout, jnp.swapaxes(rhs, 1, 2), group_sizes)
    drhs = _ragged_contraction(lhs, dout, group_sizes, rhs.dtype)
    return dlhs, drhs, None


vendor_grouped_matmul.defvjp(_vendor_fwd, _vendor_bwd)


def grouped_matmul_transposed(lhs, dout, group_sizes, num_groups: int, *, preferred_element_type=None):
    """`reference.grouped_matmul_transposed` through `ragged_dot_general` (ragged contraction)."""
    del num_groups  # implied by group_sizes
    out = _ragged_contraction(lhs, dout.astype(lhs.dtype), group_sizes, jnp.float32)
    return out.astype(preferred_element_type or lhs.dtype)


def _ragged_contraction(lhs, dout, group_sizes, out_dtype):
    """[G, K, N]: each group's rows of lhs contracted with its rows of dout (`ragged_dot_general`)."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    # Rows past the groups must not contribute: ragged_dot_general leaves them unspecified.
    lhs = _zero_past_groups(lhs, group_sizes)
    return jax.lax.ragged_dot_general(lhs, dout, group_sizes, dims, preferred_element_type=out_dtype)


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
    """`reference.rms_norm`, made again in the backward from x and the weight: autodiff would keep
    the fp32 normalised rows and the weighted ones besides (two rows of the width per token). A
    checkpoint, not a written-out backward: inside a remat policy's checkpoint a `custom_vjp`'s
    residuals are kept whatever the policy (with the residual scaling written out too, an `LC`
    model on one CPU held 569 MiB under `dots` against 483 so)."""
    norm = functools.partial(reference.rms_norm, eps=eps, out_dtype=out_dtype)
    return jax.checkpoint(norm, policy=jax.checkpoint_policies.nothing_saveable)(x, weight)
