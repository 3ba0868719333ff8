"""The bias balancer: no aux loss; a step against the load error drives a skewed router toward uniform load,
the proportional controller settles where Adam's fixed-size step herds, and the routing-collapse watch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    # (E·load − 1) / (E + 1) over the layer's tokens: 2 of 3 to expert 0 is (4·2/3 − 1) / 5; skip is inert.
    np.testing.assert_allclose(err[0], np.array([4 * 2 / 3 - 1, 4 / 3 - 1, -1, -1, 0.0]) / 5, rtol=1e-6)
    summary = balancing.load_summary(counts)
    assert float(summary["load_max"]) == 4.0  # layer 1 sends everything to one expert
    entropy0 = -(2 / 3 * np.log(2 / 3) + 1 / 3 * np.log(1 / 3)) / np.log(4)
    assert abs(float(summary["load_entropy"]) - entropy0 / 2) < 1e-6


def test_overloaded_expert_bias_goes_down():
    counts = jnp.array([[8.0, 0.0, 0.0, 0.0, 0.0]])
    biases = {"b": jnp.zeros((1, 5))}
    tx = balancing.balancer("proportional", 0.1)
    new, _ = balancing.update_biases(biases, counts, "b", tx, tx.init(biases))
    b = np.asarray(new["b"][0])
    assert b[0] < 0 and np.all(b[1:4] > 0) and b[4] == 0


def _balance(probs, lr, steps, num_experts, kind="adam"):
    """Run the controller against a fixed router: choices use the model's own top-1 rule."""
    tx = balancing.balancer(kind, lr)

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
        history.append({k: float(v) for k, v in summary.items() if v.ndim == 0})
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


def _close_router(num_experts=4, tokens=4096, spread=1e-2):
    """Probabilities as a freshly initialised router gives them: they differ between tokens by ~2e-3
    (logits by `spread`), so the plain argmax spreads the tokens evenly."""
    return jax.nn.softmax(spread * jax.random.normal(jax.random.key(2), (tokens, num_experts + 1)), axis=-1)


def test_adam_herds_where_the_probabilities_are_close():
    """Adam moves every bias by ~lr per step whatever the error, here ~5× the tokens' spread: from an
    even start, each step sends the tokens in bulk to the experts whose biases went up
    (benchmarks/routing_health.md)."""
    _, history = _balance(_close_router(), lr=1e-2, steps=40, num_experts=4, kind="adam")
    assert history[0]["load_max"] < 1.1
    assert np.mean([h["load_max"] for h in history[1:]]) > 1.7, [round(h["load_max"], 2) for h in history]


def test_the_proportional_balancer_keeps_the_even_start_where_adam_herds():
    """The same router: steps proportional to the error are small when the error is."""
    _, history = _balance(_close_router(), lr=5e-3, steps=40, num_experts=4, kind="proportional")
    assert max(h["load_max"] for h in history) < 1.1, [round(h["load_max"], 2) for h in history]


class _Events:
    def __init__(self):
        self.lines = []

    def write(self, kind, **fields):
        self.lines.append({"event": kind, **fields})


def _watch_run(shares):
    """Feed RoutingWatch per-step shares [steps, layers] (expert 2 the busiest everywhere)."""
    from zaya_jax.train.routing_watch import RoutingWatch

    events, notes = _Events(), []
    watch = RoutingWatch(events, notes.append)
    for step, share in enumerate(shares, start=1):
        watch.after_step(step, {"layer_top_share": np.asarray(share, np.float32),
                                "layer_top_expert": np.full(len(share), 2, np.int32)})
    watch.flush()
    return events.lines, notes


def test_routing_watch_warns_once_after_twenty_collapsed_steps_and_says_when_it_recovers():
    # layer 1 over 90% for steps 5..30 (26 steps), then 40%; layer 0 over for 19 steps only, twice.
    shares = [[0.95 if (3 <= s <= 21 or 23 <= s <= 41) else 0.3, 0.97 if 5 <= s <= 30 else 0.4] for s in range(1, 51)]
    lines, notes = _watch_run(shares)
    assert [(e["event"], e["step"], e["layer"]) for e in lines] == [("routing_collapse", 24, 1),
                                                                    ("routing_recovered", 31, 1)]
    assert lines[0]["expert"] == 2 and lines[0]["share"] == pytest.approx(0.97, abs=1e-4)
    assert notes[0].startswith("step 24: warning: layer 1's routing collapsed: expert 2 took 97% of its tokens")
    assert notes[1] == "step 31: layer 1's routing recovered (busiest expert 40%)"
