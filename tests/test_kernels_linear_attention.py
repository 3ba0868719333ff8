"""The linear-attention registry kernel: every backend against the quadratic reference, values and
gradients (q, k, v, initial_state), with decay, packed documents, GQA and an entering state.

Pallas runs in interpret mode on CPU with the CPU tuning row (16-token blocks, 16 value columns
per program), so these shapes cross block boundaries, split d_v over programs and pad the sequence.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import assert_close
from zaya_jax.kernels import linear_attention as la
from zaya_jax.kernels import ops

BACKENDS = ["xla", "pallas"]
# Documents against 16-token blocks: row 0 starts one exactly at a block boundary (16) and one
# mid-block (27), the one between them inside a block; row 1's first spans all three blocks, so the
# state is carried across blocks, and a short one ends it.
SEGMENTS_40 = np.array([[0] * 16 + [1] * 11 + [2] * 13, [5] * 37 + [7] * 3], np.int32)


def _inputs(length, nq, nk, dk=16, dv=32, dtype=jnp.float32, seed=0):
    """q, k, v, an initial state and per-head log decays (numpy's generator: eager jax.random would
    compile once per shape, seconds on a loaded machine)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, length, nq, dk)) * 0.3, dtype)
    k = jnp.asarray(rng.normal(size=(2, length, nk, dk)) * 0.3, dtype)
    v = jnp.asarray(rng.normal(size=(2, length, nk, dv)), dtype)
    state = jnp.asarray(rng.normal(size=(2, nk, nq // nk, dk, dv)) * 0.2, jnp.float32)
    log_decay = jnp.asarray(-rng.uniform(0.01, 0.3, size=nq), jnp.float32)
    return q, k, v, state, log_decay


_REFERENCE = {}  # case → the reference's (output, *gradients), shared by the backends' tests


def _check(backend, q, k, v, state, dtype, what, **fixed):
    """Values and gradients (of a random projection) of `backend` against the reference's, with
    respect to q, k, v and the state when given."""
    args = (q, k, v) if state is None else (q, k, v, state)
    case = what.split(" ", 1)[1]
    if case not in _REFERENCE:
        _REFERENCE[case] = _values_and_grads("reference", args, fixed)
    got, want = _values_and_grads(backend, args, fixed), _REFERENCE[case]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, f"{what}: output {i} dtype {g.dtype} != {w.dtype}"
        assert_close(g, w, dtype, f"{what} " + ("values" if i == 0 else f"grad of argument {i - 1}"))


def _values_and_grads(backend, args, fixed):
    """(output, *gradients) in one compiled function: each backend costs one compilation."""
    def loss(*a):
        state = dict(initial_state=a[3]) if len(a) == 4 else {}
        out = ops.linear_attention(*a[:3], **fixed, **state, backend=backend)
        probe = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)  # any fixed, signed weights
        return jnp.sum(out.astype(jnp.float32) * probe), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, tuple(range(len(args))), has_aux=True))(*args)
    return (out, *grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_basic_linear_attention_without_decay_or_documents_matches_the_reference(backend):
    q, k, v, *_ = _inputs(48, 2, 2)  # one query head per KV head
    _check(backend, q, k, v, None, jnp.float32, f"{backend} no decay")


@pytest.mark.parametrize("backend", BACKENDS)
def test_decay_with_packed_documents_and_two_query_heads_per_kv_head_matches_the_reference(backend):
    q, k, v, _, log_decay = _inputs(40, 4, 2, seed=1)  # 40 tokens: the last block is padded
    _check(backend, q, k, v, None, jnp.float32, f"{backend} decay+documents", log_decay=log_decay,
           segment_ids=jnp.asarray(SEGMENTS_40))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_initial_state_matching_its_document_or_not_matches_the_reference(backend):
    # Row 0's state belongs to no document of the row (never read), row 1's to its first (read by
    # tokens 0..36, across all three blocks). dv = 48 pads to 64 columns for Pallas.
    q, k, v, state, log_decay = _inputs(40, 4, 2, dv=48, seed=2)
    _check(backend, q, k, v, state, jnp.float32, f"{backend} initial state", log_decay=log_decay,
           segment_ids=jnp.asarray(SEGMENTS_40), initial_segment=jnp.array([4, 5], jnp.int32))


def test_the_reference_reads_an_initial_state_in_its_document_only():
    q, k, v, state, log_decay = _inputs(40, 4, 2, seed=2)
    segments = jnp.asarray(SEGMENTS_40)
    with_state = la.reference(q, k, v, segments, log_decay=log_decay, initial_state=state,
                              initial_segment=jnp.array([4, 5], jnp.int32))
    without = la.reference(q, k, v, segments, log_decay=log_decay)
    changed = np.any(np.asarray(with_state != without), axis=(2, 3))  # [B, S]: tokens the state reached
    np.testing.assert_array_equal(changed, np.asarray(segments == jnp.array([[4], [5]])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs_match_the_reference_within_bf16_tolerance(backend):
    # The state enters its products in bf16 (as the matrix cores take it): kernel_checks' bf16
    # tolerance, 4e-2 of the largest reference magnitude.
    q, k, v, state, log_decay = _inputs(48, 4, 2, dtype=jnp.bfloat16, seed=3)
    segments = jnp.asarray(np.concatenate([SEGMENTS_40, SEGMENTS_40[:, -8:]], axis=1))
    _check(backend, q, k, v, state, jnp.bfloat16, f"{backend} bf16", log_decay=log_decay, segment_ids=segments,
           initial_segment=segments[:, 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_second_half_from_the_first_halfs_state_equals_the_whole_sequence(backend):
    # What LASP-2 relies on: a chunk given the state its predecessor leaves (and that state's
    # document) continues the sequence exactly.
    q, k, v, _, log_decay = _inputs(64, 4, 2, seed=4)
    segments = jnp.asarray(np.repeat([[0, 1, 1, 2], [3, 3, 3, 3]], 16, axis=1).astype(np.int32))
    half = 32

    @jax.jit
    def second_half(q, k, v):
        state = la.chunk_state(k[:, :half], v[:, :half], segments[:, :half], log_decay, 4)
        return ops.linear_attention(q[:, half:], k[:, half:], v[:, half:], segments[:, half:], log_decay=log_decay,
                                    initial_state=state, initial_segment=segments[:, half - 1], backend=backend)

    second = second_half(q, k, v)
    whole = jax.jit(lambda q, k, v: la.reference(q, k, v, segments, log_decay=log_decay))(q, k, v)
    assert_close(second, whole[:, half:], jnp.float32, f"{backend} second half")


def test_xla_pads_a_sequence_that_is_not_a_whole_number_of_its_chunks():
    # The other tests fit in one xla chunk (ops.XLA_CHUNK tokens); here a document and the initial
    # state's reach cross a chunk boundary and the last chunk is padded.
    length = ops.XLA_CHUNK + 16
    q, k, v, state, log_decay = _inputs(length, 4, 2, seed=5)
    segments = jnp.asarray(np.repeat([[0, 1], [2, 2]], [20, length - 20], axis=1).astype(np.int32))
    _check("xla", q, k, v, state, jnp.float32, "xla two chunks", log_decay=log_decay, segment_ids=segments)


def test_pallas_refuses_head_dims_triton_cannot_tile():
    q, k, v, *_ = _inputs(16, 2, 2, dk=24)
    with pytest.raises(ValueError, match="multiple of 16 .*got 24: pad the heads to 32 or use backend='xla'"):
        ops.linear_attention(q, k, v, backend="pallas")


def test_an_initial_state_of_the_wrong_shape_is_named():
    q, k, v, state, _ = _inputs(16, 4, 2)
    with pytest.raises(ValueError, match=r"initial_state must be \[B, nk, nq/nk, dk, dv\] = \[2, 2, 2, 16, 32\]"):
        ops.linear_attention(q, k, v, initial_state=state[:, :1])
