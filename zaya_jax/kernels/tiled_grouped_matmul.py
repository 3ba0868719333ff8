"""The `tiled` grouped matmul: rows regrouped into tiles of one group each, then one batched matmul.

XLA's `ragged_dot` has no grouped GEMM on CPU: it expands to a masked dense product that multiplies
every row by every group's weight, G times the work (4x at `tiny_cpu`'s 4 experts, 16x at ZAYA1's).
This backend does what the Pallas kernel does, in plain XLA ops: each group's rows are padded to a
whole number of `tile`-row tiles (MegaBlocks' layout), so a tile belongs to one group; the tiles
are gathered [T, tile, K], each meets its group's weight in one batched matmul
`[T, tile, K] x [T, K, N]`, and the rows are gathered back. The work is at most
`(M + G·tile)·K·N` multiply-adds, and every index map is a gather (no scatter).

The backward is written out (a `custom_vjp`): the input gradient is the same tiled product with
the weights transposed, and the weight gradient the per-tile `lhsᵀ·dout` summed over each group's
tiles (sorted, so a segment sum), `grouped_matmul_transposed`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zaya_jax.kernels import reference


class Tiles(NamedTuple):
    """Where each tile's rows come from: `rows` int32 [T, tile] (source row, clipped), `live` bool
    [T, tile] (a real row of the tile's group), `group` int32 [T] (clipped to G-1 for empty tiles),
    and `slot` int32 [M], each source row's position in the flattened tiles (rows past the groups: 0,
    masked by `row_live`)."""

    rows: jax.Array
    live: jax.Array
    group: jax.Array
    slot: jax.Array
    row_live: jax.Array


def tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile: a power of two between 8 and 128, about M / (4·G), so the padding (under one
    tile per group) costs at most ~1/4 more work (~1/8 on average) while the tiles stay few and
    large enough for an efficient matmul (at `tiny_cpu`'s 2048 x 4 groups, 128 beat 64)."""
    target = max(8, num_rows // (4 * max(num_groups, 1)))
    return min(128, 1 << (target.bit_length() - 1))


def tiles(group_sizes: jax.Array, num_rows: int, tile: int) -> Tiles:
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    padded = -(-sizes // tile) * tile
    starts, padded_ends = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    count = -(-num_rows // tile) + groups  # static bound on sum(ceil(size / tile))
    first = jnp.arange(count, dtype=jnp.int32) * tile
    group = jnp.searchsorted(padded_ends, first, side="right", method="compare_all").astype(jnp.int32)
    group = jnp.minimum(group, groups - 1)
    local = first[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :] - padded_starts[group][:, None]
    live = (local >= 0) & (local < sizes[group][:, None])
    rows = jnp.clip(starts[group][:, None] + local, 0, num_rows - 1)
    row_group = reference.row_groups(sizes, num_rows)  # G past the groups
    row_live = row_group < groups
    row_group = jnp.minimum(row_group, groups - 1)
    row = jnp.arange(num_rows, dtype=jnp.int32)
    slot = jnp.where(row_live, padded_starts[row_group] + row - starts[row_group], 0)
    return Tiles(rows, live, group, slot, row_live)


def _gather_tiles(x, t: Tiles):
    """[M, K] → [T, tile, K], zero where a tile has no row."""
    return jnp.where(t.live[..., None], x[t.rows], jnp.zeros((), x.dtype))


def _tile_weights(rhs, t: Tiles):
    """[T, K, N]: each tile's group's weight, as a one-hot product (a GEMM: XLA's CPU gather of
    whole weight matrices runs far below memory speed)."""
    onehot = (t.group[:, None] == jnp.arange(rhs.shape[0])[None, :]).astype(rhs.dtype)
    return jnp.einsum("tg,gkn->tkn", onehot, rhs)


def _tiled_product(lhs, rhs, t: Tiles):
    """fp32 [M, N]: each row times its group's rhs [G, K, N]; rows past the groups are 0."""
    out = jnp.einsum("tmk,tkn->tmn", _gather_tiles(lhs, t), _tile_weights(rhs, t), preferred_element_type=jnp.float32)
    out = out.reshape(-1, out.shape[-1])[t.slot]
    return jnp.where(t.row_live[:, None], out, 0.0)


def _tiled_weight_grad(lhs, dout, t: Tiles, num_groups: int):
    """fp32 [G, K, N]: Σ over each group's rows of lhs_rᵀ dout_r."""
    per_tile = jnp.einsum("tmk,tmn->tkn", _gather_tiles(lhs, t), _gather_tiles(dout, t),
                          preferred_element_type=jnp.float32)
    return jax.ops.segment_sum(per_tile, t.group, num_segments=num_groups, indices_are_sorted=True)


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """`reference.grouped_matmul`, tiled: lhs [M, K] sorted by group, rhs [G, K, N] → [M, N]."""
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    tile = tile_rows(lhs.shape[0], rhs.shape[0])
    return _gmm(tile, out_dtype, lhs, rhs, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gmm(tile, out_dtype, lhs, rhs, group_sizes):
    return _tiled_product(lhs, rhs, tiles(group_sizes, lhs.shape[0], tile)).astype(out_dtype)


def _gmm_fwd(tile, out_dtype, lhs, rhs, group_sizes):
    t = tiles(group_sizes, lhs.shape[0], tile)
    return _tiled_product(lhs, rhs, t).astype(out_dtype), (lhs, rhs, t)


def _gmm_bwd(tile, out_dtype, residuals, dout):
    lhs, rhs, t = residuals
    dout = dout.astype(lhs.dtype)  # as the Pallas backward: the backward GEMMs take the operands' dtype
    dlhs = _tiled_product(dout, jnp.swapaxes(rhs, 1, 2), t).astype(lhs.dtype)
    drhs = _tiled_weight_grad(lhs, dout, t, rhs.shape[0]).astype(rhs.dtype)
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul_transposed(lhs, dout, group_sizes, num_groups: int, *, preferred_element_type=None):
    """`reference.grouped_matmul_transposed`, tiled: [G, K, N] with out[g] = lhs[rows of g]ᵀ dout[rows of g]."""
    out_dtype = preferred_element_type or lhs.dtype
    t = tiles(group_sizes, lhs.shape[0], tile_rows(lhs.shape[0], num_groups))
    return _tiled_weight_grad(lhs, dout.astype(lhs.dtype), t, num_groups).astype(out_dtype)
