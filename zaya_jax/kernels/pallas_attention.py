"""Flash attention in Pallas (Triton lowering): causal GQA with packed-document segment ids.

Forward: one program per (query block, batch row, query head) streams the key/value blocks its
queries can see through an online softmax (base-2 exponentials, fp32 statistics) and saves the
log-sum-exp. Backward (FlashAttention-2): `delta = Σ o·do` in XLA, then one kernel per query
block for dq and one per key block for dk/dv, which walks every query head of its KV group, so
GQA needs no repeated K/V and no reduction afterwards. Both recompute probabilities from the
saved log-sum-exp. Sequences are zero-padded to the block size; padded keys are masked and
padded query rows sliced off.

Sequence-sharded form: the queries may be a shorter run of rows starting at sequence index
`q_offset` (a static int) among all the keys — a sequence shard's local queries against the
all-gathered K/V. The causal limit moves with the offset, so blocks past it are still skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from zaya_jax.kernels.pallas_dot import fp32_dot, launch
from zaya_jax.kernels.tuning import AttentionBlocks, blocks_for

LOG2E = math.log2(math.e)
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so masked rows never produce inf - inf


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one attention call (hashable: it is a custom_vjp nondiff arg)."""

    causal: bool
    scale: float
    seq: int  # real key length
    seq_pad: int  # keys padded to a multiple of every block
    q_seq_pad: int  # queries padded likewise
    q_offset: int  # sequence index of query row 0
    groups: int  # query heads per KV head
    segments: bool
    blocks: AttentionBlocks
    interpret: bool
    precision: lax.Precision | None

    def dot(self, a, b, contract=(1, 0)):
        return fp32_dot(a, b, contract, self.precision)

    def mask(self, q_idx, k_idx, q_seg, k_seg):
        """[bq, bk] visibility, or None when everything is visible."""
        parts = []
        if self.causal:
            parts.append(q_idx[:, None] + self.q_offset >= k_idx[None, :])
        if self.seq_pad != self.seq:
            parts.append(jnp.broadcast_to((k_idx < self.seq)[None, :], (q_idx.shape[0], k_idx.shape[0])))
        if self.segments:
            parts.append(q_seg[:, None] == k_seg[None, :])
        return functools.reduce(jnp.logical_and, parts) if parts else None

    def call(self, kernel, grid, in_specs, args, out_specs, out_shape):
        return launch(kernel, self, f"zaya{kernel.__name__}", grid, in_specs, args, out_specs, out_shape)


def flash_attention(q, k, v, segment_ids=None, *, causal=True, scale=None, blocks=None, interpret=False,
                    kv_segment_ids=None, q_offset: int = 0):
    """Pallas flash attention; same contract as `kernels.reference.attention` (`q_offset` static)."""
    q_seq, nq, dim = q.shape[1:]
    seq, nk = k.shape[1:3]
    blocks = _fit_blocks(blocks or blocks_for("attention", q.dtype), max(seq, q_seq))
    multiple = max(blocks.block_q, blocks.block_k, blocks.block_q_bwd, blocks.block_k_bwd)
    plan = _Plan(causal=bool(causal), scale=float(dim ** -0.5 if scale is None else scale), seq=seq,
                 seq_pad=_round_up(seq, multiple), q_seq_pad=_round_up(q_seq, multiple), q_offset=int(q_offset),
                 groups=nq // nk, segments=segment_ids is not None, blocks=blocks, interpret=bool(interpret),
                 precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    if segment_ids is not None:
        segment_ids = (_pad_rows(segment_ids, plan.q_seq_pad, -1),
                       _pad_rows(segment_ids if kv_segment_ids is None else kv_segment_ids, plan.seq_pad, -1))
    q = _pad_rows(q, plan.q_seq_pad)
    k, v = (_pad_rows(t, plan.seq_pad) for t in (k, v))
    out = _attention(q, k, v, segment_ids, plan)
    return out[:, :q_seq]


def _pad_rows(x, length: int, value=0):
    pad = length - x.shape[1]
    if not pad:
        return x
    return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=value)


def _fit_blocks(blocks: AttentionBlocks, seq: int) -> AttentionBlocks:
    """Shrink blocks for short sequences (never below 16, Triton's smallest dot tile)."""
    cap = max(16, pl.next_power_of_2(seq))
    return dataclasses.replace(blocks, **{f: min(getattr(blocks, f), cap)
                                          for f in ("block_q", "block_k", "block_q_bwd", "block_k_bwd")})


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segment_ids, plan):
    return _forward(q, k, v, segment_ids, plan)[0]


def _attention_fwd(q, k, v, segment_ids, plan):
    out, lse = _forward(q, k, v, segment_ids, plan)
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(plan, residuals, dout):
    q, k, v, segment_ids, out, lse = residuals
    delta = jnp.einsum("bsnd,bsnd->bns", out.astype(jnp.float32), dout.astype(jnp.float32))
    dq = _backward_dq(q, k, v, segment_ids, dout, lse, delta, plan)
    dk, dv = _backward_dkv(q, k, v, segment_ids, dout, lse, delta, plan)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------------------------
# Forward


def _forward(q, k, v, segment_ids, plan: _Plan):
    batch, seq, nq, _ = q.shape
    row, kv, stat, segments = _query_block_specs(plan, q.shape)
    return plan.call(_forward_kernel, (seq // plan.blocks.block_q, batch, nq),
                     [row, kv, kv] + segments, [q, k, v] + list(segment_ids or ()),
                     [row, stat], [jax.ShapeDtypeStruct(q.shape, q.dtype),
                                   jax.ShapeDtypeStruct((batch, nq, seq), jnp.float32)])


def _query_block_specs(plan: _Plan, q_shape):
    """Specs for a grid over (query block, batch, query head): the query rows, their KV head's
    whole sequence, per-row statistics, and the query/key segment ids (none without segments)."""
    seq, dim = plan.seq_pad, q_shape[3]
    bq, g = plan.blocks.block_q, plan.groups
    row = pl.BlockSpec((None, bq, None, dim), lambda i, b, h: (b, i, h, 0))
    kv = pl.BlockSpec((None, seq, None, dim), lambda i, b, h: (b, 0, h // g, 0))
    stat = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    segments = [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                pl.BlockSpec((None, seq), lambda i, b, h: (b, 0))] if plan.segments else []
    return row, kv, stat, segments


def _forward_kernel(*refs, plan: _Plan):
    q_ref, k_ref, v_ref = refs[:3]
    q_seg_ref, k_seg_ref = refs[3:5] if plan.segments else (None, None)
    o_ref, lse_ref = refs[-2:]
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    i = pl.program_id(0)
    q = q_ref[...]
    q_idx = i * bq + jnp.arange(bq)
    q_seg = q_seg_ref[...] if plan.segments else None
    log2_scale = plan.scale * LOG2E

    def step(j, carry):
        acc, m, l = carry
        keys = pl.ds(j * bk, bk)
        k_blk, v_blk = k_ref[keys, :], v_ref[keys, :]
        s = plan.dot(q, k_blk, (1, 1)) * log2_scale
        mask = plan.mask(q_idx, j * bk + jnp.arange(bk), q_seg, k_seg_ref[keys] if plan.segments else None)
        if mask is not None:
            s = jnp.where(mask, s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + plan.dot(p.astype(v_blk.dtype), v_blk)
        return acc, m_new, l

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, _key_steps(plan, i), step, init)
    # A row that saw no key (only padding rows can) gets 0 out and lse = +inf, so p = 0 later.
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(l_safe))


def _key_steps(plan: _Plan, i):
    """How many key blocks query block i can see: up to its diagonal if causal, and never padding."""
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    last = pl.cdiv(plan.seq, bk)
    if not plan.causal:
        return last
    return jnp.minimum(lax.div((i + 1) * bq + plan.q_offset + bk - 1, bk), last)


# ---------------------------------------------------------------------------------------------
# Backward


def _backward_dq(q, k, v, segment_ids, dout, lse, delta, plan: _Plan):
    batch, seq, nq, _ = q.shape
    row, kv, stat, segments = _query_block_specs(plan, q.shape)
    return plan.call(_dq_kernel, (seq // plan.blocks.block_q, batch, nq),
                     [row, kv, kv, row, stat, stat] + segments,
                     [q, k, v, dout, lse, delta] + list(segment_ids or ()),
                     row, jax.ShapeDtypeStruct(q.shape, q.dtype))


def _dq_kernel(*refs, plan: _Plan):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    q_seg_ref, k_seg_ref = refs[6:8] if plan.segments else (None, None)
    dq_ref = refs[-1]
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_idx = i * bq + jnp.arange(bq)
    q_seg = q_seg_ref[...] if plan.segments else None

    def step(j, dq):
        keys = pl.ds(j * bk, bk)
        k_blk, v_blk = k_ref[keys, :], v_ref[keys, :]
        mask = plan.mask(q_idx, j * bk + jnp.arange(bk), q_seg, k_seg_ref[keys] if plan.segments else None)
        p = _probabilities(plan, q, k_blk, lse, mask)
        ds = p * (plan.dot(do, v_blk, (1, 1)) - delta[:, None])
        return dq + plan.dot(ds.astype(k_blk.dtype), k_blk)

    dq = lax.fori_loop(0, _key_steps(plan, i), step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _backward_dkv(q, k, v, segment_ids, dout, lse, delta, plan: _Plan):
    batch, seq, nq, dim = q.shape  # seq: the (padded) query rows
    nk, g = k.shape[2], plan.groups
    bk = plan.blocks.block_k_bwd
    # Views with the KV group as its own axis, so one program reads all of its group's heads.
    q5, do5 = (t.reshape(batch, seq, nk, g, dim) for t in (q, dout))
    lse4, delta4 = (t.reshape(batch, nk, g, seq) for t in (lse, delta))
    group_spec = pl.BlockSpec((None, seq, None, g, dim), lambda j, b, h: (b, 0, h, 0, 0))
    stat_spec = pl.BlockSpec((None, None, g, seq), lambda j, b, h: (b, h, 0, 0))
    kv_spec = pl.BlockSpec((None, bk, None, dim), lambda j, b, h: (b, j, h, 0))
    in_specs = [group_spec, kv_spec, kv_spec, group_spec, stat_spec, stat_spec]
    args = [q5, k, v, do5, lse4, delta4]
    if plan.segments:
        in_specs += [pl.BlockSpec((None, seq), lambda j, b, h: (b, 0)),
                     pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
        args += list(segment_ids)
    return plan.call(_dkv_kernel, (plan.seq_pad // bk, batch, nk), in_specs, args, [kv_spec, kv_spec],
                     [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)])


def _dkv_kernel(*refs, plan: _Plan):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    q_seg_ref, k_seg_ref = refs[6:8] if plan.segments else (None, None)
    dk_ref, dv_ref = refs[-2:]
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    j = pl.program_id(0)
    k_blk, v_blk = k_ref[...], v_ref[...]
    k_idx = j * bk + jnp.arange(bk)
    k_seg = k_seg_ref[...] if plan.segments else None
    # Causal: query blocks strictly before this key block see none of it.
    first = jnp.maximum(lax.div(j * bk - plan.q_offset, bq), 0) if plan.causal else 0
    dk = jnp.zeros(k_blk.shape, jnp.float32)
    dv = jnp.zeros(v_blk.shape, jnp.float32)
    for head in range(plan.groups):  # static: the query heads of this KV group

        def step(i, carry, head=head):
            dk, dv = carry
            rows = pl.ds(i * bq, bq)
            q, do = q_ref[rows, head, :], do_ref[rows, head, :]
            lse, delta = lse_ref[head, rows], delta_ref[head, rows]
            mask = plan.mask(i * bq + jnp.arange(bq), k_idx, q_seg_ref[rows] if plan.segments else None, k_seg)
            p = _probabilities(plan, q, k_blk, lse, mask)
            dv = dv + plan.dot(p.astype(do.dtype), do, (0, 0))
            ds = p * (plan.dot(do, v_blk, (1, 1)) - delta[:, None])
            return dk + plan.dot(ds.astype(q.dtype), q, (0, 0)), dv

        dk, dv = lax.fori_loop(first, plan.q_seq_pad // bq, step, (dk, dv))
    dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _probabilities(plan: _Plan, q, k_blk, lse, mask):
    """softmax probabilities of a [bq, bk] tile, recomputed from the saved base-2 log-sum-exp."""
    p = jnp.exp2(plan.dot(q, k_blk, (1, 1)) * (plan.scale * LOG2E) - lse[:, None])
    return p if mask is None else jnp.where(mask, p, 0.0)
