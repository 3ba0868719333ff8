"""Top-1 SwiGLU experts and the MoE layer (router + experts).

Tokens are sorted by their chosen expert, run through `zaya_jax.kernels.grouped_matmul` (the
`model.moe_kernel` backend), then unsorted: each expert computes only its own tokens. Skip-class
tokens sort to the end, past every group, where the grouped matmul outputs zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax import kernels
from zaya_jax.config import ModelConfig
from zaya_jax.model.params import make_param, normal
from zaya_jax.model.router import Router, Routing
from zaya_jax.parallel.batch_map import run_kernel


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = normal(cfg.initializer_range)
        self.gate = make_param(rngs, init, (e, h, i), ("experts", "embed", "mlp"))
        self.up = make_param(rngs, init, (e, h, i), ("experts", "embed", "mlp"))
        self.down = make_param(rngs, init, (e, i, h), ("experts", "mlp", "embed"))
        self.kernel = cfg.moe_kernel

    def __call__(self, x: jax.Array, routing: Routing) -> jax.Array:
        """x: [T, H]; returns weight · down(silu(gate x) ⊙ up x) per token, [T, H] in x's dtype."""
        dt = x.dtype
        weights = tuple(w[...].astype(dt) for w in (self.gate, self.up, self.down))
        return run_kernel("grouped_matmul", self.kernel, self._sorted_experts,
                          (x, routing.expert, routing.weight), weights)

    def _sorted_experts(self, x, expert, weight, gate_w, up_w, down_w):
        """Sort, grouped SwiGLU, unsort (on whatever rows this device holds)."""
        return by_expert(x, expert, weight, gate_w.shape[0],
                         lambda xs, sizes: grouped_swiglu(xs, sizes, gate_w, up_w, down_w, self.kernel))


def by_expert(x, expert, weight, num_experts: int, experts_fn):
    """Sort tokens by expert, `experts_fn(sorted x, group sizes)` → fp32 rows, unsort, scale by the
    router weight; [T, H] in x's dtype. Skip-class tokens sort past every group."""
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.bincount(expert, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    out = experts_fn(x[order], sizes) * weight[order][:, None]
    return jnp.zeros_like(out).at[order].set(out).astype(x.dtype)


def grouped_swiglu(xs, sizes, gate, up, down, backend):
    """down(silu(gate xs) ⊙ up xs) per expert group of the sorted rows xs, fp32 [T, H]; rows past
    the groups are 0. Also the per-slice step of the TSP experts ring (any slice of the width)."""

    def matmul(rows, w):
        return kernels.grouped_matmul(rows, w, sizes, preferred_element_type=jnp.float32, backend=backend)

    hidden = (jax.nn.silu(matmul(xs, gate)) * matmul(xs, up)).astype(xs.dtype)
    return matmul(hidden, down)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.router = Router(cfg, layer, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, prev_state: jax.Array | None) -> tuple[jax.Array, jax.Array, Routing]:
        """x: [B, S, H]; returns (output [B, S, H], router state [T, R] for EDA, routing)."""
        batch, seq, hidden = x.shape
        flat = x.reshape(batch * seq, hidden)
        routing, state = self.router(flat, prev_state)
        out = self.experts(flat, routing)
        return out.reshape(batch, seq, hidden), state, routing
