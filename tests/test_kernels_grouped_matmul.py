"""Grouped matmul and its transposed (weight-gradient) form: every backend against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import assert_close, check_values_and_grads
from zaya_jax import kernels
from zaya_jax.kernels import reference, tiled_grouped_matmul
from zaya_jax.kernels.pallas_grouped_matmul import work_items
from zaya_jax.kernels.tuning import GroupedMatmulBlocks

CASES = [
    # rows, K, N, group sizes (sum ≤ rows; the rest is the zero tail)
    (64, 32, 32, [16, 16, 16, 16]),  # whole tiles, equal groups
    (37, 24, 40, [3, 0, 10, 20, 1]),  # an empty group, groups straddling tiles, a partial last tile
    (50, 20, 33, [0, 0, 45, 0]),  # one live group, empty first and last groups, a 5-row tail
    (20, 16, 16, [0, 0, 0]),  # every group empty: all output is the zero tail
    (45, 40, 24, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 29]),  # 17 groups, many one-row groups
]


def _inputs(rows, k, n, sizes, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    lhs = jax.random.normal(keys[0], (rows, k), dtype)
    rhs = jax.random.normal(keys[1], (len(sizes), k, n), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _check(backend, rows, k, n, sizes, dtype, out_dtype=None, blocks=None):
    lhs, rhs, group_sizes = _inputs(rows, k, n, sizes, dtype)

    def kernel(lhs, rhs):
        return kernels.grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=out_dtype, backend=backend,
                                      blocks=blocks)

    def ref(lhs, rhs):
        return reference.grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=out_dtype)

    what = f"{backend} grouped matmul {rows}x{k}x{n} sizes={sizes} {jnp.dtype(dtype).name}"
    check_values_and_grads(kernel, ref, (lhs, rhs), (0, 1), dtype, what)


@pytest.mark.parametrize("rows,k,n,sizes", CASES)
def test_pallas_fp32_matches_reference(rows, k, n, sizes):
    _check("pallas", rows, k, n, sizes, jnp.float32)


def test_pallas_bf16_with_fp32_output():
    # The experts' form: bf16 operands, fp32 accumulation and output.
    _check("pallas", 37, 24, 40, [3, 0, 10, 20, 1], jnp.bfloat16, out_dtype=jnp.float32)
    _check("pallas", 37, 24, 40, [3, 0, 10, 20, 1], jnp.bfloat16)


def test_pallas_blocks_are_parameters():
    _check("pallas", 37, 24, 40, [3, 0, 10, 20, 1], jnp.float32,
           blocks=GroupedMatmulBlocks(block_m=32, block_k=8, block_n=16))


@pytest.mark.parametrize("rows,k,n,sizes", CASES[1:3])
def test_xla_backend_matches_reference(rows, k, n, sizes):
    _check("xla", rows, k, n, sizes, jnp.float32)


@pytest.mark.parametrize("rows,k,n,sizes", CASES)
def test_tiled_backend_matches_reference(rows, k, n, sizes):
    _check("tiled", rows, k, n, sizes, jnp.float32)


def test_tiled_bf16_with_fp32_output():
    _check("tiled", 37, 24, 40, [3, 0, 10, 20, 1], jnp.bfloat16, out_dtype=jnp.float32)


def test_tiled_backend_does_each_groups_work_once():
    # XLA's CPU ragged_dot multiplies every row by every group's weight; the tiled form pads each
    # group to whole tiles, so its multiply-adds stay within (M + G·tile)·K·N (+ the one-hot weight pick).
    rows, k, n, groups = 2048, 64, 64, 4
    lhs, rhs = jnp.ones((rows, k)), jnp.ones((groups, k, n))
    sizes = jnp.asarray([500, 600, 400, 300], jnp.int32)
    tile = tiled_grouped_matmul.tile_rows(rows, groups)
    tiles = -(-rows // tile) + groups

    def flops(backend):
        fn = jax.jit(lambda a, b, g: kernels.grouped_matmul(a, b, g, backend=backend))
        cost = fn.lower(lhs, rhs, sizes).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    bound = 2 * (rows + groups * tile) * k * n + 2 * tiles * groups * k * n
    assert flops("tiled") <= 1.05 * bound, (flops("tiled"), bound)


@pytest.mark.parametrize("rows,groups,tile", [(2048, 4, 128), (2048, 16, 32), (64, 4, 8), (100000, 2, 128), (5, 1, 8)])
def test_tiled_tile_rows(rows, groups, tile):
    assert tiled_grouped_matmul.tile_rows(rows, groups) == tile


@pytest.mark.parametrize("backend", ["pallas", "xla", "tiled"])
@pytest.mark.parametrize("rows,k,n,sizes", [CASES[1], CASES[4]])
def test_transposed_form_matches_reference(backend, rows, k, n, sizes):
    lhs, _, group_sizes = _inputs(rows, k, n, sizes, jnp.float32)
    dout = jax.random.normal(jax.random.PRNGKey(5), (rows, n), jnp.float32)
    out = kernels.grouped_matmul_transposed(lhs, dout, group_sizes, backend=backend)
    ref = reference.grouped_matmul_transposed(lhs, dout, group_sizes, len(sizes))
    assert out.shape == (len(sizes), k, n)
    assert_close(out, ref, jnp.float32, f"{backend} transposed grouped matmul sizes={sizes}")
    empty = np.flatnonzero(np.asarray(sizes) == 0)
    assert not np.any(np.asarray(out)[empty]), "empty groups must get a zero weight gradient"


@pytest.mark.parametrize("seed", range(20))
def test_work_items_cover_every_row_once(seed):
    rng = np.random.default_rng(seed)
    groups, rows, block = int(rng.integers(1, 9)), int(rng.integers(1, 100)), int(rng.choice([4, 8, 16]))
    cuts = np.sort(rng.integers(0, rows + 1, groups))
    sizes = np.diff(np.concatenate([[0], cuts])).astype(np.int32)  # sum ≤ rows; the rest is the tail
    group, tile, starts, ends = (np.asarray(a) for a in work_items(jnp.asarray(sizes), rows, block))
    owner = np.full(rows, -1)
    for g, t in zip(group, tile):
        if g < 0:
            continue
        for r in range(t * block, min((t + 1) * block, rows)):
            if starts[g] <= r < ends[g]:
                assert owner[r] == -1, f"row {r} written twice"
                owner[r] = g
    np.testing.assert_array_equal(owner, np.asarray(reference.row_groups(jnp.asarray(sizes), rows)))


def test_bad_shapes_are_named():
    lhs, rhs, sizes = _inputs(8, 4, 4, [4, 4], jnp.float32)
    with pytest.raises(ValueError, match="group_sizes must be integer"):
        kernels.grouped_matmul(lhs, rhs, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="lhs must be"):
        kernels.grouped_matmul(lhs[:, :3], rhs, sizes)
