"""Fused RMSNorm in Pallas (Triton lowering): one pass forward, one pass backward, fp32 statistics.

Each program owns `block_rows` rows (the last program's masked) and the whole feature width. A
Triton tile's sides are powers of two, so a width that is not one is zero-padded to the next
before the kernel and cut after it (zeros add nothing to Σx², and the mean divides by the true
width); JAX refuses a static slice of a ref past its end, so the tile cannot hang over the edge.
The forward writes only y; the backward recomputes 1/rms from x (cheaper than storing it) and
writes dx plus one partial weight gradient per program, which XLA sums.
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
    width: int  # the features' true width: the mean's divisor (the arrays may be padded past it)
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
    width = x.shape[-1]
    plan = _Plan(width, float(eps), jnp.dtype(out_dtype or x.dtype), blocks or blocks_for("rms_norm", x.dtype),
                 bool(interpret))
    return _norm(x.reshape(-1, width), weight, plan).reshape(x.shape)


def _padded(plan: _Plan, *arrays):
    """`arrays` with their last axis zero-padded from the true width to the tile's power of two.
    Inside the custom VJP's rules, so differentiation never sees (or re-stages) the padding."""
    pad = pl.next_power_of_2(plan.width) - plan.width
    if not pad:
        return arrays
    return tuple(jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) for a in arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _norm(x, weight, plan):
    x_p, w_p = _padded(plan, x, weight)
    rows, width = x_p.shape
    grid = (pl.cdiv(rows, plan.blocks.block_rows),)
    y = plan.call(_rms_norm_fwd, grid, jax.ShapeDtypeStruct((rows, width), plan.out_dtype), x_p, w_p)
    return y[:, :plan.width]


def _norm_fwd(x, weight, plan):
    return _norm(x, weight, plan), (x, weight)


def _norm_bwd(plan, residuals, dy):
    x, weight, dy = _padded(plan, *residuals, dy)
    rows, width = x.shape
    grid = (pl.cdiv(rows, plan.blocks.block_rows),)
    dx, dw_parts = plan.call(
        _rms_norm_bwd, grid,
        [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((grid[0], width), jnp.float32)],
        x, weight, dy)
    return dx[:, :plan.width], jnp.sum(dw_parts, axis=0)[:plan.width].astype(weight.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


def _tile(plan: _Plan, ref):
    """This program's rows: the [block_rows, width] tile's ref view and its row mask."""
    rows = ref.shape[0]
    br = plan.blocks.block_rows
    r = pl.program_id(0) * br + jnp.arange(br)
    return ref.at[pl.ds(pl.program_id(0) * br, br)], (r < rows)[:, None]


def _normalise(plan: _Plan, x_ref, w_ref):
    """(x̂, 1/rms, w, mask) in fp32 for this program's rows."""
    view, mask = _tile(plan, x_ref)
    x = plgpu.load(view, mask=mask, other=0.0).astype(jnp.float32)
    w = w_ref[...].astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / plan.width + plan.eps)
    return x * inv_rms[:, None], inv_rms, w, mask


def _rms_norm_fwd(x_ref, w_ref, y_ref, *, plan: _Plan):
    xhat, _, w, mask = _normalise(plan, x_ref, w_ref)
    plgpu.store(_tile(plan, y_ref)[0], (xhat * w[None, :]).astype(y_ref.dtype), mask=mask)


def _rms_norm_bwd(x_ref, w_ref, dy_ref, dx_ref, dw_ref, *, plan: _Plan):
    xhat, inv_rms, w, mask = _normalise(plan, x_ref, w_ref)
    dy = plgpu.load(_tile(plan, dy_ref)[0], mask=mask, other=0.0).astype(jnp.float32)
    wdy = w[None, :] * dy
    # d/dx of x·r·w with r = (mean x² + eps)^-1/2: r·(w·dy − x̂·mean(w·dy·x̂)).
    dx = inv_rms[:, None] * (wdy - xhat * (jnp.sum(wdy * xhat, axis=1) / plan.width)[:, None])
    plgpu.store(_tile(plan, dx_ref)[0], dx.astype(dx_ref.dtype), mask=mask)
    plgpu.store(dw_ref.at[pl.program_id(0), pl.ds(0, dw_ref.shape[1])], jnp.sum(dy * xhat, axis=0))
