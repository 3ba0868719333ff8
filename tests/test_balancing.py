"""The bias balancer: no aux loss; a step against the load error drives a skewed router toward uniform load,
the spread controller settles where Adam's fixed-size step herds and follows a drifting router, and the
routing-collapse watch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import preset
from zaya_jax.model.zaya import Zaya
from zaya_jax.model.router import choose_top1, initial_balancing_biases
from zaya_jax.train import balancing
from zaya_jax.train.flat_model import split
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


def test_route_sums_count_the_valid_tokens_and_sum_their_probabilities():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(5), size=(3, 2, 6)).astype(np.float32)  # [L, B, S, E+1]
    choices = rng.integers(0, 5, size=(3, 2, 6)).astype(np.int32)
    valid = rng.random((2, 6)) > 0.3
    sums = np.asarray(balancing.route_sums(jnp.asarray(choices), jnp.asarray(probs), jnp.asarray(valid)))
    assert sums.shape == (3, 3, 5)
    for layer in range(3):
        kept_choices, kept = choices[layer][valid], probs[layer][valid]
        np.testing.assert_array_equal(sums[layer, balancing.TOKENS], np.bincount(kept_choices, minlength=5))
        np.testing.assert_allclose(sums[layer, balancing.PROB], kept.sum(0), rtol=1e-6)
        np.testing.assert_allclose(sums[layer, balancing.PROB_SQ], (kept ** 2).sum(0), rtol=1e-6)
    mean, sigma = balancing.probability_moments(jnp.asarray(sums))
    np.testing.assert_allclose(mean[0], probs[0][valid].mean(0), rtol=1e-5)
    np.testing.assert_allclose(sigma[0], probs[0][valid].std(0), rtol=1e-4, atol=1e-6)


def test_the_spread_step_is_the_overload_in_units_of_the_spread_plus_the_drift():
    """bias_e −= gain·min(σ_e, 1/(4(E+1)))·(E·load_e − 1) + (p̄_e − previous p̄_e, centred over the
    experts); none for skip. The classes' spreads straddle the cap."""
    control = balancing.balancer("spread", 0.5)
    rng = np.random.default_rng(1)
    biases = jnp.asarray(np.tile(initial_balancing_biases(4), (2, 1)))
    state = control.init(biases)
    previous = None
    for _ in range(2):
        logits = rng.normal(size=(2, 64, 5)) * np.array([0.05, 0.1, 0.4, 1.0, 0.2])
        probs = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32)  # [L, T, E+1]
        choices = rng.integers(0, 4, size=(2, 64)).astype(np.int32)
        sums = balancing.route_sums(jnp.asarray(choices), jnp.asarray(probs), jnp.ones(64, bool))
        new, state = control.update(biases, sums, state)
        load = np.stack([np.bincount(c, minlength=5) for c in choices]) / 64
        assert (probs.std(1) < 0.05).any() and (probs.std(1) > 0.05).any()
        step = 0.5 * np.minimum(probs.std(1), 0.25 / 5) * (4 * load - 1)
        if previous is not None:
            drift = probs.mean(1) - previous
            step += drift - drift[:, :4].mean(1, keepdims=True)
        step[:, 4] = 0.0
        np.testing.assert_allclose(np.asarray(new), np.asarray(biases) - step, atol=2e-6)
        previous, biases = probs.mean(1), new


@pytest.mark.parametrize("kind", ["spread", "adam"])
def test_overloaded_expert_bias_goes_down(kind):
    control = balancing.balancer(kind, 0.1)
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (1, 8, 5)), axis=-1)
    sums = balancing.route_sums(jnp.zeros((1, 8), jnp.int32), probs, jnp.ones(8, bool))  # all to expert 0
    biases = {"b": jnp.zeros((1, 5))}
    new, _ = balancing.update_biases(biases, sums, "b", control, control.init(biases["b"]))
    b = np.asarray(new["b"][0])
    assert b[0] < 0 and np.all(b[1:4] > 0) and b[4] == 0


def _balance(router, lr, steps, num_experts, kind="adam"):
    """Run the controller against a router (`router(step)` gives its probabilities [T, E+1]): choices use
    the model's own top-1 rule."""
    control = balancing.balancer(kind, lr)

    @jax.jit
    def step(b, opt, probs):
        routing = choose_top1(probs, b)
        sums = balancing.route_sums(routing.expert[None], probs[None], jnp.ones(probs.shape[0], bool))
        new, opt = balancing.update_biases({"b": b[None]}, sums, "b", control, opt)
        return new["b"][0], opt, balancing.load_summary(sums[:, balancing.TOKENS])

    b = initial_balancing_biases(num_experts)
    opt = control.init(b[None])
    history = []
    for i in range(steps):
        b, opt, summary = step(b, opt, router(i) if callable(router) else router)
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
    _, routing = modeldef.merge(params, pushed).hidden_states(tokens)
    assert np.all(np.asarray(routing.expert) == 1)


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


def test_the_spread_balancer_keeps_the_even_start_where_adam_herds():
    """The same router at the default gain: steps in units of the tokens' spread are small when it is."""
    _, history = _balance(_close_router(), lr=0.5, steps=40, num_experts=4, kind="spread")
    assert max(h["load_max"] for h in history) < 1.1, [round(h["load_max"], 2) for h in history]


def _drifting_router(rate=0.05, num_experts=4, tokens=4096):
    """Probabilities that differ between tokens by ~0.02 while one expert's rise by ~0.01 per step, every
    token alike: the crowded, drifting router of the default run while its loss falls fastest."""
    base = 0.1 * jax.random.normal(jax.random.key(3), (tokens, num_experts + 1))
    return lambda step: jax.nn.softmax(base.at[:, 1].add(rate * step), axis=-1)


def test_the_spread_balancer_cancels_a_drifting_router():
    """A proportional step alone lags a drifting router by a constant overload; the feed-forward of the
    mean probability's drift removes the lag (without it the busiest expert holds ~2× its share)."""
    _, history = _balance(_drifting_router(), lr=0.5, steps=80, num_experts=4, kind="spread")
    late = [round(h["load_max"], 2) for h in history[10:]]
    assert max(late) < 1.3, late


def test_margin_counts_are_the_tokens_a_bias_step_would_move():
    """Counted token by token in numpy: a class's own tokens by their lead over their runner-up, every
    other token by how far its choice scores above the class, at or below each edge."""
    rng = np.random.default_rng(4)
    probs = rng.dirichlet(np.ones(6) * 2, size=(2, 3, 40)).astype(np.float32)  # [L, B, S, E+1]
    biases = np.concatenate([rng.normal(0, 0.05, (2, 5)), -np.ones((2, 1))], 1).astype(np.float32)
    weights = (rng.random((3, 40)) > 0.2).astype(np.float32)
    counts, keep, near = (np.asarray(x) for x in balancing.margin_counts(
        jnp.asarray(probs), jnp.asarray(weights), jnp.asarray(biases)))
    edges = np.asarray(balancing.EDGES)
    want_counts, want_keep, want_near = np.zeros((2, 6)), np.zeros((2, 6, 32)), np.zeros((2, 6, 32))
    for layer in range(2):
        for b in range(3):
            for t in range(40):
                score = probs[layer, b, t].astype(np.float64) + biases[layer]
                choice = int(np.argmax(score))
                lead = score[choice] - np.max(np.delete(score, choice))
                want_counts[layer, choice] += weights[b, t]
                want_keep[layer, choice] += weights[b, t] * (lead <= edges)
                for other in set(range(6)) - {choice}:
                    want_near[layer, other] += weights[b, t] * (score[choice] - score[other] <= edges)
    np.testing.assert_array_equal(counts, want_counts)
    assert want_keep[..., -1].sum() > 0 and 0 < want_near[..., 20].sum() < want_near[..., -1].sum()
    # an fp32 lead within rounding of an edge may count either side
    assert np.abs(keep - want_keep).sum() <= 2 and np.abs(near - want_near).sum() <= 4


def _load_max(probs, biases):
    """The busiest expert's share × E, by a plain argmax of probs + biases (the skip class last)."""
    choice = np.argmax(np.asarray(probs) + np.asarray(biases)[:, None, :], axis=-1)
    num_experts = probs.shape[-1] - 1
    counts = np.stack([np.bincount(c, minlength=num_experts + 1) for c in choice])[:, :-1]
    return (counts.max(1) / counts.sum(1) * num_experts).max()


@pytest.mark.parametrize("spread", [0.5, 0.02])
def test_one_solve_evens_a_skewed_16_expert_router(spread):
    """Expert 0 favoured by +1.5 in the logits (about 5× its share): one `solve` update (its damped
    iterations) on those probabilities brings every expert within 1.25× of its share, whether the
    tokens' probabilities differ widely or hardly at all, and leaves the skip class's −1 alone."""
    logits = spread * jax.random.normal(jax.random.key(5), (2, 8192, 17))
    probs = jax.nn.softmax(logits.at[..., 0].add(1.5 * spread), axis=-1)
    biases = jnp.tile(initial_balancing_biases(16), (2, 1))
    assert _load_max(probs, biases) > 2.5
    control = balancing.balancer("solve", 0.5)
    solved, _ = control.update(biases, balancing.Rerouted(probs, jnp.ones(8192, bool)), control.init(biases))
    assert _load_max(probs, solved) < 1.25, _load_max(probs, solved)
    np.testing.assert_array_equal(np.asarray(solved)[:, -1], -1.0)
    assert abs(float(np.asarray(solved)[:, :-1].mean())) < 1e-6  # centred: only differences route


class _Events:
    def __init__(self):
        self.lines = []

    def write(self, kind, **fields):
        self.lines.append({"event": kind, **fields})


def _watch_run(loads):
    """Feed RoutingWatch per-step busiest-expert loads [steps, layers] (expert 2 the busiest everywhere)."""
    from zaya_jax.train.routing_watch import RoutingWatch

    events, notes = _Events(), []
    watch = RoutingWatch(events, notes.append)
    for step, load in enumerate(loads, start=1):
        watch.after_step(step, {"layer_top_share": np.asarray(load, np.float32) / 4,
                                "layer_top_expert": np.full(len(load), 2, np.int32),
                                "layer_load_max": np.asarray(load, np.float32), "layer_skip_fraction": np.zeros(len(load))})
    watch.flush()
    return events.lines, notes


def test_routing_watch_warns_once_after_ten_overloaded_steps_and_says_when_it_recovers():
    # layer 1 at 2.4x for steps 12..25 (14 steps), then 1.2x; layer 0 at 3x for 9 steps only, twice;
    # layer 2 at 4x for steps 1..18, of which 9 after the router has settled (step 10).
    loads = [[3.0 if (11 <= s <= 19 or 21 <= s <= 29) else 1.3, 2.4 if 12 <= s <= 25 else 1.2,
              4.0 if s <= 18 else 1.1] for s in range(1, 41)]
    lines, notes = _watch_run(loads)
    assert [(e["event"], e["step"], e["layer"]) for e in lines] == [("routing_overload", 21, 1),
                                                                    ("routing_recovered", 26, 1)]
    assert lines[0]["expert"] == 2 and lines[0]["load"] == pytest.approx(2.4, abs=1e-3)
    assert notes[0].startswith("step 21: warning: layer 1 has sent ≥ 2× the fair share to one expert for 10 steps "
                               "in a row (now expert 2, 2.4×, 60% of its tokens)")
    assert notes[1] == "step 26: layer 1's routing recovered (busiest expert 1.2× its fair share)"


def test_routing_watch_fires_for_a_balancer_that_herds_tokens_from_expert_to_expert():
    """The ZAYA1 report's Adam balancer at a large lr: every step another expert takes the layer."""
    from zaya_jax.train.routing_watch import RoutingWatch

    events = _Events()
    watch = RoutingWatch(events)
    for step in range(1, 31):
        watch.after_step(step, {"layer_top_share": np.asarray([0.97]), "layer_top_expert": np.asarray([step % 4]),
                                "layer_load_max": np.asarray([3.9]), "layer_skip_fraction": np.zeros(1)})
    watch.flush()
    assert [(e["event"], e["step"]) for e in events.lines] == [("routing_overload", 19)]


def test_a_logged_record_carries_each_layers_worst_routing_since_the_last_one():
    """Steps 1-10 logged at 5 and 10: layer 0 spikes to 3.5 at step 3 and layer 1 to 2.2 at step 7,
    neither a logged step; each record says so, and the next interval starts afresh: the logged step
    5's skip share of 0.4 (the watch reads it a step late, after the record) is in the first record
    only."""
    from zaya_jax.train.routing_watch import RoutingWatch

    def metrics(step):
        load = [3.5 if step == 3 else 1.2, 2.2 if step == 7 else 1.1]
        return {"layer_top_share": np.full(2, 0.3), "layer_top_expert": np.zeros(2, np.int32),
                "layer_load_max": np.asarray(load), "layer_skip_fraction": np.asarray([0.1, {5: 0.4, 9: 0.3}.get(step, 0.2)])}

    watch, records = RoutingWatch(_Events()), []
    for step in range(1, 11):
        watch.after_step(step, metrics(step))
        if step % 5 == 0:
            records.append(watch.interval_peaks(metrics(step), step))
    assert records[0] == {"layer_load_max_peak": [3.5, 1.1], "layer_skip_fraction_peak": [0.1, 0.4], "load_max_peak": 3.5}
    assert records[1] == {"layer_load_max_peak": [1.2, 2.2], "layer_skip_fraction_peak": [0.1, 0.3], "load_max_peak": 2.2}


@pytest.mark.slow
def test_routing_holds_at_16_experts_at_every_step(tmp_path):
    """The short form of benchmarks/routing_seeds.md's bar: `zaya1_routing_cpu` (16 experts + skip,
    top-1, 8,192 tokens a step) for 30 steps with the `solve` balancer, logged at every step: from
    step 10 every layer's busiest expert stays under 2× its fair share (the `spread` balancer,
    measuring the step's own routing: 3.5–6.5× in these steps over 5 seeds,
    benchmarks/routing_seeds_spread.md)."""
    import json
    import os

    from paths import EXPERIMENTS
    from zaya_jax.experiment import load_experiment
    from zaya_jax.train.loop import train

    exp = load_experiment(os.path.join(EXPERIMENTS, "zaya1_routing_cpu.py"),
                          ["--config.optim.balancer=solve", "--config.train.steps=30", "--config.train.log_every=1",
                           "--config.eval.every_steps=0",
                           "--config.eval.batches=0", "--config.train.progress=false"])
    with open(os.devnull, "w") as out:
        train(exp, str(tmp_path / "run"), devices=jax.devices()[:2], out=out)
    worst = {}
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        for record in map(json.loads, f):
            if record.get("step", 0) >= 10 and "expert_load" in record:
                load = np.asarray(record["expert_load"])[:, :-1]
                worst[record["step"]] = float((load.max(1) / load.sum(1)).max() * load.shape[1])
    assert sorted(worst) == list(range(10, 31))
    assert max(worst.values()) < 2.0, {s: round(v, 2) for s, v in worst.items() if v >= 2.0}
