"""ZAYA1's expert load balancing: an Adam step on the router biases, no auxiliary loss.

After each optimizer step, each layer's `balancing_biases` (which shift the top-1 *choice*,
never the mixing weight) move against the load error `load_e − 1/E`, where `load_e` is the
fraction of the step's tokens — the whole global batch, all micro-batches — that layer sent
to expert e. The error is fed to its own Adam as a gradient: an overloaded expert's bias goes
down, an idle one's goes up. The skip class keeps its bias (−1, as released): its error is 0,
so it stays inert, matching HF `ZayaForCausalLM` checkpoints (DESIGN §3; the target for the
skip class is unpublished, see reference/zaya1.md §1.4).
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
    """load_e − 1/E for real experts, 0 for the skip class."""
    num_experts = counts.shape[-1] - 1
    err = load_fractions(counts) - 1.0 / num_experts
    return err.at[..., -1].set(0.0)


def balancer(lr: float, b1: float = 0.9, b2: float = 0.999) -> optax.GradientTransformation:
    return optax.adam(lr, b1=b1, b2=b2)


def update_biases(biases: dict, counts: jax.Array, key: str, tx: optax.GradientTransformation,
                  state: optax.OptState) -> tuple[dict, optax.OptState]:
    """One balancing step of `biases[key]`, the layers' biases stacked [L, E+1] like counts."""
    grads = {key: load_error(counts)}
    updates, state = tx.update(grads, state, biases)
    return optax.apply_updates(biases, updates), state


def load_summary(counts: jax.Array) -> dict[str, jax.Array]:
    """Scalars for the logs: how even the routing is, averaged over layers.

    `load_entropy` is H(load over experts) / ln E (1 = uniform), `load_max` is the busiest
    expert's share times E (1 = uniform), `skip_fraction` the share sent to the skip class.
    """
    frac = load_fractions(counts)
    experts = frac[:, :-1] / jnp.maximum(frac[:, :-1].sum(-1, keepdims=True), 1e-9)
    num_experts = experts.shape[-1]
    entropy = -jnp.sum(jnp.where(experts > 0, experts * jnp.log(experts), 0.0), axis=-1)
    return {
        "load_entropy": jnp.mean(entropy) / jnp.log(float(num_experts)) if num_experts > 1 else jnp.float32(1.0),
        "load_max": jnp.max(experts) * num_experts,
        "skip_fraction": jnp.mean(frac[:, -1]),
    }
