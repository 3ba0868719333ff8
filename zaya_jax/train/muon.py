"""Muon: momentum, then Newton–Schulz orthogonalisation, scaled so its RMS matches AdamW's.

For a weight viewed as a matrix `[fan_in, fan_out]` (stacked experts are a batch of such
matrices, one per expert), the update is `NS5(m) · rms · sqrt(max(fan_in, fan_out))`: an
orthogonalised matrix has RMS `1/sqrt(max(fan_in, fan_out))`, so the factor gives every Muon
update the RMS `rms` (0.2, the typical AdamW update RMS, as in Moonlight) and lets Muon share
AdamW's learning rate and weight decay.

The iterations run in `ns_dtype`: bfloat16 products, as Keller Jordan's Muon, Moonlight and
`torch.optim.Muon` run them (the default on GPUs: `ns_dtype`), or float32 (the default on CPU, where
the trajectory comparison with PyTorch is exact). Each weight's matrices (every layer's, every
expert's) are one batch: one batched product per iteration for the whole stack.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zaya_jax.kernels.registry import GPU_TARGETS

# Quintic Newton–Schulz coefficients (Keller Jordan's Muon): fast growth of small singular
# values; the result has singular values in roughly [0.7, 1.2] rather than exactly 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def ns_dtype(name: str, target: str | None) -> str:
    """The dtype Newton–Schulz iterates in for the config's `name` on kernel target `target`."""
    if name != "auto":
        return name
    return "bfloat16" if target in GPU_TARGETS else "float32"


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """How an N-d weight reads as a batch of matrices: leading batch axes, then fan-in axes."""

    batch_axes: int = 0
    in_axes: int = 1

    def to_matrices(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        batch = shape[: self.batch_axes]
        fan_in = math.prod(shape[self.batch_axes: self.batch_axes + self.in_axes])
        return x.reshape(*batch, fan_in, -1)


def newton_schulz(g: jax.Array, steps: int = 5, eps: float = 1e-7, dtype=jnp.float32) -> jax.Array:
    """Approximately orthogonalise the last two dims of `g` (the polar factor U Vᵀ of its SVD),
    iterating in `dtype`; the result is in `dtype`.

    Each iteration is `x ← a·x + (b·A + c·A²)·x` with `A = x·xᵀ`. It runs on `y = x / s`, where the
    scalar `s` (a power of `a`) is known when tracing: with `G = y·yᵀ`,
    `P = G + (c·s²/b)·G·G` and `y ← y + (b·s²/a)·P·y`, `s ← a·s`. Every scalar is then a GEMM's alpha
    and every sum its addend, so a GPU runs an iteration as three GEMMs and no elementwise pass
    (cuBLASLt's alpha and bias); the rounding is that of torch's `addmm` form (`b·A + c·A·A` in one
    GEMM). In bf16 XLA holds the two alphas as bf16 constants: b and c move by up to 0.4% in an
    iteration (docs/kernels.md measures what that costs); `s` itself stays exact."""
    a, b, c = NS_COEFFICIENTS
    wide = g.shape[-2] <= g.shape[-1]
    x = g if wide else jnp.swapaxes(g, -1, -2)
    # The scope names these products in a profile and the census (tools/gpu_census.py).
    with jax.named_scope("newton_schulz"):
        # max(‖x‖, eps), not ‖x‖ + eps: the router's momenta have norms of 1e-6..1e-5, where an added
        # eps would shrink their update by up to 4% (torch.optim.Muon clamps the same way).
        x = x.astype(jnp.float32)
        y = (x / jnp.maximum(jnp.linalg.norm(x, axis=(-2, -1), keepdims=True), eps)).astype(dtype)
        s = 1.0
        for _ in range(steps):
            # Each iteration's own alphas: XLA merges equal constants, and a shared one is no alpha.
            gram = y @ jnp.swapaxes(y, -1, -2)  # the small side: [rows, rows]
            poly = gram + (c * s * s / b) * (gram @ gram)
            y = y + (b * s * s / a) * (poly @ y)
            s *= a
        x = (y.astype(jnp.float32) * s).astype(dtype)
    return x if wide else jnp.swapaxes(x, -1, -2)


def orthogonal_update(m: jax.Array, view: MatrixView, steps: int, rms: float, spread: Callable | None = None,
                      key: str | None = None, dtype: str = "float32") -> jax.Array:
    """The Muon direction of `m` (the weight `key`). `spread(fn, mats, key)` runs the Newton–Schulz
    iterations over the [*batch, fan_in, fan_out] matrices (the program's `parallel.muon_spread`:
    whole matrices spread over its devices, each orthogonalising its share a few at a time); None:
    all here at once. The iterations run in `dtype`."""
    # In the iterations' dtype from the start: the momentum's pass writes it so, the spread moves it so.
    mats = view.to_matrices(m.astype(dtype))
    scale = rms * math.sqrt(max(mats.shape[-2], mats.shape[-1]))
    orthogonalise = functools.partial(newton_schulz, steps=steps, dtype=jnp.dtype(dtype))
    out = orthogonalise(mats) if spread is None else spread(orthogonalise, mats, key)
    return (out.astype(jnp.float32) * scale).reshape(m.shape).astype(m.dtype)


class MuonState(NamedTuple):
    momentum: optax.Updates


def scale_by_muon(views: dict[str, MatrixView], momentum: float = 0.95, nesterov: bool = True,
                  ns_steps: int = 5, rms: float = 0.2, spread=None, dtype: str = "float32") -> optax.GradientTransformation:
    """Muon direction for a flat `{path: array}` tree; `views` gives each path's matrix view.

    Leaves that another transform owns (optax.multi_transform masks) are skipped by tree_map.
    """

    def init(params):
        return MuonState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        new_m = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g, state.momentum, updates)
        direction = (jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g, new_m, updates)
                     if nesterov else new_m)
        out = jax.tree_util.tree_map_with_path(
            lambda path, d: orthogonal_update(d, views[path[-1].key], ns_steps, rms, spread, path[-1].key, dtype),
            direction)
        return out, MuonState(new_m)

    return optax.GradientTransformation(init, update)
