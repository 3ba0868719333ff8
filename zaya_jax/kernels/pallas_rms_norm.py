"""Fused RMSNorm in Pallas (Triton lowering): one pass forward, one pass backward, fp32 statistics.

Each program owns `block_rows` rows and the whole feature width (padded to a power of two and
masked, as Triton tiles must be). The forward writes only y; the backward recomputes 1/rms from
x (cheaper than storing it) and writes dx plus one partial weight gradient per program, which
XLA sums.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zaya_jax.kernels.tuning import RmsNormBlocks, blocks_for


@dataclasses.dataclass(frozen=True)
class _Plan:
    eps: float
    out_dtype: jnp.dtype
    blocks: RmsNormBlocks
    interpret: bool

    def call(self, kernel, grid, out_shape, *args):
        return pl.pallas_call(
            functools.partial(kernel, plan=self), grid=grid, out_shape=out_shape,
            compiler_params=plgpu.CompilerParams(num_warps=self.blocks.num_warps),
            interpret=self.interpret, name=f"zaya_{kernel.__name__.strip('_')}",
        )(*args)


def rms_norm(x, weight, *, eps, out_dtype=None, blocks=None, interpret=False):
    """Pallas RMSNorm over the last axis; same contract as `kernels.reference.rms_norm`."""
    plan = _Plan(float(eps), jnp.dtype(out_dtype or x.dtype), blocks or blocks_for("rms_norm", x.dtype),
                 bool(interpret))
    flat = x.reshape(-1, x.shape[-1])
    return _norm(flat, weight, plan).reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _norm(x, weight, plan):
    rows, width = x.shape
    grid = (pl.cdiv(rows, plan.blocks.block_rows),)
    return plan.call(_rms_norm_fwd, grid, jax.ShapeDtypeStruct((rows, width), plan.out_dtype), x, weight)


def _norm_fwd(x, weight, plan):
    return _norm(x, weight, plan), (x, weight)


def _norm_bwd(plan, residuals, dy):
    x, weight = residuals
    rows, width = x.shape
    grid = (pl.cdiv(rows, plan.blocks.block_rows),)
    dx, dw_parts = plan.call(
        _rms_norm_bwd, grid,
        [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((grid[0], width), jnp.float32)],
        x, weight, dy)
    return dx, jnp.sum(dw_parts, axis=0).astype(weight.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


def _tile(plan: _Plan, ref):
    """This program's rows: the [block_rows, width_pow2] tile's ref view, its mask and its column mask.

    The column mask is built on its own, not cut from the tile mask: Triton has no `slice`.
    """
    rows, width = ref.shape
    br = plan.blocks.block_rows
    r = pl.program_id(0) * br + jnp.arange(br)
    c = jnp.arange(pl.next_power_of_2(width))
    cols = c < width
    mask = (r < rows)[:, None] & cols[None, :]
    return ref.at[pl.ds(pl.program_id(0) * br, br), pl.ds(0, c.shape[0])], mask, cols


def _normalise(plan: _Plan, x_ref, w_ref):
    """(x̂, 1/rms, w, mask, column mask) in fp32 for this program's rows."""
    width = x_ref.shape[1]
    view, mask, cols = _tile(plan, x_ref)
    x = plgpu.load(view, mask=mask, other=0.0).astype(jnp.float32)
    w = plgpu.load(w_ref.at[pl.ds(0, cols.shape[0])], mask=cols, other=0.0).astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / width + plan.eps)
    return x * inv_rms[:, None], inv_rms, w, mask, cols


def _rms_norm_fwd(x_ref, w_ref, y_ref, *, plan: _Plan):
    xhat, _, w, mask, _ = _normalise(plan, x_ref, w_ref)
    plgpu.store(_tile(plan, y_ref)[0], (xhat * w[None, :]).astype(y_ref.dtype), mask=mask)


def _rms_norm_bwd(x_ref, w_ref, dy_ref, dx_ref, dw_ref, *, plan: _Plan):
    width = x_ref.shape[1]
    xhat, inv_rms, w, mask, cols = _normalise(plan, x_ref, w_ref)
    dy = plgpu.load(_tile(plan, dy_ref)[0], mask=mask, other=0.0).astype(jnp.float32)
    wdy = w[None, :] * dy
    # d/dx of x·r·w with r = (mean x² + eps)^-1/2: r·(w·dy − x̂·mean(w·dy·x̂)).
    dx = inv_rms[:, None] * (wdy - xhat * (jnp.sum(wdy * xhat, axis=1) / width)[:, None])
    plgpu.store(_tile(plan, dx_ref)[0], dx.astype(dx_ref.dtype), mask=mask)
    plgpu.store(dw_ref.at[pl.program_id(0), pl.ds(0, cols.shape[0])], jnp.sum(dy * xhat, axis=0), mask=cols)
