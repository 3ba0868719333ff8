"""Causal linear attention with a per-head decay and packed-document resets: the math, twice.

    out_t = Σ_{s ≤ t, s in t's document} λ_h^(t−s) (q_t · k_s) v_s

for query head h (reading KV head h // (nq / nk)), λ_h = exp(log_decay_h) ∈ (0, 1] (1: no
decay, basic linear attention; < 1: Lightning Attention / RetNet's fixed decay). q and k come
in after the layer's feature map.

- `reference`: the quadratic form, [S, S] weights per head: obviously correct, O(S²).
- `chunked`: the sequence in chunks of C. Inside a chunk the quadratic form (masked, decayed);
  across chunks a d_k × d_v memory state per head,
      M_c = λ^C · M_{c−1} · [chunk c continues the document of c−1's last token] + Σ_s λ^(C−1−s) k_sᵀ v_s,
  the sum over chunk c's tokens of its last token's document, and a token t of chunk c adds
  λ^(t−c₀+1) q_t M_{c−1} when it continues that document. Documents are contiguous, so the state
  of a chunk's last document is all a later token can need. This state is what LASP-2 exchanges
  between the devices of a sequence axis, one chunk per device.

Both take an optional `initial_state` fp32 [B, nk, g, dk, dv] (the memory entering the row from
earlier tokens, in `chunk_state`'s layout) and `initial_segment` int [B] (its document; default:
the row's first token's). Tokens of that document read it as `from_state` does, λ^(t+1) q_t M;
documents are contiguous, so that term needs no chunking. The registry entry point is
`kernels.ops.linear_attention`.
"""

from __future__ import annotations

import jax.numpy as jnp


def reference(q, k, v, segment_ids=None, *, log_decay=None, initial_state=None, initial_segment=None):
    """q [B, S, nq, dk], k [B, S, nk, dk], v [B, S, nk, dv], segment_ids int [B, S] or None,
    log_decay fp32 [nq] ≤ 0 or None → [B, S, nq, dv] in q's dtype (fp32 sums)."""
    batch, length, nq, dk = q.shape
    nk = k.shape[2]
    qg = q.reshape(batch, length, nk, nq // nk, dk)
    scores = jnp.einsum("bsngd,btnd->bngst", qg, k, preferred_element_type=jnp.float32)
    lag = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
    weight = _decay(lag, log_decay, nk, nq)  # [nk, g, S, S]
    mask = lag >= 0
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    weighted = jnp.where(mask, scores * weight, 0.0)
    out = jnp.einsum("bngst,btnd->bsngd", weighted, v.astype(jnp.float32)).reshape(batch, length, nq, -1)
    out = out + initial_term(q, segment_ids, log_decay, initial_state, initial_segment)
    return out.astype(q.dtype)


def initial_term(q, segment_ids, log_decay, initial_state, initial_segment):
    """What the tokens continuing `initial_state`'s document read from it: fp32 [B, S, nq, dv], or 0."""
    if initial_state is None:
        return 0.0
    seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
    owner = seg[:, 0] if initial_segment is None else initial_segment.astype(seg.dtype)
    return from_state(q, initial_state.astype(jnp.float32), seg, owner, log_decay)


def chunked(q, k, v, segment_ids=None, *, log_decay=None, chunk: int = 64, initial_state=None,
            initial_segment=None):
    """`reference` in chunks of `chunk` tokens (the sequence length must divide by it)."""
    batch, length, nq, _ = q.shape
    if length % chunk:
        raise ValueError(f"sequence length {length} must be a multiple of the chunk ({chunk})")
    count = length // chunk
    seg = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids
    split = lambda x: x.reshape(batch * count, chunk, *x.shape[2:])  # noqa: E731 (chunks as batch rows)
    qc, kc, vc, sc = split(q), split(k), split(v), split(seg)
    own = chunk_state(kc, vc, sc, log_decay, nq)  # [B·n, nk, g, dk, dv]
    own = own.reshape(batch, count, *own.shape[1:])
    ends = sc[:, -1].reshape(batch, count)
    entering = entering_states(own, ends, log_decay, nq, chunk)
    previous_end = jnp.concatenate([jnp.full((batch, 1), -1, seg.dtype), ends[:, :-1]], axis=1)
    out = intra_chunk(qc, kc, vc, sc, log_decay) + from_state(
        qc, entering.reshape(batch * count, *entering.shape[2:]), sc, previous_end.reshape(-1), log_decay)
    out = out.reshape(batch, length, nq, -1) + initial_term(q, segment_ids, log_decay, initial_state, initial_segment)
    return out.astype(q.dtype)


def pad_rows(x, length: int, value=0):
    """x [B, S, ...] with rows S.. length-1 filled with `value`: trailing tokens change nothing
    before them (attention is causal), so callers pad to a whole number of chunks and slice back."""
    pad = length - x.shape[1]
    return x if not pad else jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=value)


def intra_chunk(q, k, v, segment_ids, log_decay):
    """The quadratic form inside each row's chunk: fp32 [B, C, nq, dv]."""
    batch, length, nq, dk = q.shape
    nk = k.shape[2]
    qg = q.reshape(batch, length, nk, nq // nk, dk).astype(jnp.float32)
    lag = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (lag >= 0)
    scores = jnp.einsum("bsngd,btnd->bngst", qg, k.astype(jnp.float32))
    weighted = jnp.where(same[:, None, None], scores * _decay(lag, log_decay, nk, nq), 0.0)
    return jnp.einsum("bngst,btnd->bsngd", weighted, v.astype(jnp.float32)).reshape(batch, length, nq, -1)


def chunk_state(k, v, segment_ids, log_decay, nq: int):
    """Each row's own memory state: Σ_s λ^(C−1−s) k_sᵀ v_s over its last document, fp32
    [B, nk, g, dk, dv] (what LASP-2 all-gathers)."""
    length, nk = k.shape[1], k.shape[2]
    to_end = jnp.exp(_rates(log_decay, nk, nq)[:, :, None] * (length - 1 - jnp.arange(length)))  # [nk, g, C]
    last_doc = (segment_ids == segment_ids[:, -1:]).astype(jnp.float32)
    return jnp.einsum("ngt,bt,btnd,btne->bngde", to_end, last_doc, k.astype(jnp.float32), v.astype(jnp.float32))


def carry_state(state, k, v, segment_ids, log_decay, nq: int):
    """The state leaving a row of tokens, fp32 [B, nk, g, dk, dv], from the state entering it, where
    the row's last document continues the entering state's (generation's step):
    λ^S · state + the row's own state (`chunk_state`)."""
    length, nk = k.shape[1], k.shape[2]
    decay = jnp.exp(_rates(log_decay, nk, nq) * length)[None, :, :, None, None]
    return decay * state.astype(jnp.float32) + chunk_state(k, v, segment_ids, log_decay, nq)


def entering_states(own, ends, log_decay, nq: int, chunk: int, rows=None):
    """The state entering each chunk from the chunks' own states `own` [B, n, nk, g, dk, dv] and their
    last tokens' segment ids `ends` [B, n]: M_{c−1} = Σ_{j<c} λ^(C·(c−1−j)) own_j while every chunk
    after j continues j's last document. A masked sum over the n chunks, no scan, so a device that
    holds some chunks computes just their `rows` (int [r], may be traced; default every chunk) after
    one all-gather of the states (LASP-2). → [B, r, nk, g, dk, dv]."""
    count, nk = own.shape[1], own.shape[2]
    c = (jnp.arange(count) if rows is None else jnp.asarray(rows))[:, None]
    j = jnp.arange(count)[None, :]
    # continues[b, i]: chunk i's last document is chunk i−1's (no document starts in it).
    continues = jnp.concatenate([jnp.zeros_like(ends[:, :1], bool), ends[:, 1:] == ends[:, :-1]], axis=1)
    starts = jnp.cumsum(~continues, axis=1)  # documents started up to and including each chunk
    started_before_c = jnp.where(c > 0, jnp.take(starts, jnp.maximum(c - 1, 0)[:, 0], axis=1)[:, :, None], 0)
    # reach[b, c, j]: chunk j is before c and no chunk between them (j+1 .. c−1) starts a document.
    reach = (j < c)[None] & (started_before_c - starts[:, None, :] == 0)
    decay = jnp.exp(_rates(log_decay, nk, nq)[None, None] * (chunk * jnp.maximum(c - 1 - j, 0))[..., None, None])
    weights = jnp.where(reach[..., None, None], decay, 0.0)  # [B, r, n, nk, g]
    return jnp.einsum("bcjng,bjngde->bcngde", weights, own)


def from_state(q, entering, segment_ids, previous_end, log_decay):
    """q_t λ^(t+1) M for the rows' tokens that continue the document M holds (segment id
    `previous_end`, per row): fp32 [B, C, nq, dv]."""
    batch, length, nq, dk = q.shape
    nk = entering.shape[1]
    qg = q.reshape(batch, length, nk, nq // nk, dk).astype(jnp.float32)
    from_start = jnp.exp(_rates(log_decay, nk, nq)[:, :, None] * (jnp.arange(length) + 1))  # [nk, g, C]
    continues = (segment_ids == previous_end[:, None]).astype(jnp.float32)
    out = jnp.einsum("bsngd,bngde,ngs,bs->bsnge", qg, entering, from_start, continues)
    return out.reshape(batch, length, nq, -1)


def _rates(log_decay, nk: int, nq: int):
    """log λ per query head as [nk, g] (0: no decay)."""
    if log_decay is None:
        return jnp.zeros((nk, nq // nk), jnp.float32)
    return log_decay.astype(jnp.float32).reshape(nk, nq // nk)


def _decay(lag, log_decay, nk: int, nq: int):
    """λ_h^lag for lag ≥ 0 as [nk, g, Sq, Sk] (1 where log_decay is None); lag < 0 entries are
    finite (masked by the caller)."""
    if log_decay is None:
        return jnp.ones((nk, nq // nk) + lag.shape, jnp.float32)
    rate = log_decay.astype(jnp.float32).reshape(nk, nq // nk, 1, 1)
    return jnp.exp(rate * jnp.maximum(lag, 0))
