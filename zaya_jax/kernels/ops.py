"""The public kernel entry points: check the arguments, pick the backend, call it.

Each op takes `backend=None` (the kernel target's default from `registry.DEFAULTS`, same as
'auto'), `interpret=None` (Pallas interpret mode exactly when the target is not a GPU) and
`blocks=None` (the target's row of `tuning.TABLE` for the operand dtype). Non-Pallas backends
ignore `interpret` and `blocks`. The target is this machine's unless the caller traces under
`registry.targeting(...)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zaya_jax.kernels import linear_attention as la
from zaya_jax.kernels import reference, tiled_grouped_matmul, xla_attention, xla_backends
from zaya_jax.kernels.registry import interpret_mode, resolve


def flash_attention(q, k, v, *, segment_ids=None, causal=True, scale=None, backend=None, interpret=None,
                    blocks=None, kv_segment_ids=None, q_offset=None):
    """Causal GQA attention: q [B, S, nq, d], k/v [B, S, nk, d] → [B, S, nq, d] in q's dtype.

    Query head i reads KV head i // (nq / nk). `segment_ids` (int32 [B, S]) restricts each query
    to keys of its own packed document. `scale` defaults to d^-1/2.

    Sequence-sharded form: q holds Sq rows at sequence index `q_offset` + i against Sk keys, and
    `kv_segment_ids` [B, Sk] labels the keys. `q_offset` may be traced for `reference`/`xla`; the
    `pallas` kernel needs a Python int (cuDNN takes neither).
    """
    sharded = q_offset is not None or kv_segment_ids is not None
    _check_attention(q, k, v, segment_ids, kv_segment_ids, sharded)
    backend = resolve("attention", backend)
    if backend == "pallas":
        from zaya_jax.kernels import pallas_attention

        if not isinstance(q_offset, (int, type(None))):
            raise ValueError("the pallas backend takes q_offset as a Python int (it shapes the kernel's loops); "
                             "branch over the possible offsets, e.g. with lax.switch")
        return pallas_attention.flash_attention(q, k, v, segment_ids, causal=causal, scale=scale, blocks=blocks,
                                                interpret=interpret_mode(interpret), kv_segment_ids=kv_segment_ids,
                                                q_offset=q_offset or 0)
    if backend == "reference":
        return reference.attention(q, k, v, segment_ids, causal=causal, scale=scale, kv_segment_ids=kv_segment_ids,
                                   q_offset=0 if q_offset is None else q_offset)
    if backend == "xla":
        return xla_attention.attention(q, k, v, segment_ids, causal=causal, scale=scale,
                                       kv_segment_ids=kv_segment_ids, q_offset=q_offset)
    return xla_backends.cudnn_attention(q, k, v, segment_ids, causal=causal, scale=scale,
                                        kv_segment_ids=kv_segment_ids, q_offset=q_offset)


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None, backend=None, interpret=None,
                   blocks=None):
    """lhs [M, K] (rows sorted by group) × rhs [G, K, N] → [M, N]; rows past sum(group_sizes) are 0."""
    _check_grouped(lhs, rhs.shape[0], rhs.shape[1], group_sizes)
    backend = resolve("grouped_matmul", backend)
    if backend == "pallas":
        from zaya_jax.kernels import pallas_grouped_matmul as pallas_gmm

        return pallas_gmm.grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                                         blocks=blocks, interpret=interpret_mode(interpret))
    # The backend in the op names: buffers of a backend's own form are told apart in XLA's reports
    # (`explore/xla_terms.py`: the CPU's expansion of ragged_dot, the tiled form's tile copies).
    with jax.named_scope(f"grouped_matmul_{backend}"):
        if backend in ("cudnn", "hipblaslt"):  # ragged_dot too; the backend's XLA flag picks the GEMM (registry.XLA_FLAGS)
            out = xla_backends.vendor_grouped_matmul(lhs, rhs, group_sizes)
            return out.astype(preferred_element_type or lhs.dtype)
        return _grouped_impl(backend).grouped_matmul(lhs, rhs, group_sizes,
                                                     preferred_element_type=preferred_element_type)


def grouped_matmul_transposed(lhs, dout, group_sizes, *, num_groups=None, preferred_element_type=None,
                              backend=None, interpret=None, blocks=None):
    """The weight gradient of `grouped_matmul`: [G, K, N] with out[g] = lhs[rows of g]ᵀ dout[rows of g]."""
    num_groups = group_sizes.shape[0] if num_groups is None else num_groups
    _check_grouped(lhs, num_groups, lhs.shape[1], group_sizes)
    if dout.ndim != 2 or dout.shape[0] != lhs.shape[0]:
        raise ValueError(f"dout must be [M, N] with M = {lhs.shape[0]} rows like lhs, got {dout.shape}")
    backend = resolve("grouped_matmul", backend)
    if backend == "pallas":
        from zaya_jax.kernels import pallas_grouped_matmul as pallas_gmm

        return pallas_gmm.grouped_matmul_transposed(
            lhs, dout, group_sizes, num_groups, preferred_element_type=preferred_element_type, blocks=blocks,
            interpret=interpret_mode(interpret))
    with jax.named_scope(f"grouped_matmul_{backend}"):
        return _grouped_impl(backend).grouped_matmul_transposed(lhs, dout, group_sizes, num_groups,
                                                                preferred_element_type=preferred_element_type)


def _grouped_impl(backend: str):
    """The module of a non-Pallas grouped matmul backend (xla, cudnn, hipblaslt: ragged_dot)."""
    return {"reference": reference, "tiled": tiled_grouped_matmul}.get(backend, xla_backends)


def rms_norm(x, weight, *, eps, out_dtype=None, backend=None, interpret=None, blocks=None):
    """weight · x / rms(x) over the last axis, statistics in fp32, result in `out_dtype` (default x's)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape {x.shape[-1:]} (x's last axis), got {weight.shape}")
    backend = resolve("rms_norm", backend)
    if backend == "pallas":
        from zaya_jax.kernels import pallas_rms_norm

        return pallas_rms_norm.rms_norm(x, weight, eps=eps, out_dtype=out_dtype, blocks=blocks,
                                        interpret=interpret_mode(interpret))
    impl = reference if backend == "reference" else xla_backends
    return impl.rms_norm(x, weight, eps=eps, out_dtype=out_dtype)


XLA_CHUNK = 64  # the `xla` linear attention's chunk: [C, C] scores per chunk against C-fold fewer states


def linear_attention(q, k, v, segment_ids=None, *, log_decay=None, initial_state=None, initial_segment=None,
                     backend=None, interpret=None, blocks=None):
    """Causal GQA linear attention (`kernels.linear_attention`): q [B, S, nq, dk], k [B, S, nk, dk],
    v [B, S, nk, dv] → [B, S, nq, dv] in q's dtype, fp32 sums.

    `log_decay` fp32 [nq] ≤ 0 (None: no decay); `segment_ids` int [B, S] packed documents;
    `initial_state` fp32 [B, nk, nq/nk, dk, dv], the state entering the row (`chunk_state`'s
    layout), read by the tokens of document `initial_segment` int [B] (default: the first token's).
    The `pallas` backend gives `log_decay` no gradient (a fixed decay); the others differentiate it.
    """
    _check_linear_attention(q, k, v, segment_ids, log_decay, initial_state, initial_segment)
    backend = resolve("linear_attention", backend)
    args = dict(log_decay=log_decay, initial_state=initial_state, initial_segment=initial_segment)
    if backend == "pallas":
        from zaya_jax.kernels import pallas_linear_attention

        return pallas_linear_attention.linear_attention(q, k, v, segment_ids, **args, blocks=blocks,
                                                        interpret=interpret_mode(interpret))
    if backend == "reference":
        return la.reference(q, k, v, segment_ids, **args)
    length = q.shape[1]
    chunk = min(XLA_CHUNK, length)
    padded = -(-length // chunk) * chunk
    segs = None if segment_ids is None else la.pad_rows(segment_ids, padded, -1)
    out = la.chunked(*(la.pad_rows(t, padded) for t in (q, k, v)), segs, chunk=chunk, **args)
    return out[:, :length]


def _check_linear_attention(q, k, v, segment_ids, log_decay, initial_state, initial_segment) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] \
            or q.shape[3] != k.shape[3]:
        raise ValueError(f"linear attention wants q [B, S, nq, dk], k [B, S, nk, dk], v [B, S, nk, dv]; got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    batch, length, nq, dk = q.shape
    nk, dv = k.shape[2], v.shape[3]
    if nq % nk:
        raise ValueError(f"query heads ({nq}) must be a multiple of KV heads ({nk})")
    if segment_ids is not None and (segment_ids.shape != (batch, length)
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"segment_ids must be integer [B, S] = {(batch, length)}, got {segment_ids.dtype} "
                         f"{segment_ids.shape}")
    if log_decay is not None and log_decay.shape != (nq,):
        raise ValueError(f"log_decay must be [nq] = [{nq}] (one rate per query head), got {log_decay.shape}")
    state_shape = (batch, nk, nq // nk, dk, dv)
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state must be [B, nk, nq/nk, dk, dv] = {list(state_shape)}, got "
                         f"{list(initial_state.shape)}")
    if initial_segment is not None and (initial_state is None or initial_segment.shape != (batch,)
                                        or not jnp.issubdtype(initial_segment.dtype, jnp.integer)):
        raise ValueError(f"initial_segment must be integer [B] = [{batch}] and comes with an initial_state, got "
                         f"{initial_segment.dtype} {initial_segment.shape}"
                         + ("" if initial_state is not None else " without one"))


def _check_attention(q, k, v, segment_ids, kv_segment_ids=None, sharded=False) -> None:
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"attention wants q [B, S, nq, d] and k, v [B, S, nk, d]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    same = (0, 3) if sharded else (0, 1, 3)  # a sharded query block may be shorter than the keys
    if any(q.shape[i] != k.shape[i] for i in same):
        raise ValueError(f"q {q.shape} and k {k.shape} must agree on batch, sequence and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of KV heads ({k.shape[2]})")
    for name, ids, rows in (("segment_ids", segment_ids, q), ("kv_segment_ids", kv_segment_ids, k)):
        if ids is not None and (ids.shape != rows.shape[:2] or not jnp.issubdtype(ids.dtype, jnp.integer)):
            raise ValueError(f"{name} must be integer [B, S] = {rows.shape[:2]}, got {ids.dtype} {ids.shape}")


def _check_grouped(lhs, num_groups: int, k: int, group_sizes) -> None:
    if lhs.ndim != 2 or lhs.shape[1] != k:
        raise ValueError(f"lhs must be [M, K] with K = {k}, got {lhs.shape}")
    if group_sizes.shape != (num_groups,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integer [{num_groups}] (one size per group), got "
                         f"{group_sizes.dtype} {group_sizes.shape}")
