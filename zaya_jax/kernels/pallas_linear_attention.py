"""Causal linear attention in Pallas (Triton lowering): the chunked form of `linear_attention`
with the d_k × d_v memory state kept on chip across the whole sequence.

One program per (batch row, query head, block of `block_dv` value columns: output columns depend
only on their own value columns, so the state splits along d_v). It walks the sequence in blocks
of `block` tokens, carrying the fp32 state and the segment id of the document it holds:

    out_blk = (q kᵀ ⊙ λ^(i−j) ⊙ causal ⊙ same document) v + λ^(i+1) [token continues M's document] q M
    M      ← λ^block · M · [the block's last document is M's] + Σ_{s in that document} λ^(block−1−s) k_sᵀ v_s

The state starts as `initial_state` with document `initial_segment` (zeros: nothing before).
Operands may be bf16; products accumulate in fp32, and the state enters its products in the
operands' dtype (as flash-linear-attention's kernels do) so the matrix cores take them.

Backward, also Pallas, in two kernels over the same grid. dq walks forward, rebuilding the
states: dq = (dO vᵀ ⊙ weights) k + λ^(i+1)[continues] dO Mᵀ. dk/dv walk backward carrying G, the
gradient of the state leaving the block: dk_s = (dSᵀ q)_s + e_s v_s Gᵀ and dv_s = (Sᵀ dO)_s +
e_s k_s G with e_s = λ^(block−1−s)[s in the last document]; then G ← λ^block[...] G + qᵀ(λ^(i+1)
[continues] ⊙ dO), and the G left after block 0 is the gradient of `initial_state`. Each program
writes its query head's dk, dv (and its value columns' share of dq, dk): XLA sums those over a
KV group's heads and the d_v blocks, a few [B, S, nq, d] fp32 tensors in exchange for no atomics.
`log_decay` is a fixed decay here (no gradient flows to it), as in Lightning Attention.

Triton tiles are powers of two of at least 16: head dims must be multiples of 16 (others are
refused) and are zero-padded up to a power of two; the sequence is zero-padded to whole blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from zaya_jax.kernels.linear_attention import pad_rows
from zaya_jax.kernels.pallas_dot import fp32_dot, launch
from zaya_jax.kernels.tuning import LinearAttentionBlocks, blocks_for


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one call (hashable: it is a custom_vjp nondiff arg)."""

    groups: int  # query heads per KV head
    blocks: LinearAttentionBlocks
    interpret: bool
    precision: lax.Precision | None

    def dot(self, a, b, contract=(1, 0)):
        return fp32_dot(a, b, contract, self.precision)

    def call(self, kernel, grid, in_specs, args, out_specs, out_shape):
        name = f"zaya_linear_attention_{kernel.__name__.strip('_')}"
        return launch(kernel, self, name, grid, in_specs, args, out_specs, out_shape)


def check_head_dims(dk: int, dv: int) -> None:
    """ValueError unless both head dims are multiples of 16 (Triton's smallest dot tile)."""
    for name, dim in (("key/query head_dim", dk), ("value head_dim", dv)):
        if dim % 16:
            raise ValueError(f"the pallas linear_attention kernel needs a {name} that is a multiple of 16 "
                             f"(Triton's smallest dot tile), got {dim}: pad the heads to {-(-dim // 16) * 16} "
                             "or use backend='xla'")


def linear_attention(q, k, v, segment_ids=None, *, log_decay=None, initial_state=None, initial_segment=None,
                     blocks=None, interpret=False):
    """Pallas linear attention; same contract as `linear_attention.reference`."""
    batch, seq, nq, dk = q.shape
    nk, dv = k.shape[2], v.shape[3]
    check_head_dims(dk, dv)
    k, v = k.astype(q.dtype), v.astype(q.dtype)  # one operand dtype for every dot
    dk_pad, dv_pad = pl.next_power_of_2(dk), pl.next_power_of_2(dv)
    blocks = fit_blocks(blocks or blocks_for("linear_attention", q.dtype), seq, dv_pad)
    plan = _Plan(groups=nq // nk, blocks=blocks, interpret=bool(interpret),
                 precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    seq_pad = -(-seq // blocks.block) * blocks.block
    seg = jnp.zeros((batch, seq), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    owner = seg[:, 0] if initial_segment is None else initial_segment.astype(jnp.int32)
    if initial_state is None:
        state = jnp.zeros((batch, nq, dk_pad, dv_pad), jnp.float32)
    else:
        state = _pad_last(initial_state.astype(jnp.float32).reshape(batch, nq, dk, dv), (dk_pad, dv_pad))
    rates = jnp.zeros((nq,), jnp.float32) if log_decay is None else lax.stop_gradient(log_decay.astype(jnp.float32))
    q, k = (pad_rows(_pad_last(t, (dk_pad,)), seq_pad) for t in (q, k))
    v = pad_rows(_pad_last(v, (dv_pad,)), seq_pad)
    out = _linear_attention(q, k, v, pad_rows(seg, seq_pad, -1), rates, state, owner, plan)
    return out[:, :seq, :, :dv]


def _pad_last(x, sizes):
    """Zero-pad x's trailing dims up to `sizes` (zero key/value columns add nothing to any product)."""
    pad = [(0, 0)] * (x.ndim - len(sizes)) + [(0, s - d) for s, d in zip(sizes, x.shape[-len(sizes):])]
    return jnp.pad(x, pad) if any(p for _, p in pad) else x


def fit_blocks(blocks: LinearAttentionBlocks, seq: int, dv: int) -> LinearAttentionBlocks:
    """Shrink the blocks for short sequences and narrow values (never below 16, Triton's smallest dot tile)."""
    return dataclasses.replace(blocks, block=min(blocks.block, max(16, pl.next_power_of_2(seq))),
                               block_dv=min(blocks.block_dv, dv))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _linear_attention(q, k, v, seg, rates, state, owner, plan):
    return _forward(q, k, v, seg, rates, state, owner, plan)


def _linear_attention_fwd(q, k, v, seg, rates, state, owner, plan):
    return _forward(q, k, v, seg, rates, state, owner, plan), (q, k, v, seg, rates, state, owner)


def _linear_attention_bwd(plan, residuals, dout):
    q, k, v, seg, rates, state, owner = residuals
    batch, seq = q.shape[:2]
    nk, g = k.shape[2], plan.groups
    dq = _backward_dq(q, k, v, seg, rates, state, owner, dout, plan).sum(axis=0)
    dk_parts, dv_heads, dstate = _backward_dkv(q, k, v, seg, rates, state, owner, dout, plan)
    per_group = lambda x: x.reshape(batch, seq, nk, g, x.shape[-1]).sum(axis=3)  # noqa: E731 (a KV head's query heads)
    dk_out = per_group(dk_parts.sum(axis=0)).astype(k.dtype)
    dv_out = per_group(dv_heads).astype(v.dtype)
    return dq.astype(q.dtype), dk_out, dv_out, None, jnp.zeros_like(rates), dstate, None


_linear_attention.defvjp(_linear_attention_fwd, _linear_attention_bwd)


# ---------------------------------------------------------------------------------------------
# Specs and the per-block quantities every kernel shares


def _specs(plan: _Plan, q_shape):
    """BlockSpecs over the grid (batch, query head, value block): a head's whole sequence of q/k
    rows, of its value columns, the row's segment ids, the decay rates, its state block, the
    initial documents."""
    _, seq, nq, dk = q_shape
    bdv, g = plan.blocks.block_dv, plan.groups
    return {
        "q": pl.BlockSpec((None, seq, None, dk), lambda b, h, t: (b, 0, h, 0)),
        "k": pl.BlockSpec((None, seq, None, dk), lambda b, h, t: (b, 0, h // g, 0)),
        "v": pl.BlockSpec((None, seq, None, bdv), lambda b, h, t: (b, 0, h // g, t)),
        "o": pl.BlockSpec((None, seq, None, bdv), lambda b, h, t: (b, 0, h, t)),  # also dO and dv per head
        "seg": pl.BlockSpec((None, seq), lambda b, h, t: (b, 0)),
        "rates": pl.BlockSpec((nq,), lambda b, h, t: (0,)),
        "state": pl.BlockSpec((None, None, dk, bdv), lambda b, h, t: (b, h, 0, t)),
        "owner": pl.BlockSpec((q_shape[0],), lambda b, h, t: (0,)),
        "dq": pl.BlockSpec((None, None, seq, None, dk), lambda b, h, t: (t, b, 0, h, 0)),  # per value block
    }


def _grid(q_shape, plan: _Plan, dv: int):
    return (q_shape[0], q_shape[2], dv // plan.blocks.block_dv)


@dataclasses.dataclass(frozen=True)
class _Decay:
    """One head's λ powers over a block of C tokens, built once per program (the loop only masks
    them by document): λ^(i−j) for j ≤ i, λ^(i+1) from the block's start, λ^(C−1−s) to its end,
    and λ^C across it."""

    causal: jax.Array  # [C, C], 0 above the diagonal
    start_powers: jax.Array  # [C]
    end_powers: jax.Array  # [C]
    across: jax.Array  # scalar

    @classmethod
    def of(cls, rate, size: int):
        pos = jnp.arange(size)
        lag = pos[:, None] - pos[None, :]
        causal = jnp.where(lag >= 0, jnp.exp(rate * jnp.maximum(lag, 0).astype(jnp.float32)), 0.0)
        return cls(causal, jnp.exp(rate * (pos + 1).astype(jnp.float32)),
                   jnp.exp(rate * (size - 1 - pos).astype(jnp.float32)), jnp.exp(rate * size))

    def weights(self, seg):
        """[C, C] intra-block weights: λ^(i−j) where j ≤ i in the same document, else 0."""
        return jnp.where(seg[:, None] == seg[None, :], self.causal, 0.0)

    def from_start(self, seg, owner):
        """[C] λ^(i+1) for tokens of the state's document `owner`, else 0."""
        return jnp.where(seg == owner, self.start_powers, 0.0)

    def to_end(self, seg, last):
        """[C] λ^(C−1−s) for tokens of the block's last document `last`, else 0."""
        return jnp.where(seg == last, self.end_powers, 0.0)

    def carry(self, last, owner):
        """λ^C if the block's last document is the state's (no document starts in it), else 0."""
        return jnp.where(last == owner, self.across, 0.0)


def _block_segments(seg_ref, c, size: int):
    """(segment ids of block c's tokens, its last token's)."""
    return seg_ref[pl.ds(c * size, size)], seg_ref[c * size + size - 1]


def _advance(plan: _Plan, state, decay: _Decay, seg, last, owner, k, v):
    """The state leaving a block from the state entering it."""
    kw = (k * decay.to_end(seg, last)[:, None]).astype(k.dtype)
    return decay.carry(last, owner) * state + plan.dot(kw, v, (0, 0))


# ---------------------------------------------------------------------------------------------
# Forward


def _forward(q, k, v, seg, rates, state, owner, plan: _Plan):
    dv = v.shape[3]
    s = _specs(plan, q.shape)
    out_shape = jax.ShapeDtypeStruct(q.shape[:3] + (dv,), q.dtype)
    return plan.call(_fwd, _grid(q.shape, plan, dv), [s["q"], s["k"], s["v"], s["seg"], s["rates"], s["state"],
                                                       s["owner"]],
                     [q, k, v, seg, rates, state, owner], s["o"], out_shape)


def _fwd(q_ref, k_ref, v_ref, seg_ref, rate_ref, state_ref, owner_ref, o_ref, *, plan: _Plan):
    size = plan.blocks.block
    decay = _Decay.of(rate_ref[pl.program_id(1)], size)

    def step(c, carry):
        state, owner = carry
        rows = pl.ds(c * size, size)
        q, k, v = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :]
        seg, last = _block_segments(seg_ref, c, size)
        scores = plan.dot(q, k, (1, 1)) * decay.weights(seg)
        out = plan.dot(scores.astype(v.dtype), v)
        out += plan.dot(q, state.astype(q.dtype)) * decay.from_start(seg, owner)[:, None]
        o_ref[rows, :] = out.astype(o_ref.dtype)
        return _advance(plan, state, decay, seg, last, owner, k, v), last

    lax.fori_loop(0, q_ref.shape[0] // size, step, (state_ref[...], owner_ref[pl.program_id(0)]))


# ---------------------------------------------------------------------------------------------
# Backward


def _backward_dq(q, k, v, seg, rates, state, owner, dout, plan: _Plan):
    dv = v.shape[3]
    s = _specs(plan, q.shape)
    parts = dv // plan.blocks.block_dv
    return plan.call(_dq, _grid(q.shape, plan, dv), [s["k"], s["v"], s["o"], s["seg"], s["rates"], s["state"],
                                                      s["owner"]],
                     [k, v, dout, seg, rates, state, owner], s["dq"],
                     jax.ShapeDtypeStruct((parts,) + q.shape, jnp.float32))


def _dq(k_ref, v_ref, do_ref, seg_ref, rate_ref, state_ref, owner_ref, dq_ref, *, plan: _Plan):
    size = plan.blocks.block
    decay = _Decay.of(rate_ref[pl.program_id(1)], size)

    def step(c, carry):
        state, owner = carry
        rows = pl.ds(c * size, size)
        k, v, do = k_ref[rows, :], v_ref[rows, :], do_ref[rows, :]
        seg, last = _block_segments(seg_ref, c, size)
        dscores = plan.dot(do, v, (1, 1)) * decay.weights(seg)
        dq = plan.dot(dscores.astype(k.dtype), k)
        dq += plan.dot(do, state.astype(do.dtype), (1, 1)) * decay.from_start(seg, owner)[:, None]
        dq_ref[rows, :] = dq
        return _advance(plan, state, decay, seg, last, owner, k, v), last

    lax.fori_loop(0, k_ref.shape[0] // size, step, (state_ref[...], owner_ref[pl.program_id(0)]))


def _backward_dkv(q, k, v, seg, rates, state, owner, dout, plan: _Plan):
    dv = v.shape[3]
    s = _specs(plan, q.shape)
    parts = dv // plan.blocks.block_dv
    shapes = [jax.ShapeDtypeStruct((parts,) + q.shape[:3] + k.shape[3:], jnp.float32),  # dk per value block
              jax.ShapeDtypeStruct(q.shape[:3] + (dv,), jnp.float32),  # dv per query head
              jax.ShapeDtypeStruct(state.shape, jnp.float32)]
    return plan.call(_dkv, _grid(q.shape, plan, dv), [s["q"], s["k"], s["v"], s["o"], s["seg"], s["rates"],
                                                       s["owner"]],
                     [q, k, v, dout, seg, rates, owner], [s["dq"], s["o"], s["state"]], shapes)


def _dkv(q_ref, k_ref, v_ref, do_ref, seg_ref, rate_ref, owner_ref, dk_ref, dv_ref, dstate_ref, *, plan: _Plan):
    size = plan.blocks.block
    decay = _Decay.of(rate_ref[pl.program_id(1)], size)
    count = q_ref.shape[0] // size
    initial_owner = owner_ref[pl.program_id(0)]

    def step(i, grad):  # grad: the gradient of the state leaving block c
        c = count - 1 - i
        rows = pl.ds(c * size, size)
        q, k, v, do = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], do_ref[rows, :]
        # The state entering block c holds the previous block's last document (block 0: the initial one).
        owner = jnp.where(c > 0, seg_ref[jnp.maximum(c * size - 1, 0)], initial_owner)
        seg, last = _block_segments(seg_ref, c, size)
        weights = decay.weights(seg)
        scores = plan.dot(q, k, (1, 1)) * weights
        dscores = plan.dot(do, v, (1, 1)) * weights
        to_end = decay.to_end(seg, last)[:, None]
        dk_ref[rows, :] = plan.dot(dscores.astype(q.dtype), q, (0, 0)) + to_end * plan.dot(
            v, grad.astype(v.dtype), (1, 1))
        dv_ref[rows, :] = plan.dot(scores.astype(do.dtype), do, (0, 0)) + to_end * plan.dot(
            k, grad.astype(k.dtype))
        qw = (q * decay.from_start(seg, owner)[:, None]).astype(q.dtype)
        return decay.carry(last, owner) * grad + plan.dot(qw, do, (0, 0))

    dstate_ref[...] = lax.fori_loop(0, count, step, jnp.zeros(dstate_ref.shape, jnp.float32))
