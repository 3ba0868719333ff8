"""Flash attention: every backend against the plain-jnp reference, values and gradients."""

import jax
import jax.numpy as jnp
import pytest

from kernel_checks import check_values_and_grads
from zaya_jax import kernels
from zaya_jax.kernels import reference
from zaya_jax.kernels.tuning import AttentionBlocks


def _inputs(batch, seq, nq, nk, dim, dtype, doc_prob=None, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (batch, seq, nq, dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq, nk, dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq, nk, dim), dtype)
    segments = None
    if doc_prob is not None:  # a new document starts at each position with this probability
        segments = jnp.cumsum(jax.random.bernoulli(keys[3], doc_prob, (batch, seq)), axis=1).astype(jnp.int32)
    return q, k, v, segments


def _check(backend, batch, seq, nq, nk, dim, dtype, doc_prob=None, causal=True, blocks=None):
    q, k, v, segments = _inputs(batch, seq, nq, nk, dim, dtype, doc_prob)

    def kernel(q, k, v):
        return kernels.flash_attention(q, k, v, segment_ids=segments, causal=causal, backend=backend, blocks=blocks)

    def ref(q, k, v):
        return reference.attention(q, k, v, segments, causal=causal)

    what = f"{backend} attention B{batch} S{seq} nq{nq} nk{nk} d{dim} {jnp.dtype(dtype).name} docs={doc_prob}"
    check_values_and_grads(kernel, ref, (q, k, v), (0, 1, 2), dtype, what)


@pytest.mark.parametrize("seq,nq,nk,doc_prob", [
    (64, 4, 4, None),  # GQA ratio 1, whole blocks
    (50, 4, 2, 0.3),  # ratio 2, odd length, many short documents
    (37, 8, 2, 0.05),  # ratio 4 (ZAYA1's), odd length, a few documents
    (70, 4, 1, 0.5),  # MQA, documents of ~2 tokens, padding past two blocks
])
def test_pallas_fp32_matches_reference(seq, nq, nk, doc_prob):
    _check("pallas", 2, seq, nq, nk, 16, jnp.float32, doc_prob)


@pytest.mark.parametrize("dim", [64, 128])
def test_pallas_zaya_head_dims(dim):
    _check("pallas", 1, 48, 4, 2, dim, jnp.float32, 0.1)


def test_pallas_bf16_matches_reference_loosely():
    _check("pallas", 2, 45, 4, 2, 32, jnp.bfloat16, 0.1)


def test_pallas_non_causal_with_segments():
    _check("pallas", 1, 40, 4, 2, 16, jnp.float32, 0.2, causal=False)


def test_pallas_blocks_are_parameters():
    # Unequal forward/backward blocks, and blocks larger than the sequence (shrunk to fit).
    _check("pallas", 1, 33, 2, 1, 16, jnp.float32, 0.1,
           blocks=AttentionBlocks(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16))
    _check("pallas", 1, 20, 2, 2, 16, jnp.float32, None,
           blocks=AttentionBlocks(block_q=128, block_k=128, block_q_bwd=128, block_k_bwd=128))


@pytest.mark.parametrize("seq,nq,nk,doc_prob,dtype,causal", [
    (29, 4, 2, None, jnp.float32, True),
    (29, 4, 2, 0.2, jnp.float32, True),
    (37, 8, 2, 0.05, jnp.float32, True),  # ZAYA1's GQA ratio 4
    (20, 4, 1, 0.5, jnp.float32, True),  # MQA, ~2-token documents
    (24, 4, 4, 0.2, jnp.float32, False),  # documents only
    (32, 4, 2, 0.2, jnp.bfloat16, True),
])
def test_xla_backend_matches_reference(seq, nq, nk, doc_prob, dtype, causal):
    # The written-out backward (xla_attention) against autodiff of the reference.
    _check("xla", 2, seq, nq, nk, 16, dtype, doc_prob, causal=causal)


def test_xla_backend_takes_a_traced_offset():
    q, k, v, segments = _inputs(1, 48, 4, 2, 16, jnp.float32, 0.2)
    local = jax.jit(lambda o: kernels.flash_attention(
        jax.lax.dynamic_slice_in_dim(q, o, 16, 1), k, v, backend="xla", q_offset=o, kv_segment_ids=segments,
        segment_ids=jax.lax.dynamic_slice_in_dim(segments, o, 16, 1)))(32)
    assert jnp.allclose(local, reference.attention(q, k, v, segments)[:, 32:], atol=1e-5)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_single_token_documents_attend_to_themselves(backend):
    q, k, v, _ = _inputs(1, 20, 2, 1, 16, jnp.float32)
    segments = jnp.arange(20, dtype=jnp.int32)[None]
    out = kernels.flash_attention(q, k, v, segment_ids=segments, backend=backend)
    assert jnp.allclose(out, jnp.repeat(v, 2, axis=2), atol=1e-6)


@pytest.mark.skipif(kernels.registry.gpu_vendor() != "cuda", reason="cuDNN attention needs an NVIDIA GPU")
@pytest.mark.parametrize("doc_prob", [None, 0.01])
def test_cudnn_backend_matches_reference(doc_prob):
    _check("cudnn", 2, 256, 8, 2, 128, jnp.bfloat16, doc_prob)


@pytest.mark.parametrize("doc_prob, offset, causal", [(None, None, True), (0.2, None, True), (0.2, 16, True),
                                                       (None, 32, True), (0.3, None, False)])
def test_the_cudnn_backends_call_masks_documents_and_offsets_as_the_reference(doc_prob, offset, causal):
    """The cudnn backend's own part, the mask it hands `jax.nn.dot_product_attention` (packed
    documents, a sequence-sharded query's offset, the kernel's causal flag), run through XLA's
    implementation of the same call: values and gradients against the reference."""
    from zaya_jax.kernels import xla_backends

    q, k, v, segments = _inputs(2, 48, 4, 2, 16, jnp.float32, doc_prob)
    rows = slice(offset or 0, (offset or 0) + 16) if offset is not None else slice(None)
    q_seg = None if segments is None else segments[:, rows]

    def kernel(q, k, v):
        return xla_backends.cudnn_attention(q[:, rows], k, v, q_seg, causal=causal, q_offset=offset,
                                            kv_segment_ids=None if offset is None else segments,
                                            implementation="xla")

    def ref(q, k, v):
        return reference.attention(q, k, v, segments, causal=causal)[:, rows]

    check_values_and_grads(kernel, ref, (q, k, v), (0, 1, 2), jnp.float32, f"cudnn's mask {doc_prob} {offset}")


def test_bad_shapes_are_named():
    q, k, v, _ = _inputs(1, 8, 3, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kernels.flash_attention(q, k, v)
    q, k, v, _ = _inputs(1, 8, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="segment_ids must be integer"):
        kernels.flash_attention(q, k, v, segment_ids=jnp.zeros((1, 9), jnp.int32))


@pytest.mark.parametrize("backend,chunk,offset,doc_prob", [
    ("pallas", 16, 0, 0.2),  # the first chunk: only its own keys are visible
    ("pallas", 16, 48, 0.2),  # the last of four chunks of 64
    ("pallas", 13, 26, None),  # not a block multiple, no documents
    ("xla", 16, 48, 0.2),
    ("xla", 8, 40, 0.5),  # a short chunk, many tiny documents
])
def test_sequence_sharded_queries_match_the_reference(backend, chunk, offset, doc_prob):
    # Local queries of one sequence chunk against the all-gathered keys (the layouts' form):
    # the result must be those rows of attention over the whole sequence.
    total = offset + chunk + 11  # keys continue past the chunk
    q, k, v, segments = _inputs(2, total, 4, 2, 16, jnp.float32, doc_prob, seed=offset)
    rows = slice(offset, offset + chunk)
    q_segments = None if segments is None else segments[:, rows]

    def kernel(q, k, v):
        return kernels.flash_attention(q[:, rows], k, v, segment_ids=q_segments, kv_segment_ids=segments,
                                       q_offset=offset, backend=backend,
                                       blocks=AttentionBlocks(16, 16, 16, 16, 4, 1))

    def ref(q, k, v):
        return reference.attention(q, k, v, segments)[:, rows]

    check_values_and_grads(kernel, ref, (q, k, v), (0, 1, 2), jnp.float32,
                           f"{backend} queries {rows.start}:{rows.stop} of {total}")


def test_pallas_takes_only_a_static_offset():
    q, k, v, _ = _inputs(1, 32, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="q_offset as a Python int"):
        jax.jit(lambda o: kernels.flash_attention(q[:, :16], k, v, q_offset=o, backend="pallas"))(16)
