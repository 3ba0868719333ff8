"""Vocabulary-chunked cross-entropy for ZAYA1's tied LM head.

ZAYA1 ties the LM head to the input embedding (vocab 262,272 × hidden 2048). Materialising the
full fp32 logits for a training batch costs ~1 MiB per token (4 GiB at 4k tokens), and autodiff
would keep them alive — plus their softmax — until the backward pass. This module computes the
per-token loss one vocabulary chunk at a time instead: the forward keeps an online logsumexp
(running max and running sum-exp) per token, and a `jax.custom_vjp` backward recomputes each
chunk's logits from `hidden`, the table and the saved logsumexp. Peak extra memory is
O(tokens × chunk_size) rather than O(tokens × vocab).

**Vocabulary-parallel** (Megatron's): when the `vocab` rule splits the table over the mesh's
`tensor` axis (`parallel/rules.py`), every tensor rank holds V/T rows and sees the same tokens,
so `token_loss` runs the chunked loop per rank on its slice and combines the per-token
statistics across ranks: the max by `pmax`, the rescaled sum of exponentials and the target's
logit by `psum`; the backward rebuilds each rank's slice of the softmax from the shared lse and
sums the hidden-state gradient over the ranks. No rank computes, or holds, the whole head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.batch_map import axis_size, schedule_map, row_spec
from zaya_jax.parallel.rules import entry_axes, partition_spec

VOCAB_AXIS = "tensor"  # the mesh axis the `vocab` rule splits the table over


def reference_cross_entropy(hidden: jax.Array, embedding: jax.Array, targets: jax.Array) -> jax.Array:
    """Full-logits per-token loss fp32[...]; the ground truth for `chunked_cross_entropy`."""
    logits = jnp.einsum("...h,vh->...v", hidden.astype(jnp.float32), embedding.astype(jnp.float32),
                        preferred_element_type=jnp.float32)
    picked = jnp.take_along_axis(logits, targets.astype(jnp.int32)[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def token_loss(hidden: jax.Array, embedding: jax.Array, targets: jax.Array, *, chunk_size: int = 16384,
               matmul_dtype=jnp.float32) -> jax.Array:
    """`chunked_cross_entropy` over the ambient mesh: vocabulary-parallel over `tensor` when the
    rules split the table there, else as GSPMD places it. hidden [B, S, H], targets [B, S]."""
    ranks = _vocab_ranks(embedding)
    if ranks == 1:
        return chunked_cross_entropy(hidden, embedding, targets, chunk_size=chunk_size, matmul_dtype=matmul_dtype)
    chunk = min(int(chunk_size), embedding.shape[0] // ranks)
    return _vocab_parallel_ce(chunk, jnp.dtype(matmul_dtype), hidden, embedding, targets.astype(jnp.int32))


def _vocab_ranks(embedding: jax.Array) -> int:
    """How many `tensor` ranks the ambient mesh's rules split the table over (1: not split)."""
    mesh = jax.sharding.get_abstract_mesh()
    split = not mesh.empty and VOCAB_AXIS in entry_axes(partition_spec(("vocab", "embed"), mesh, embedding.shape)[0])
    return axis_size(VOCAB_AXIS) if split else 1


# The vocabulary-parallel loss differentiates itself: its forward and backward are each one
# shard_map with every collective written out, so no autodiff convention for shard_map's
# replicated values (which moved between JAX versions) decides a gradient's scale.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _vocab_parallel_ce(chunk, dtype, hidden, embedding, targets):
    return _vocab_parallel_fwd(chunk, dtype, hidden, embedding, targets)[0]


def token_scores(hidden: jax.Array, embedding: jax.Array, targets: jax.Array, *, chunk_size: int = 16384,
                 matmul_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Per token: log p(target) fp32[...] and whether the target's logit is the largest (greedy
    decoding's pick), from the loss's own chunked pass (vocabulary-parallel as `token_loss` is);
    for evaluation, no gradient. hidden [B, S, H], targets [B, S]."""
    targets = targets.astype(jnp.int32)
    ranks = _vocab_ranks(embedding)
    chunk = min(int(chunk_size), embedding.shape[0] // ranks)
    if ranks == 1:
        loss, _, gap = _forward(chunk, jnp.dtype(matmul_dtype), None, hidden, embedding, targets, with_max=True)
    else:
        rows = row_spec()
        forward = functools.partial(_forward, chunk, jnp.dtype(matmul_dtype), VOCAB_AXIS, with_max=True)
        loss, _, gap = schedule_map(forward, in_specs=(P(*rows, None), P(VOCAB_AXIS, None), rows),
                                      out_specs=(rows, rows, rows), check_vma=False)(hidden, embedding, targets)
    return -loss, gap <= 0


def _vocab_parallel_fwd(chunk, dtype, hidden, embedding, targets):
    rows = row_spec()
    forward = functools.partial(_forward, chunk, dtype, VOCAB_AXIS)
    loss, lse = schedule_map(forward, in_specs=(P(*rows, None), P(VOCAB_AXIS, None), rows), out_specs=(rows, rows),
                           check_vma=False)(hidden, embedding, targets)
    return loss, (hidden, embedding, targets, lse)


def _vocab_parallel_bwd(chunk, dtype, residuals, g):
    rows = row_spec()
    token_axes = tuple(a for entry in rows for a in entry_axes(entry))

    def backward(hidden, embedding, targets, lse, g):
        d_hidden, d_embedding, _ = _bwd(chunk, dtype, VOCAB_AXIS, (hidden, embedding, targets, lse), g)
        # This rank's slice of the table gradient, summed over the tokens of every rank holding it.
        return d_hidden, jax.lax.psum(d_embedding, token_axes) if token_axes else d_embedding

    d_hidden, d_embedding = schedule_map(backward, in_specs=(P(*rows, None), P(VOCAB_AXIS, None), rows, rows, rows),
                                       out_specs=(P(*rows, None), P(VOCAB_AXIS, None)),
                                       check_vma=False)(*residuals, g)
    return d_hidden, d_embedding, None


_vocab_parallel_ce.defvjp(_vocab_parallel_fwd, _vocab_parallel_bwd)


def chunked_cross_entropy(hidden: jax.Array, embedding: jax.Array, targets: jax.Array, *,
                          chunk_size: int = 16384, matmul_dtype=jnp.float32) -> jax.Array:
    """Per-token loss fp32[...] = logsumexp(hidden @ embeddingᵀ) - logit[target].

    The logits matmuls (forward, and both of the backward) take their inputs in `matmul_dtype`
    and accumulate in fp32, as Megatron and MaxText run the head in bf16; the softmax, the loss
    and every sum stay fp32. With the default fp32 nothing is rounded (HF parity).

    hidden: float[..., H] (e.g. [B, S, H]); embedding: float[V, H], the tied table; targets:
    int[...] in [0, V), the same leading shape as hidden.
    The `[..., V]` logits never exist at once: at most `[..., chunk_size]` per step, forward and
    backward. Gradients flow to `hidden` and `embedding` in their own dtypes; none to targets.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    chunk = min(int(chunk_size), embedding.shape[0])
    return _chunked_ce(chunk, jnp.dtype(matmul_dtype), None, hidden, embedding, targets.astype(jnp.int32))


def _first_row(embedding: jax.Array, axis: str | None):
    """The table row this rank's slice starts at (0 without a vocabulary axis: the whole table)."""
    return 0 if axis is None else jax.lax.axis_index(axis) * embedding.shape[0]


def _chunked_table(embedding: jax.Array, chunk: int) -> jax.Array:
    """[V, H] → [n, chunk, H], zero rows appended so V need not divide by chunk.

    Padding stays in the input dtype; each chunk is cast to the matmul dtype inside the loop, so no
    copy of the whole table is made.
    """
    vocab, width = embedding.shape
    num_chunks = -(-vocab // chunk)
    padded = jnp.pad(embedding, ((0, num_chunks * chunk - vocab), (0, 0)))
    return padded.reshape(num_chunks, chunk, width)


def _chunk_logits(h: jax.Array, table_chunk: jax.Array, offset: jax.Array, vocab: int):
    """fp32 logits [..., chunk] of one chunk (h and the chunk in h's dtype, fp32 accumulation) and
    the mask of its real (non-padding) columns."""
    logits = jnp.einsum("...h,ch->...c", h, table_chunk.astype(h.dtype), preferred_element_type=jnp.float32)
    valid = offset + jnp.arange(table_chunk.shape[0]) < vocab
    return logits, valid


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked_ce(chunk: int, dtype, axis, hidden: jax.Array, embedding: jax.Array, targets: jax.Array) -> jax.Array:
    return _forward(chunk, dtype, axis, hidden, embedding, targets)[0]


@jax.named_scope("loss")  # inside: a custom_vjp's rules do not see their caller's scope
def _forward(chunk, dtype, axis, hidden, embedding, targets, with_max: bool = False):
    """Returns (loss, lse), and `with_max` the largest logit's lead over the target's: one pass over the chunks with an
    online logsumexp, then (vocabulary-parallel) the ranks' statistics combined."""
    vocab = embedding.shape[0]
    first = _first_row(embedding, axis)
    h = hidden.astype(dtype)
    chunks = _chunked_table(embedding, chunk)
    tokens = h.shape[:-1]

    def step(carry, xs):
        run_max, run_sum, target_logit = carry
        table_chunk, offset = xs
        logits, valid = _chunk_logits(h, table_chunk, offset, vocab)
        logits = jnp.where(valid, logits, -jnp.inf)
        offset = offset + first
        # Every chunk holds at least one real column, so new_max is finite and the rescale of
        # the previous sum (exp(-inf) = 0 on the first chunk) never produces NaN.
        chunk_max, chunk_sum = _max_and_sum_exp(logits)
        new_max = jnp.maximum(run_max, chunk_max)
        run_sum = run_sum * jnp.exp(run_max - new_max) + chunk_sum * jnp.exp(chunk_max - new_max)
        local = targets - offset
        # A padding column of this slice may carry the index of the next slice's row: not ours.
        here = (local >= 0) & (local < chunk) & (targets - first < vocab)
        picked = jnp.take_along_axis(logits, jnp.clip(local, 0, chunk - 1)[..., None], axis=-1)[..., 0]
        target_logit = target_logit + jnp.where(here, picked, 0.0)
        return (new_max, run_sum, target_logit), None

    init = (jnp.full(tokens, -jnp.inf, jnp.float32), jnp.zeros(tokens, jnp.float32), jnp.zeros(tokens, jnp.float32))
    offsets = jnp.arange(chunks.shape[0], dtype=jnp.int32) * chunk
    (run_max, run_sum, target_logit), _ = jax.lax.scan(step, init, (chunks, offsets))
    if axis is not None:
        # Every rank's slice holds real columns, so each run_max is finite and so is the shared max.
        shared = jax.lax.pmax(run_max, axis)
        run_sum = jax.lax.psum(run_sum * jnp.exp(run_max - shared), axis)
        run_max, target_logit = shared, jax.lax.psum(target_logit, axis)
    lse = run_max + jnp.log(run_sum)
    # The gap to the largest logit is exactly 0 where the target is it (both are the same logit).
    return (lse - target_logit, lse, run_max - target_logit) if with_max else (lse - target_logit, lse)


def _max_and_sum_exp(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of `logits` [..., C]: its max m and sum(exp(logits - m)), in one read of the chunk (a
    max and then a sum of exponentials would read it twice). Pairs (m, s) combine as an online
    logsumexp; a -inf column's pair (-inf, 1) weighs exp(-inf) = 0 against any real column."""

    def combine(a, b):
        (max_a, sum_a), (max_b, sum_b) = a, b
        top = jnp.maximum(max_a, max_b)
        # Two -inf halves share top = -inf: weight 1, not exp(nan); a real column later zeroes them.
        weight = lambda m: jnp.where(m == top, 1.0, jnp.exp(m - top))
        return top, sum_a * weight(max_a) + sum_b * weight(max_b)

    init = (jnp.float32(-jnp.inf), jnp.float32(0.0))
    return jax.lax.reduce((logits, jnp.ones_like(logits)), init, combine, (logits.ndim - 1,))


def _fwd(chunk, dtype, axis, hidden, embedding, targets):
    loss, lse = _forward(chunk, dtype, axis, hidden, embedding, targets)
    return loss, (hidden, embedding, targets, lse)


@jax.named_scope("loss")
def _bwd(chunk, dtype, axis, residuals, g):
    """dloss/dlogits = g · (softmax - onehot(target)), rebuilt chunk by chunk from the saved lse;
    vocabulary-parallel, each rank its slice, the hidden-state gradient summed over the ranks."""
    hidden, embedding, targets, lse = residuals
    vocab = embedding.shape[0]
    first = _first_row(embedding, axis)
    h = hidden.astype(dtype)
    g = g.astype(jnp.float32)
    chunks = _chunked_table(embedding, chunk)

    def step(d_hidden, xs):
        table_chunk, offset = xs
        logits, valid = _chunk_logits(h, table_chunk, offset, vocab)
        probs = jnp.where(valid, jnp.exp(logits - lse[..., None]), 0.0)
        onehot = (first + offset + jnp.arange(chunk) == targets[..., None]) & valid
        dlogits = ((probs - onehot.astype(jnp.float32)) * g[..., None]).astype(dtype)
        d_hidden = d_hidden + jnp.einsum("...c,ch->...h", dlogits, table_chunk.astype(dtype),
                                         preferred_element_type=jnp.float32)
        # Cast per chunk so the stacked table gradient is built in the table's own dtype.
        d_chunk = jnp.einsum("...c,...h->ch", dlogits, h, preferred_element_type=jnp.float32).astype(embedding.dtype)
        return d_hidden, d_chunk

    offsets = jnp.arange(chunks.shape[0], dtype=jnp.int32) * chunk
    d_hidden, d_chunks = jax.lax.scan(step, jnp.zeros(h.shape, jnp.float32), (chunks, offsets))
    if axis is not None:
        d_hidden = jax.lax.psum(d_hidden, axis)
    d_embedding = d_chunks.reshape(-1, embedding.shape[1])[:vocab]
    return d_hidden.astype(hidden.dtype), d_embedding, None


_chunked_ce.defvjp(_fwd, _bwd)
