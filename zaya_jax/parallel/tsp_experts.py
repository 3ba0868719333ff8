"""TSP experts: top-1 SwiGLU experts whose weight slices circulate in a ring over the `tsp` axis.

Inside `shard_map` over `tsp` (size D), each rank holds its own tokens and, for every expert,
one slice of the intermediate dimension: gate/up `[E, H, I/D]`, down `[E, I/D, H]`. SwiGLU is
elementwise over the intermediate dimension, so the output is the sum over slices of
`down_s(silu(gate_s x) ⊙ up_s x)`. The forward applies the slice it holds to its tokens, passes
the slice on with `ppermute` and takes the next, D times: no all-reduce, and two slices are
resident at a time (the one in use and the one arriving). The steps are a loop, not D unrolled
copies: unrolled, the hops depend only on each other and XLA's scheduler runs them all first,
holding every step's slice at once. Every step is the loop's, the last one too, whose hop brings
the slices home unused: a last step written after the loop would be a second copy of the step's
buffers, and XLA's scheduler makes its loop-invariant part (on XLA:CPU the grouped matmul's masked
copies of the tokens) before the loop and holds it through it (a drawn shape under `tsp 8`: 37.3 →
28.2 MiB a device). The extra hop overlaps the last step's product, as every hop does its step's.
At D = 2 the two steps are unrolled instead: one hop is in flight either way, and XLA drops the
unused one (`slice_hops`). Gate and up travel fused, one buffer per slice.

The backward (`custom_vjp`) runs the ring again: each rank recomputes its tokens' activations
for the slice it holds, adds that slice's weight-gradient partial to an accumulator that travels
with the slice, and after D hops every accumulator is home with its owner. Nothing of the ring
is saved from the forward but the tokens and the rank's own slices.

This module owns the schedule only; the per-slice math is `model.moe.fused_swiglu`
(with the `pallas` backend, call it under `shard_map(..., check_vma=False)`: Pallas output
shapes carry no varying-axes annotation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zaya_jax.model import moe as moe_math


def ring_experts(xs, group_sizes, gate, up, down, *, axis: str, backend: str | None = None):
    """Σ over the ring of down_s(silu(gate_s xs) ⊙ up_s xs), fp32 [T, H]; call inside shard_map.

    xs: this rank's tokens sorted by expert [T, H]; group_sizes: int32 [E] (rows past them are
    skipped and output 0); gate/up: this rank's slices [E, H, I/D]; down: [E, I/D, H].
    """
    return _ring(xs, group_sizes, gate, up, down, axis, backend)


def _pass_on(tree, axis: str):
    """Send to the next rank on the ring, receive from the previous one."""
    size = jax.lax.axis_size(axis)
    return jax.lax.ppermute(tree, axis, [(i, (i + 1) % size) for i in range(size)])


UNROLLED = 2  # a ring this long runs its steps unrolled: one hop is in flight at a time anyway


def slice_hops(size: int) -> int:
    """Hops the slices make in one pass round a ring of `size` ranks: one a step, but where the
    steps are unrolled XLA drops the last one, whose result nothing reads (the explorer's count)."""
    return size - 1 if size == UNROLLED else size


def _round_the_ring(step, carry, axis: str):
    """D steps, each with its hop; unrolled at `UNROLLED` ranks (XLA then makes the steps' shared
    work once and drops the unused last hop)."""
    size = jax.lax.axis_size(axis)
    return jax.lax.fori_loop(0, size, step, carry, unroll=size == UNROLLED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(xs, group_sizes, gate, up, down, axis, backend):
    def apply(out, held):
        return out + moe_math.fused_swiglu(xs, group_sizes, *held, backend)

    def step(_, carry):  # this slice's product; the hop is independent of it: they overlap
        out, held = carry
        return apply(out, held), _pass_on(held, axis)

    held = (moe_math.fuse_gate_up(gate, up), down)  # fused once: no copy of gate and up per step
    out = jnp.zeros((xs.shape[0], down.shape[-1]), jnp.float32)
    out, _ = _round_the_ring(step, (out, held), axis)
    return out


def _ring_fwd(xs, group_sizes, gate, up, down, axis, backend):
    return _ring(xs, group_sizes, gate, up, down, axis, backend), (xs, group_sizes, gate, up, down)


def _ring_bwd(axis, backend, residuals, dout):
    xs, group_sizes, gate, up, down = residuals

    def apply(dxs, held, grads):  # this slice's input gradient, and its weight gradient's partial
        _, pullback = jax.vjp(lambda x, gu, d: moe_math.fused_swiglu(x, group_sizes, gu, d, backend), xs, *held)
        dx, *dw = pullback(dout)
        return dxs + dx.astype(jnp.float32), jax.tree.map(jnp.add, grads, tuple(dw))

    def step(_, carry):
        dxs, held, grads = carry
        dxs, grads = apply(dxs, held, grads)
        return dxs, _pass_on(held, axis), _pass_on(grads, axis)

    held = (moe_math.fuse_gate_up(gate, up), down)
    grads = jax.tree.map(jnp.zeros_like, held)  # travels with the slice it belongs to
    dxs = jnp.zeros(xs.shape, jnp.float32)
    dxs, _, (gate_up, down) = _round_the_ring(step, (dxs, held, grads), axis)  # each accumulator ends home
    return (dxs.astype(xs.dtype), None, *jnp.split(gate_up, 2, axis=-1), down)


_ring.defvjp(_ring_fwd, _ring_bwd)
