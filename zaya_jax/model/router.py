"""The ZAYA1 router: down-projection, EDA depth averaging, RMSNorm + 3-layer GELU MLP, biased top-1.

Computed entirely in fp32 (it is small, and its softmax is one of ZAYA1's fp32 islands).
The choice is `argmax(stop_gradient(p) + balancing_biases)` over E experts plus a skip class;
the mixing weight is the unbiased `p[choice]`; a token sent to the skip class gets weight 0.

Initialisation (for training from scratch; Zyphra's is unpublished): the router MLP's three
matrices are variance-preserving (std 1/√fan_in), everything else `initializer_range`. With
0.02 the MLP shrinks its input ~100× (3 layers of 0.02·√R), so at step 1 every token's
probabilities agree to ~1e-4: the choice is the same for all of a layer's tokens, and once the
balancer moves the biases by more than that, the biases alone pick the expert and all tokens go
where the largest bias is. At 1/√fan_in the probabilities differ between tokens by ~0.05 from the
start and the balancing biases act as a fine correction (benchmarks/routing_health.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.schedule import LOCAL, Schedule
from zaya_jax.model.norms import RMSNorm
from zaya_jax.model.params import BalancingBias, constant, make_param, normal


@dataclasses.dataclass(frozen=True)
class Routing:
    expert: jax.Array  # int32[...tokens], in [0, E]; E is the skip class
    weight: jax.Array  # fp32[...tokens], p[expert]; 0 for skip
    probs: jax.Array  # fp32[...tokens, E+1], unbiased router probabilities


jax.tree_util.register_dataclass(Routing, data_fields=["expert", "weight", "probs"], meta_fields=[])


def initial_balancing_biases(num_experts: int) -> jax.Array:
    """0 for each expert and -1 for the skip class, as in HF."""
    return jnp.zeros((num_experts + 1,), jnp.float32).at[-1].set(-1.0)


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, r, classes = cfg.hidden_size, cfg.router_hidden_size, cfg.num_experts + 1
        init, mlp_init = normal(cfg.initializer_range), normal(r ** -0.5)
        self.down = make_param(rngs, init, (h, r), ("embed", "router"))
        self.down_bias = make_param(rngs, constant(0.0), (r,), ("router",))
        # Layer 0's incoming router state is zero, so its scale is inert (HF has none in layer 0).
        self.eda_scale = make_param(rngs, constant(1.0), (r,), ("router",))
        self.norm = RMSNorm(r, cfg.rms_norm_eps, "router", kernel=cfg.norm_kernel, rngs=rngs)
        self.fc1 = make_param(rngs, mlp_init, (r, r), ("router", "router_mlp"))
        self.fc1_bias = make_param(rngs, constant(0.0), (r,), ("router_mlp",))
        self.fc2 = make_param(rngs, mlp_init, (r, r), ("router_mlp", "router"))
        self.fc2_bias = make_param(rngs, constant(0.0), (r,), ("router",))
        self.out = make_param(rngs, mlp_init, (r, classes), ("router", "router_classes"))
        self.balancing_biases = BalancingBias(initial_balancing_biases(cfg.num_experts))

    def __call__(self, x: jax.Array, prev_state: jax.Array | None,
                 schedule: Schedule = LOCAL) -> tuple[Routing, jax.Array]:
        """x: [..., H] normed tokens ([B, S, H] in the model); prev_state: the previous layer's
        post-EDA router state [..., R] (zeros or None before the first layer)."""
        state = x.astype(jnp.float32) @ self.down[...] + self.down_bias[...]
        if prev_state is not None:
            state = state + prev_state * self.eda_scale[...]
        hidden = self.norm(state, schedule=schedule)
        hidden = jax.nn.gelu(hidden @ self.fc1[...] + self.fc1_bias[...], approximate=False)
        hidden = jax.nn.gelu(hidden @ self.fc2[...] + self.fc2_bias[...], approximate=False)
        probs = jax.nn.softmax(hidden @ self.out[...], axis=-1)
        return choose_top1(probs, self.balancing_biases[...]), state


def choose_top1(probs: jax.Array, biases: jax.Array) -> Routing:
    """Biased choice `argmax(stop_gradient(p) + b)`, unbiased weight `p[choice]`, 0 for the skip class."""
    skip = probs.shape[-1] - 1
    expert = jnp.argmax(jax.lax.stop_gradient(probs) + biases, axis=-1).astype(jnp.int32)
    weight = jnp.take_along_axis(probs, expert[..., None], axis=-1)[..., 0]
    return Routing(expert, jnp.where(expert == skip, 0.0, weight), probs)
