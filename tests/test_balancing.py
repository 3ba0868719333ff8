"""The bias balancer: no aux loss, an Adam step on the load error drives a skewed router toward uniform load."""

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import preset
from zaya_jax.model.zaya import Zaya
from zaya_jax.model.router import choose_top1, initial_balancing_biases
from zaya_jax.train import balancing
from zaya_jax.train.model_state import split
from flax import nnx


def test_load_error_and_counts():
    choices = jnp.array([[0, 0, 1, 4], [2, 2, 2, 2]])  # E = 4, class 4 = skip
    counts = balancing.expert_counts(choices, jnp.array([True, True, True, False]), 4)
    np.testing.assert_allclose(counts, [[2, 1, 0, 0, 0], [0, 0, 3, 0, 0]])
    err = balancing.load_error(counts)
    np.testing.assert_allclose(err[0], [2 / 3 - 0.25, 1 / 3 - 0.25, -0.25, -0.25, 0.0], rtol=1e-6)
    summary = balancing.load_summary(counts)
    assert float(summary["load_max"]) == 4.0  # layer 1 sends everything to one expert
    entropy0 = -(2 / 3 * np.log(2 / 3) + 1 / 3 * np.log(1 / 3)) / np.log(4)
    assert abs(float(summary["load_entropy"]) - entropy0 / 2) < 1e-6


def test_overloaded_expert_bias_goes_down():
    counts = jnp.array([[8.0, 0.0, 0.0, 0.0, 0.0]])
    biases = {"b": jnp.zeros((1, 5))}
    tx = balancing.balancer(0.1)
    new, _ = balancing.update_biases(biases, counts, "b", tx, tx.init(biases))
    b = np.asarray(new["b"][0])
    assert b[0] < 0 and np.all(b[1:4] > 0) and b[4] == 0


def _balance(probs, lr, steps, num_experts):
    """Run the controller against a fixed router: choices use the model's own top-1 rule."""
    tx = balancing.balancer(lr)

    @jax.jit
    def step(b, opt):
        counts = balancing.expert_counts(choose_top1(probs, b).expert[None], jnp.ones(probs.shape[0], bool),
                                         num_experts)
        new, opt = balancing.update_biases({"b": b[None]}, counts, "b", tx, opt)
        return new["b"][0], opt, balancing.load_summary(counts)

    b = initial_balancing_biases(num_experts)
    opt = tx.init({"b": b[None]})
    history = []
    for _ in range(steps):
        b, opt, summary = step(b, opt)
        history.append({k: float(v) for k, v in summary.items()})
    return b, history


def test_balancer_drives_a_skewed_router_to_uniform_load():
    num_experts = 8
    logits = jax.random.normal(jax.random.key(0), (4096, num_experts + 1)).at[:, 0].add(2.0)  # expert 0 favoured
    probs = jax.nn.softmax(logits, axis=-1)
    b, history = _balance(probs, lr=1e-2, steps=200, num_experts=num_experts)
    assert history[0]["load_max"] > 5.0 and history[0]["load_entropy"] < 0.6  # skewed to start
    assert history[-1]["load_max"] < 1.05 and history[-1]["load_entropy"] > 0.99, history[-1]
    assert history[-1]["skip_fraction"] == 0.0 and float(b[-1]) == -1.0  # the skip class stays inert
    assert float(b[0]) < 0 < float(b[1:-1].min())


def test_balancer_default_rate_moves_steadily_toward_uniform():
    num_experts = 8
    logits = jax.random.normal(jax.random.key(1), (4096, num_experts + 1)).at[:, 0].add(2.0)
    _, history = _balance(jax.nn.softmax(logits, axis=-1), lr=1e-3, steps=300, num_experts=num_experts)
    entropy = [h["load_entropy"] for h in history]
    assert entropy[-1] > entropy[150] > entropy[0] + 0.2 and entropy[-1] > 0.95


def test_router_uses_the_balancing_biases_for_the_choice_only():
    cfg = preset("tiny")
    modeldef, params, biases = split(Zaya(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    pushed = {k: v.at[:, 1].set(10.0) for k, v in biases.items()}  # force expert 1 in every layer
    _, choices = modeldef.merge(params, pushed).hidden_states(tokens)
    assert np.all(np.asarray(choices) == 1)
