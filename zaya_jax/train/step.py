"""The train step, the eval step and the score step: pure functions of (state, batch), jitted over the run's mesh.

One train step = gradient accumulation over the global batch's micro-batches (a `lax.scan`,
summing token-weighted losses so the result equals one big batch; the program's `reduction`
makes each data-parallel replica accumulate its own and reduces once), global-norm clipping and
the Muon/AdamW update, then the balancing-bias update from the expert counts of the whole
global batch. The loss is the vocabulary-chunked cross-entropy on the fp32 final hidden states.
A bad step (`train/step_guard.py`: non-finite or spiking loss or gradient norm) keeps the state
as it was, but for the guard's counters.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from zaya_jax.model.schedule import LOCAL, Schedule
from zaya_jax.train import balancing, step_guard
from zaya_jax.train.loss import chunked_cross_entropy, token_scores
from zaya_jax.train.flat_model import ModelDef

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
# The named scope of the micro-batch loop's running gradient sum: its buffers are gradients, not
# the update's, in XLA's memory attributed term by term (`explore/xla_terms.py`).
GRADIENT_SUM_SCOPE = "gradient_sum"
# The named scope of a re-routing balancer's forward: its ops are the balancer's, not the step's
# own forward, in `explore/step_census.py`'s parts.
REROUTE_SCOPE = "reroute"


@dataclasses.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict[str, jax.Array]
    biases: dict[str, jax.Array]  # balancing biases, [L, E+1], moved by the balancer only
    opt_state: Any
    balance_state: Any
    guard: step_guard.GuardState  # the bad-step detector's history and counters


jax.tree_util.register_dataclass(
    TrainState, data_fields=["step", "params", "biases", "opt_state", "balance_state", "guard"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class StepConfig:
    remat: str = "none"
    scan_layers: bool = True  # False: the blocks unrolled (debugging; same values, compile grows with depth)
    scan_unroll: int = 1  # blocks per scan iteration (XLA compiles that many copies)
    vocab_chunk: int = 16384
    schedule: Schedule = LOCAL  # how the layers run over the program's devices (the program picks it)
    # The per-token loss (hidden, table, targets): one device's, or the program's `loss.token_loss`
    # (vocabulary-parallel where its mesh splits the table).
    loss: Callable = chunked_cross_entropy
    # Wraps the micro-batch loop so gradients are reduced once per step (the program hands it
    # `parallel.grad_reduction.reduce_once`); None: the loop alone, GSPMD reducing inside it.
    reduction: Callable | None = None
    # Where the params lie between steps (NamedShardings by key; None: wherever GSPMD puts them).
    # ZeRO-1 leaves the updated weights split over `data`; a forward on those (the re-route) would
    # gather each replica's rows of activations instead of the weights it gathers anyway.
    param_shardings: dict | None = None
    guard: step_guard.GuardSettings = step_guard.GuardSettings()


def batch_sums(modeldef: ModelDef, params, biases, batch, cfg: StepConfig):
    """Summed token loss, counted tokens and the balancer's route sums [L, 3, E+1] for one micro-batch."""
    model = modeldef.merge(params, biases)
    hidden, routing = model.hidden_states(batch["inputs"], batch["segment_ids"], batch["positions"],
                                          remat=cfg.remat, schedule=cfg.schedule, scan=cfg.scan_layers,
                                          unroll=cfg.scan_unroll)
    # [B, S] kept apart: flattening a sequence-split batch would gather it (train/loss.py).
    per_token = cfg.loss(hidden, params["embedding"], batch["targets"], chunk_size=cfg.vocab_chunk,
                         matmul_dtype=modeldef.cfg.compute_dtype)
    mask = batch["loss_mask"].astype(jnp.float32)
    valid = batch["segment_ids"] > 0
    routes = balancing.route_sums(routing.expert, routing.probs, valid)
    return jnp.sum(per_token * mask), (jnp.sum(mask), routes)


def accumulate_gradients(modeldef, params, biases, batches, cfg: StepConfig):
    """Sum of gradients, losses, token counts and route sums over micro-batches [A, b, S]."""
    grad_fn = jax.value_and_grad(lambda p, b: batch_sums(modeldef, p, biases, b, cfg), has_aux=True)

    def body(carry, micro):
        # The weights pass a barrier with each micro-batch: XLA's loop-invariant code motion would
        # otherwise lift what the forward makes from the weights alone out of this loop and hold it
        # through the whole step (where the layer scan is one iteration, every layer's gathered,
        # cast and fused expert weights: a drawn 3-layer shape on fsdp 2 x tsp 2 x sequence 2, two
        # micro-batches, 157 -> 103 MiB a device).
        weights, micro = jax.lax.optimization_barrier((params, micro))
        (loss, (ntok, routes)), grads = grad_fn(weights, micro)
        g_sum, l_sum, n_sum, r_sum = carry
        with jax.named_scope(GRADIENT_SUM_SCOPE):
            g_sum = jax.tree.map(jnp.add, g_sum, grads)
        return (g_sum, l_sum + loss, n_sum + ntok, r_sum + routes), None

    layers, classes = modeldef.cfg.num_hidden_layers, modeldef.cfg.num_experts + 1
    init = (jax.tree.map(jnp.zeros_like, params), jnp.float32(0), jnp.float32(0),
            jnp.zeros((layers, 3, classes), jnp.float32))
    (grads, loss, ntok, routes), _ = jax.lax.scan(body, init, batches)
    return grads, loss, ntok, routes


def make_gradient_step(modeldef: ModelDef, cfg: StepConfig):
    """`gradient_step(params, biases, batches) -> (grads, sums)`: the gradient of the mean token
    loss over the global batch [A, b, S] (reduced over the replicas by `cfg.reduction`), and
    `sums`: that loss, the gradient's global norm, the counted tokens and the route sums. The
    train step's first half; tests compare its gradients across layouts."""
    accumulate = functools.partial(accumulate_gradients, modeldef, cfg=cfg)
    accumulate = cfg.reduction(accumulate) if cfg.reduction else accumulate

    def gradient_step(params, biases, batches):
        grads, loss_sum, ntok, routes = accumulate(params, biases, batches)
        denom = jnp.maximum(ntok, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        return grads, {"loss": loss_sum / denom, "grad_norm": optax.global_norm(grads), "tokens": ntok,
                       "routes": routes}

    return gradient_step


def reroute(modeldef: ModelDef, params, biases, batch, cfg: StepConfig) -> balancing.Rerouted:
    """The router's probabilities for one [b, S] batch through the model `params` make (a forward, no
    gradient): what a re-routing balancer solves the biases on."""
    model = modeldef.merge(jax.lax.stop_gradient(params), biases)
    with jax.named_scope(REROUTE_SCOPE):
        _, routing = model.hidden_states(batch["inputs"], batch["segment_ids"], batch["positions"],
                                         schedule=cfg.schedule, scan=cfg.scan_layers, unroll=cfg.scan_unroll)
    return balancing.Rerouted(routing.probs, batch["segment_ids"] > 0)


def make_update_step(modeldef: ModelDef, tx: optax.GradientTransformation, balancer: balancing.Balancer,
                     lr_schedule: Callable, cfg: StepConfig):
    """`update_step(state, grads, sums, batches) -> (state, metrics)`: the train step's second half,
    from the reduced mean gradients and `make_gradient_step`'s sums: the bad-step verdict, the
    Muon/AdamW update, the balancing biases (a re-routing balancer routes the first micro-batch of
    the step's `batches` again, through the updated weights) and the metrics. Benchmarks time it
    apart from the gradients."""
    bias_key = modeldef.bias_key

    def update_step(state: TrainState, grads, sums, batches):
        loss, grad_norm, ntok, routes = sums["loss"], sums["grad_norm"], sums["tokens"], sums["routes"]
        counts = routes[:, balancing.TOKENS]
        bad = step_guard.is_bad(state.guard, loss, grad_norm, cfg.guard)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        guard = step_guard.record(state.guard, loss, grad_norm, bad)
        # A select per state leaf; XLA fuses it into the update's own elementwise pass (the census
        # shows no pass of its own), so skipping costs no traffic. Made before the re-route, so
        # the old weights are dead by its forward.
        kept = step_guard.keep_if_bad(bad, dataclasses.replace(state, guard=guard), TrainState(
            state.step + 1, optax.apply_updates(state.params, updates), state.biases, opt_state,
            state.balance_state, guard))
        evidence = routes
        if balancer.reroutes:
            params = kept.params
            if cfg.param_shardings is not None:
                params = jax.lax.with_sharding_constraint(params, cfg.param_shardings)
            evidence = reroute(modeldef, params, state.biases, jax.tree.map(lambda x: x[0], batches), cfg)
        balanced = balancing.update_biases(state.biases, evidence, bias_key, balancer, state.balance_state)
        biases, balance_state = step_guard.keep_if_bad(bad, (state.biases, state.balance_state), balanced)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(state.step),
                   "tokens": ntok, "expert_load": balancing.load_fractions(counts), **balancing.load_summary(counts),
                   "layer_prob_spread": balancing.probability_moments(routes)[1][:, :-1].mean(-1),
                   "bad_step": bad, "bad_steps": guard.bad_total, "consecutive_bad_steps": guard.consecutive}
        return dataclasses.replace(kept, biases=biases, balance_state=balance_state), metrics

    return update_step


def make_train_step(modeldef: ModelDef, tx: optax.GradientTransformation, balancer: balancing.Balancer,
                    lr_schedule: Callable, cfg: StepConfig):
    """`train_step(state, batches) -> (state, metrics)`; `batches` leaves are [A, b, S]."""
    gradient_step = make_gradient_step(modeldef, cfg)
    update_step = make_update_step(modeldef, tx, balancer, lr_schedule, cfg)

    def train_step(state: TrainState, batches):
        grads, sums = gradient_step(state.params, state.biases, batches)
        return update_step(state, grads, sums, batches)

    return train_step


def make_eval_step(modeldef: ModelDef, cfg: StepConfig):
    """`eval_step(params, biases, batch) -> (loss_sum, tokens)` for one [b, S] batch."""

    def eval_step(params, biases, batch):
        loss, (ntok, _) = batch_sums(modeldef, params, biases, batch, dataclasses.replace(cfg, remat="none"))
        return loss, ntok

    return eval_step


def make_score_step(modeldef: ModelDef, cfg: StepConfig):
    """`score_step(params, biases, batch) -> (log_likelihood [b], greedy [b])` for one [b, S] batch:
    per row, Σ loss_mask · log p(target), and whether every masked-in target is the model's argmax
    (downstream evaluation, `harness/scoring.py`)."""

    def score_step(params, biases, batch):
        model = modeldef.merge(params, biases)
        hidden, _ = model.hidden_states(batch["inputs"], batch["segment_ids"], batch["positions"],
                                        schedule=cfg.schedule, scan=cfg.scan_layers, unroll=cfg.scan_unroll)
        logp, top = token_scores(hidden, params["embedding"], batch["targets"], chunk_size=cfg.vocab_chunk,
                                 matmul_dtype=modeldef.cfg.compute_dtype)
        mask = batch["loss_mask"].astype(jnp.float32)
        return jnp.sum(logp * mask, axis=-1), jnp.all(top | (mask == 0), axis=-1)

    return score_step


def init_state(params, biases: dict, bias_key: str, tx, balancer: balancing.Balancer,
               guard: step_guard.GuardSettings = step_guard.GuardSettings()) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, biases, tx.init(params), balancer.init(biases[bias_key]),
                      step_guard.init(guard))
