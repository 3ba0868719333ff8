"""ZAYA1's expert load balancing: the router biases move against the load error, no auxiliary loss.

After each optimizer step, each layer's `balancing_biases` (which shift the top-1 *choice*,
never the mixing weight) move against that layer's load error, measured over the step's tokens
(the whole global batch, all micro-batches): an overloaded expert's bias goes down, an idle
one's goes up. The skip class keeps its bias (−1, as released): it is never moved, matching HF
`ZayaForCausalLM` checkpoints (the target for the skip class is unpublished).

The step reports per layer and class the tokens routed there and the sums of the router's
probability p and p² over the step's tokens (`route_sums`, [L, 3, E+1]); from them come the load,
the mean probability p̄ and its spread σ between tokens.

Three controllers (`optim.balancer`):
- `solve` (the default): after the optimizer step, the step's first micro-batch is routed again
  through the *updated* model (a forward pass, no gradient), and the biases are solved on those
  probabilities: a few damped steps, each moving every expert's bias by the amount that would
  release its excess tokens (the excess-th smallest lead of its tokens over their runner-up) or
  draw its missing ones (the deficit-th smallest gap of other tokens to it), centred over the
  experts. What the next step sees then differs only by the batch. The controllers below measure
  the step's own routing, made before the update, and the update itself can move a layer from
  even to 5× its fair share (16 experts, warmup; `benchmarks/routing_update_drift.md`). It costs a
  forward of one micro-batch per step: 1/(3A) of the step's model FLOPs with A micro-batches.
- `spread`: each step, bias_e −= balance_lr · σ_e · (E·load_e − 1) + Δp̄_e. The first
  term is a proportional step measured in units of how much the router's probabilities differ
  between tokens: a bias step of σ moves a sizeable share of tokens whatever σ is, so the gain
  that settles at σ = 0.05 (a fresh router) does not oscillate at σ = 0.015 (while the residual
  stream moves fast, the router's tokens crowd together). σ is capped at a quarter of the even
  share, 1/(4(E+1)): a trained router's σ grows to ~0.2, and steps that large chase the load's
  batch-to-batch noise (an expert at 2–2.7× its share now and then late in training).
  The second is feed-forward: Δp̄_e is the change of expert e's mean probability since the
  previous step (centred over the experts), the drift the router's own updates cause, which the
  biases cancel before it shows in the load. Without either term the busiest expert reaches
  2.5–3× its fair share for tens of steps while the loss falls fastest (benchmarks/routing_health.md).
  `balance_lr` 0 turns balancing off.
- `adam`: the ZAYA1 report's words: an Adam optimizer fed the error `(E·load_e − 1)/(E + 1)` as the
  gradient of the biases (its lr and betas are unpublished). Adam normalises its step, so every
  bias moves by about `balance_lr` per step whatever the error: when the router's probabilities
  differ between tokens by less than that, each step sends all of a layer's tokens to the expert
  whose bias is highest, and the next step elsewhere (herding).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zaya_jax.model.router import choose_top1

TOKENS, PROB, PROB_SQ = 0, 1, 2  # the rows of `route_sums`


def expert_counts(choices: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """choices int32[L, ...] in [0, E] (E = skip), valid bool[...] (e.g. [B, S]) → token counts
    fp32[L, E+1]."""
    onehot = jax.nn.one_hot(choices, num_experts + 1, dtype=jnp.float32)
    return jnp.einsum("l...e,...->le", onehot, valid.astype(jnp.float32))


def route_sums(choices: jax.Array, probs: jax.Array, valid: jax.Array) -> jax.Array:
    """What the balancer reads from one batch, fp32[L, 3, E+1]: per layer and class, the valid tokens
    routed there, and the sums over valid tokens of the router probability and of its square.
    choices int32[L, ...], probs [L, ..., E+1], valid bool[...]. Sums, so micro-batches and
    replicas add them."""
    num_classes = probs.shape[-1]
    weights = valid.astype(jnp.float32)
    probs = jax.lax.stop_gradient(probs).astype(jnp.float32)
    return jnp.stack([expert_counts(choices, valid, num_classes - 1),
                      jnp.einsum("l...e,...->le", probs, weights),
                      jnp.einsum("l...e,...->le", jnp.square(probs), weights)], axis=1)


def load_fractions(counts: jax.Array) -> jax.Array:
    """Per-layer fraction of tokens per class, fp32[L, E+1]."""
    return counts / jnp.maximum(counts.sum(axis=-1, keepdims=True), 1.0)


def overload(counts: jax.Array) -> jax.Array:
    """E·load_e − 1 for real experts (0 at the fair share, 1 at twice it; load over the layer's tokens,
    skip included), 0 for the skip class."""
    num_experts = counts.shape[-1] - 1
    return (load_fractions(counts) * num_experts - 1.0).at[..., -1].set(0.0)


def load_error(counts: jax.Array) -> jax.Array:
    """The Adam balancer's gradient: (E·load_e − 1) / (E + 1), 0 for the skip class."""
    return overload(counts) / counts.shape[-1]


def probability_moments(sums: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean router probability p̄ and its standard deviation σ between tokens, each fp32[L, E+1]."""
    tokens = jnp.maximum(sums[:, TOKENS].sum(-1, keepdims=True), 1.0)
    mean, mean_sq = sums[:, PROB] / tokens, sums[:, PROB_SQ] / tokens
    return mean, jnp.sqrt(jnp.maximum(mean_sq - jnp.square(mean), 0.0))


class Balancer(NamedTuple):
    """`init(biases [L, E+1]) -> state`; `update(biases, evidence, state) -> (biases, state)`, the
    evidence the step's `route_sums`, or where `reroutes`, `Rerouted`: the updated model's routing
    of one micro-batch."""
    init: Callable[[jax.Array], Any]
    update: Callable[[jax.Array, Any, Any], tuple[jax.Array, Any]]
    reroutes: bool = False


class Rerouted(NamedTuple):
    probs: jax.Array  # fp32[L, ..., E+1], the router's probabilities after the optimizer step
    valid: jax.Array  # bool[...], the tokens that count


SOLVE_ITERATIONS = 8
# Where a bias step of a given size moves tokens: per class, the tokens whose lead over their
# runner-up (or gap to the class) is at or below each edge, log-spaced in units of probability.
EDGES = tuple(float(x) for x in np.geomspace(1e-5, 1.0, 32))


def balancer(kind: str, lr: float, b1: float = 0.9, b2: float = 0.999) -> Balancer:
    """The controller that moves the biases: `optim.balancer`, one of `experiment.schema.BALANCERS`,
    and its rate (`experiment.schema.balance_lr`; both validated there)."""
    if lr == 0:  # balancing off: spread's feed-forward alone would still move the biases
        return Balancer(lambda biases: (), lambda biases, evidence, state: (biases, state))
    if kind == "solve":
        return _solve(lr)
    if kind == "spread":
        return _spread(lr)
    return _adam(lr, b1, b2)


def _solve(gain: float, iterations: int = SOLVE_ITERATIONS) -> Balancer:
    def update(biases, rerouted, state):
        weights = rerouted.valid.astype(jnp.float32)
        probs = jax.lax.stop_gradient(rerouted.probs).astype(jnp.float32)

        def one(_, b):
            return b + gain * solve_step(*margin_counts(probs, weights, b))

        return jax.lax.fori_loop(0, iterations, one, biases), state

    return Balancer(lambda biases: (), update, reroutes=True)


def margin_counts(probs: jax.Array, weights: jax.Array, biases: jax.Array) -> tuple[jax.Array, ...]:
    """Routing `probs` [L, ..., C] with `biases` [L, C] (the router's top-1 rule), weighted by
    `weights` [...]: the tokens per class fp32[L, C], and per class and edge fp32[L, C, K] the
    tokens routed there whose lead over their runner-up is at most the edge (a bias step down of
    that size releases them) and the tokens routed elsewhere whose choice scores at most the edge
    above the class (a step up of that size draws them). Sums over tokens: replicas add them."""
    layers, classes = biases.shape
    biases = biases.reshape((layers,) + (1,) * (probs.ndim - 2) + (classes,))
    scores = probs + biases
    chosen = jax.nn.one_hot(choose_top1(probs, biases).expert, classes, dtype=jnp.bool_)
    best = jnp.max(scores, axis=-1, keepdims=True)
    runner_up = jnp.max(jnp.where(chosen, -jnp.inf, scores), axis=-1, keepdims=True)
    distance = jnp.where(chosen, best - runner_up, best - scores)
    tokens = tuple(range(1, probs.ndim - 1))
    w = weights[None, ..., None]
    counts = jnp.sum(jnp.where(chosen, w, 0.0), axis=tokens)

    def below(mask):  # a compare feeding a reduction: XLA fuses it, nothing [..., C, K] is stored
        hits = (distance[..., None] <= jnp.asarray(EDGES, jnp.float32)) & mask[..., None]
        return jnp.sum(jnp.where(hits, w[..., None], 0.0), axis=tokens)

    return counts, below(chosen), below(~chosen)


def solve_step(counts: jax.Array, keep: jax.Array, near: jax.Array) -> jax.Array:
    """The bias change [L, C] that would bring every expert to the mean load of the experts, each
    expert taken alone: down by the step that releases its excess, up by the step that draws its
    deficit; centred over the experts (only differences route), 0 for the skip class."""
    target = counts[:, :-1].mean(-1, keepdims=True)
    excess = counts[:, :-1] - target
    down = _step_size(keep[:, :-1], jnp.maximum(excess, 0.0))
    up = _step_size(near[:, :-1], jnp.maximum(-excess, 0.0))
    step = jnp.where(excess > 0, -down, jnp.where(excess < 0, up, 0.0))
    return jnp.pad(step - step.mean(-1, keepdims=True), ((0, 0), (0, 1)))


def _step_size(cumulative: jax.Array, wanted: jax.Array) -> jax.Array:
    """The step that moves `wanted` tokens [L, E], from the tokens within each edge [L, E, K]:
    linear between edges (from 0 below the first), the last edge where too few are that near."""
    edges = jnp.asarray(EDGES, jnp.float32)
    lower_edges = jnp.asarray((0.0,) + EDGES[:-1], jnp.float32)
    # A pad, not a concatenate: XLA's ROCm Triton emitter fails on this concatenate's fusion.
    lower = jnp.pad(cumulative[..., :-1], [(0, 0)] * (cumulative.ndim - 1) + [(1, 0)])
    k = jnp.sum(cumulative < wanted[..., None], axis=-1)  # the first edge that holds `wanted`
    at = jnp.minimum(k, len(EDGES) - 1)[..., None]
    hi, lo = (jnp.take_along_axis(c, at, -1)[..., 0] for c in (cumulative, lower))
    frac = jnp.clip((wanted - lo) / jnp.maximum(hi - lo, 1e-9), 0.0, 1.0)
    size = lower_edges[at[..., 0]] + frac * (edges[at[..., 0]] - lower_edges[at[..., 0]])
    return jnp.where(k >= len(EDGES), edges[-1], size)


def _spread(gain: float, cap: float = 0.25) -> Balancer:
    def init(biases):
        return {"mean_probs": jnp.zeros(biases.shape, jnp.float32), "seen": jnp.zeros((), jnp.bool_)}

    def update(biases, sums, state):
        mean, sigma = probability_moments(sums)
        sigma = jnp.minimum(sigma, cap / sums.shape[-1])  # a quarter of the even share 1/(E+1)
        drift = jnp.where(state["seen"], mean - state["mean_probs"], 0.0)[:, :-1]
        drift = jnp.pad(drift - drift.mean(-1, keepdims=True), ((0, 0), (0, 1)))  # skip class: 0
        step = gain * sigma * overload(sums[:, TOKENS]) + drift
        return biases - step, {"mean_probs": mean, "seen": jnp.ones((), jnp.bool_)}

    return Balancer(init, update)


def _adam(lr: float, b1: float, b2: float) -> Balancer:
    tx = optax.adam(lr, b1=b1, b2=b2)

    def update(biases, sums, state):
        updates, state = tx.update(load_error(sums[:, TOKENS]), state, biases)
        return optax.apply_updates(biases, updates), state

    return Balancer(tx.init, update)


def update_biases(biases: dict, evidence, key: str, control: Balancer, state) -> tuple[dict, Any]:
    """One balancing step of `biases[key]`, the layers' biases stacked [L, E+1]."""
    new, state = control.update(biases[key], evidence, state)
    return {**biases, key: new}, state


def load_summary(counts: jax.Array) -> dict[str, jax.Array]:
    """How even the routing is: scalars over all layers for the logs, and per layer.

    `load_entropy` is H(load over experts) / ln E (1 = uniform), averaged over layers, and
    `layer_load_entropy` the same per layer [L]; `load_max` is the busiest expert's share times E
    (1 = uniform) over all layers; `skip_fraction` the share sent to the skip class.
    `layer_top_share` [L] is the share of a layer's tokens its busiest expert took (skip class
    included in the count) and `layer_top_expert` [L] which expert that is: what the routing watch
    names (`train/routing_watch.py`). `layer_load_max` [L] is each layer's busiest expert's
    share of the tokens sent to experts times E, and `layer_skip_fraction` [L] its share sent to
    the skip class: the watch keeps their peaks between logged steps.
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
        "layer_load_max": jnp.max(experts, axis=-1) * num_experts,
        "layer_skip_fraction": frac[:, -1],
    }
