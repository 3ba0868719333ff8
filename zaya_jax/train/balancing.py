"""ZAYA1's expert load balancing: the router biases move against the load error, no auxiliary loss.

After each optimizer step, each layer's `balancing_biases` (which shift the top-1 *choice*,
never the mixing weight) move against the load error `(E·load_e − 1) / (E + 1)` (0 at the fair
share 1/E, 1/(E+1) at twice it), where `load_e` is the fraction of the step's tokens — the whole
global batch, all micro-batches — that layer sent to expert e: an overloaded expert's bias goes
down, an idle one's goes up. The skip class keeps its bias (−1, as released): its error is 0, so it stays inert,
matching HF `ZayaForCausalLM` checkpoints (the target for the skip class is unpublished).

Two controllers (`optim.balancer`), both fed the error as the gradient of the biases:
- `proportional` (the default): plain gradient descent, each step `balance_lr × error`. The step
  shrinks as the load evens out, so the biases settle instead of overshooting.
- `adam`: the ZAYA1 report's words (an Adam optimizer on the biases; its lr and betas are
  unpublished). Adam normalises its step, so every bias moves by about `balance_lr` per step
  whatever the size of the error: when the router's probabilities differ between tokens by less
  than that, each step sends all of a layer's tokens to the expert whose bias is highest, and the
  next step elsewhere (herding; benchmarks/routing_health.md).
`E·load_e − 1` is the overload relative to the fair share, and 1/(E+1) the size of a router
probability (a softmax over E experts and the skip class), which is what a bias competes with: so
one proportional gain suits any expert count. Adam is blind to the error's scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def expert_counts(choices: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """choices int32[L, ...] in [0, E] (E = skip), valid bool[...] (e.g. [B, S]) → token counts
    fp32[L, E+1]."""
    onehot = jax.nn.one_hot(choices, num_experts + 1, dtype=jnp.float32)
    return jnp.einsum("l...e,...->le", onehot, valid.astype(jnp.float32))


def load_fractions(counts: jax.Array) -> jax.Array:
    """Per-layer fraction of tokens per class, fp32[L, E+1]."""
    return counts / jnp.maximum(counts.sum(axis=-1, keepdims=True), 1.0)


def load_error(counts: jax.Array) -> jax.Array:
    """(E·load_e − 1) / (E + 1) for real experts (load_e over the layer's tokens, skip included), 0 for
    the skip class."""
    num_experts = counts.shape[-1] - 1
    err = (load_fractions(counts) * num_experts - 1.0) / (num_experts + 1)
    return err.at[..., -1].set(0.0)


def balancer(kind: str, lr: float, b1: float = 0.9, b2: float = 0.999) -> optax.GradientTransformation:
    """The controller that turns load errors into bias steps: `optim.balancer`, one of
    `experiment.schema.BALANCERS` (validated there)."""
    if kind == "proportional":
        return optax.sgd(lr)
    return optax.adam(lr, b1=b1, b2=b2)


def update_biases(biases: dict, counts: jax.Array, key: str, tx: optax.GradientTransformation,
                  state: optax.OptState) -> tuple[dict, optax.OptState]:
    """One balancing step of `biases[key]`, the layers' biases stacked [L, E+1] like counts."""
    grads = {key: load_error(counts)}
    updates, state = tx.update(grads, state, biases)
    return optax.apply_updates(biases, updates), state


def load_summary(counts: jax.Array) -> dict[str, jax.Array]:
    """How even the routing is: scalars over all layers for the logs, and per layer.

    `load_entropy` is H(load over experts) / ln E (1 = uniform), averaged over layers, and
    `layer_load_entropy` the same per layer [L]; `load_max` is the busiest expert's share times E
    (1 = uniform) over all layers; `skip_fraction` the share sent to the skip class.
    `layer_top_share` [L] is the share of a layer's tokens its busiest expert took (skip class
    included in the count) and `layer_top_expert` [L] which expert that is: what the routing-collapse
    watch reads (`train/routing_watch.py`).
    """
    frac = load_fractions(counts)
    experts = frac[:, :-1] / jnp.maximum(frac[:, :-1].sum(-1, keepdims=True), 1e-9)
    num_experts = experts.shape[-1]
    entropy = -jnp.sum(jnp.where(experts > 0, experts * jnp.log(experts), 0.0), axis=-1)
    layer_entropy = entropy / jnp.log(float(num_experts)) if num_experts > 1 else jnp.ones_like(entropy)
    return {
        "load_entropy": jnp.mean(layer_entropy),
        "layer_load_entropy": layer_entropy,
        "load_max": jnp.max(experts) * num_experts,
        "skip_fraction": jnp.mean(frac[:, -1]),
        "layer_top_share": jnp.max(frac[:, :-1], axis=-1),
        "layer_top_expert": jnp.argmax(frac[:, :-1], axis=-1).astype(jnp.int32),
    }
