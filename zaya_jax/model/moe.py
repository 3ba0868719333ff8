"""Top-1 SwiGLU experts and the MoE layer (router + experts).

Tokens are sorted by their chosen expert, run through `zaya_jax.kernels.grouped_matmul` (the
`model.moe_kernel` backend), then unsorted: each expert computes only its own tokens. Gate and up
run as one grouped matmul against the two weights side by side ([E, H, 2·I]), then down: two
grouped matmuls each way, not three. Skip-class
tokens sort to the end, past every group, where the grouped matmul outputs zero. On a mesh with
expert, TSP or tensor parallelism the `Schedule` the program hands the model runs the same math
per device in the schedule of `parallel/experts_schedule.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zaya_jax import kernels
from zaya_jax.config import ModelConfig
from zaya_jax.model.params import make_param, normal
from zaya_jax.model.remat import without_weight_copies
from zaya_jax.model.router import Router, Routing
from zaya_jax.model.schedule import LOCAL, Schedule


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = normal(cfg.initializer_range)
        # Read only in the compute dtype: the layer stack casts all layers' at once (`params.in_compute_dtype`).
        self.gate = make_param(rngs, init, (e, h, i), ("experts", "embed", "mlp"), read_in_compute_dtype=True)
        self.up = make_param(rngs, init, (e, h, i), ("experts", "embed", "mlp"), read_in_compute_dtype=True)
        self.down = make_param(rngs, init, (e, i, h), ("experts", "mlp", "embed"), read_in_compute_dtype=True)
        self.kernel = cfg.moe_kernel

    def __call__(self, x: jax.Array, routing: Routing, schedule: Schedule = LOCAL) -> jax.Array:
        """x: [B, S, H]; returns weight · down(silu(gate x) ⊙ up x) per token, [B, S, H] in x's dtype."""
        run = without_weight_copies(functools.partial(self._run, schedule=schedule))
        return run(x, routing, self.gate[...], self.up[...], self.down[...])

    def _run(self, x, routing, gate, up, down, *, schedule: Schedule):
        gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
        out = schedule.experts(x, routing, gate, up, down, self.kernel)
        if out is not None:
            return out
        batch, length, hidden = x.shape
        out = by_expert(x.reshape(-1, hidden), routing.expert.reshape(-1), routing.weight.reshape(-1),
                        gate.shape[0], lambda xs, sizes: grouped_swiglu(xs, sizes, gate, up, down, self.kernel))
        return out.reshape(batch, length, hidden)


def by_expert(x, expert, weight, num_experts: int, experts_fn):
    """Sort tokens by expert, `experts_fn(sorted x, group sizes)` → fp32 rows, unsort, scale by the
    router weight; [T, H] in x's dtype. Skip-class tokens sort past every group."""
    with jax.named_scope("dispatch"):
        order = jnp.argsort(expert, stable=True)
        sizes = jnp.bincount(expert, length=num_experts + 1)[:num_experts].astype(jnp.int32)
        rows = checkpoint_name(x[order], "moe_dispatch")
    out = experts_fn(rows, sizes) * weight[order][:, None]
    with jax.named_scope("combine"):  # a gather back, whose backward keeps only the indices
        back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        return out[back].astype(x.dtype)


def grouped_swiglu(xs, sizes, gate, up, down, backend):
    """down(silu(gate xs) ⊙ up xs) per expert group of the sorted rows xs, fp32 [T, H]; rows past
    the groups are 0. gate, up [E, H, I], down [E, I, H]."""
    return fused_swiglu(xs, sizes, fuse_gate_up(gate, up), down, backend)


def fuse_gate_up(gate, up):
    """gate and up side by side, [E, H, 2·I]: one grouped matmul for both. Fused here, where each
    device holds matching gate and up columns (tensor, TSP), not in the stored weight, so Muon keeps
    orthogonalising gate and up as the separate matrices they are. The backward makes it again
    rather than keep it (`remat.without_weight_copies`)."""
    return jnp.concatenate([gate, up], axis=-1)


def fused_swiglu(xs, sizes, gate_up, down, backend):
    """`grouped_swiglu` with gate and up fused (`fuse_gate_up`): also the per-slice step of the TSP
    experts ring, which circulates the fused slice (any slice of the width, gate's and up's alike)."""

    def matmul(rows, w, name):  # named for the `moe` remat policy (model/remat.py)
        out = kernels.grouped_matmul(rows, w, sizes, preferred_element_type=jnp.float32, backend=backend)
        return checkpoint_name(out, name)

    hidden = swiglu(matmul(xs, gate_up, "moe_gate_up")).astype(xs.dtype)
    return matmul(hidden, down, "moe_down")


@jax.custom_vjp
def swiglu(gate_up):
    """silu(gate) ⊙ up of fused [T, 2·I] rows. Its backward keeps only the rows: autodiff would keep
    the halves, the sigmoid and the silu besides (about twice the rows' bytes). Written out rather
    than a checkpoint, which XLA:CPU left 22 MiB more without remat on `test_remat_memory`'s step
    (the same under the remat policies)."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate_up):
    return swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up, dout):
    gate, up = jnp.split(gate_up, 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    dgate = dout * up * sig * (1 + gate * (1 - sig))
    return (jnp.concatenate([dgate, dout * gate * sig], axis=-1).astype(gate_up.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.router = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, prev_state: jax.Array | None,
                 schedule: Schedule = LOCAL) -> tuple[jax.Array, jax.Array, Routing]:
        """x: [B, S, H]; returns (output [B, S, H], router state [B, S, R] for EDA, routing [B, S])."""
        with jax.named_scope("router"):
            routing, state = self.router(x, prev_state, schedule)
        with jax.named_scope("experts"):
            return self.experts(x, routing, schedule), state, routing
