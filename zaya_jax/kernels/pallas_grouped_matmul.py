"""Grouped matmul in Pallas (Triton lowering): the experts' matmuls over tokens sorted by expert.

`grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G])` multiplies each group's rows by its
own weight. The rows past the last group (ZAYA1's skip class sorts there) form a tail whose
output is zero. Work is a flat list of (group, row tile) items built in XLA from the group
sizes: a row tile that straddles a group boundary appears once per group it touches, and each
item stores only its own group's rows, so writes never overlap and empty groups cost nothing.
The transposed form `grouped_matmul_transposed(lhs, dout)` gives the weight gradient [G, K, N]
with one program per (group, K tile, N tile) walking that group's rows. A `custom_vjp` wires
them together: dlhs is the grouped matmul of dout with rhs transposed in place (no copy).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zaya_jax.kernels.tuning import GroupedMatmulBlocks, blocks_for


@dataclasses.dataclass(frozen=True)
class _Plan:
    blocks: GroupedMatmulBlocks
    interpret: bool
    out_dtype: jnp.dtype

    def params(self):
        return plgpu.CompilerParams(num_warps=self.blocks.num_warps, num_stages=self.blocks.num_stages)


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None, blocks=None, interpret=False):
    """Pallas grouped matmul; same contract as `kernels.reference.grouped_matmul`."""
    plan = _Plan(blocks or blocks_for("grouped_matmul", lhs.dtype), bool(interpret),
                 jnp.dtype(preferred_element_type or lhs.dtype))
    return _grouped(lhs, rhs, group_sizes.astype(jnp.int32), plan)


def grouped_matmul_transposed(lhs, dout, group_sizes, num_groups: int, *, preferred_element_type=None,
                              blocks=None, interpret=False):
    """Pallas weight-gradient form; same contract as `kernels.reference.grouped_matmul_transposed`."""
    plan = _Plan(blocks or blocks_for("grouped_matmul", lhs.dtype), bool(interpret),
                 jnp.dtype(preferred_element_type or lhs.dtype))
    return _transposed_call(lhs, dout.astype(lhs.dtype), group_sizes.astype(jnp.int32), num_groups, plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(lhs, rhs, group_sizes, plan):
    return _grouped_call(lhs, rhs, group_sizes, plan, transpose_rhs=False)


def _grouped_fwd(lhs, rhs, group_sizes, plan):
    return _grouped(lhs, rhs, group_sizes, plan), (lhs, rhs, group_sizes)


def _grouped_bwd(plan, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(lhs.dtype)
    dlhs = _grouped_call(dout, rhs, group_sizes, dataclasses.replace(plan, out_dtype=lhs.dtype), transpose_rhs=True)
    drhs = _transposed_call(lhs, dout, group_sizes, rhs.shape[0], dataclasses.replace(plan, out_dtype=rhs.dtype))
    return dlhs, drhs, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


# ---------------------------------------------------------------------------------------------
# Work list


def work_items(group_sizes, num_rows: int, block_m: int):
    """(group, row tile) per work item, int32 [W] each, plus each group's [start, end) rows.

    Groups are 0..G-1 and G, the tail of rows past the last group. Items past the real count
    get group -1 (do nothing). W = tiles + G is an upper bound: each of the G internal group
    boundaries can split one tile in two.
    """
    sizes = jnp.concatenate([group_sizes, (num_rows - jnp.sum(group_sizes))[None]]).astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_tile = starts // block_m
    tiles = jnp.where(sizes > 0, (ends - 1) // block_m - first_tile + 1, 0)
    tiles_end = jnp.cumsum(tiles)
    num_items = pl.cdiv(num_rows, block_m) + group_sizes.shape[0]
    item = jnp.arange(num_items, dtype=jnp.int32)
    # compare_all: one [W, G+1] comparison; the default binary search is a loop of small kernels
    # (five trips of several launches each, per grouped matmul on a GPU).
    group = jnp.searchsorted(tiles_end, item, side="right", method="compare_all").astype(jnp.int32)
    valid = item < tiles_end[-1]
    group_c = jnp.minimum(group, sizes.shape[0] - 1)
    tile = first_tile[group_c] + item - (tiles_end[group_c] - tiles[group_c])
    return jnp.where(valid, group, -1), jnp.where(valid, tile, 0), starts, ends


def _grouped_call(lhs, rhs, group_sizes, plan: _Plan, *, transpose_rhs: bool):
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn = plan.blocks.block_m, plan.blocks.block_n
    group, tile, starts, ends = work_items(group_sizes, m, bm)
    kernel = functools.partial(_grouped_kernel, plan=plan, transpose_rhs=transpose_rhs,
                               num_groups=rhs.shape[0], precision=_precision(lhs.dtype))
    return pl.pallas_call(
        kernel,
        grid=(group.shape[0], pl.cdiv(n, bn)),
        out_shape=jax.ShapeDtypeStruct((m, n), plan.out_dtype),
        compiler_params=plan.params(),
        interpret=plan.interpret,
        name="zaya_grouped_matmul",
    )(group, tile, starts, ends, lhs, rhs)


def _grouped_kernel(group_ref, tile_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *,
                    plan: _Plan, transpose_rhs: bool, num_groups: int, precision):
    bm, bk, bn = plan.blocks.block_m, plan.blocks.block_k, plan.blocks.block_n
    m, kdim = lhs_ref.shape
    n = out_ref.shape[1]
    item, col_tile = pl.program_id(0), pl.program_id(1)
    group, tile = group_ref[item], tile_ref[item]
    g = jnp.clip(group, 0, num_groups)  # num_groups = the tail: output zero
    rows = tile * bm + jnp.arange(bm)
    cols = col_tile * bn + jnp.arange(bn)
    row_ok = (rows >= starts_ref[g]) & (rows < ends_ref[g]) & (group >= 0)
    col_ok = cols < n
    w = jnp.minimum(g, num_groups - 1)

    def step(kk, acc):
        ks = kk * bk + jnp.arange(bk)
        k_ok = ks < kdim
        a = plgpu.load(lhs_ref.at[pl.ds(tile * bm, bm), pl.ds(kk * bk, bk)],
                       mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if transpose_rhs:
            b = plgpu.load(rhs_ref.at[w, pl.ds(col_tile * bn, bn), pl.ds(kk * bk, bk)],
                           mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            dims = (((1,), (1,)), ((), ()))
        else:
            b = plgpu.load(rhs_ref.at[w, pl.ds(kk * bk, bk), pl.ds(col_tile * bn, bn)],
                           mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)

    # Not jnp.where(valid, cdiv, 0): Pallas's Triton lowering gives a select of two literals the
    # predicate's type (i1), and Triton rejects an scf.for whose bounds differ in type.
    steps = ((group >= 0) & (group < num_groups)).astype(jnp.int32) * pl.cdiv(kdim, bk)
    acc = lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(out_ref.at[pl.ds(tile * bm, bm), pl.ds(col_tile * bn, bn)], acc.astype(out_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Transposed form (weight gradient)


def _transposed_call(lhs, dout, group_sizes, num_groups: int, plan: _Plan):
    m, kdim = lhs.shape
    n = dout.shape[1]
    bk, bn = plan.blocks.block_k, plan.blocks.block_n
    ends = jnp.cumsum(group_sizes).astype(jnp.int32)
    starts = ends - group_sizes
    kernel = functools.partial(_transposed_kernel, plan=plan, precision=_precision(lhs.dtype))
    return pl.pallas_call(
        kernel,
        grid=(num_groups, pl.cdiv(kdim, bk), pl.cdiv(n, bn)),
        out_shape=jax.ShapeDtypeStruct((num_groups, kdim, n), plan.out_dtype),
        compiler_params=plan.params(),
        interpret=plan.interpret,
        name="zaya_grouped_matmul_transposed",
    )(starts, ends, lhs, dout)


def _transposed_kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, plan: _Plan, precision):
    bm, bk, bn = plan.blocks.block_m, plan.blocks.block_k, plan.blocks.block_n
    kdim, n = lhs_ref.shape[1], dout_ref.shape[1]
    g, k_tile, col_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = starts_ref[g], ends_ref[g]
    ks = k_tile * bk + jnp.arange(bk)
    cols = col_tile * bn + jnp.arange(bn)
    k_ok, col_ok = ks < kdim, cols < n
    first = start // bm

    def step(t, acc):
        rows = (first + t) * bm + jnp.arange(bm)
        row_ok = (rows >= start) & (rows < end)
        a = plgpu.load(lhs_ref.at[pl.ds((first + t) * bm, bm), pl.ds(k_tile * bk, bk)],
                       mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = plgpu.load(dout_ref.at[pl.ds((first + t) * bm, bm), pl.ds(col_tile * bn, bn)],
                       mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        return acc + lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    steps = jnp.where(end > start, pl.cdiv(end, bm) - first, 0)
    acc = lax.fori_loop(0, steps, step, jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(out_ref.at[g, pl.ds(k_tile * bk, bk), pl.ds(col_tile * bn, bn)], acc.astype(out_ref.dtype),
                mask=k_ok[:, None] & col_ok[None, :])
