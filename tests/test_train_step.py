"""The jitted train step: every layout on 8 fake devices trains like one device.

fp32 compute, a few steps of the real step (Muon/AdamW, clipping, balancer, chunked CE,
micro-batch accumulation); losses, gradient norms and final parameters must agree with the
single-device run (the norms because Muon and AdamW are blind to a constant gradient scale).
In bf16, the losses of two steps must agree to bf16 rounding.

The layouts run the Adam balancer, whose bias steps depend on the integer token counts alone, so
the biases (and every routing choice) are bit-identical across layouts. The default `spread` and
the `solve` balancers also read the router probabilities, which differ between layouts in the
last bit (their summation order), and that is enough to flip a token that sits at a tie; their
inputs and biases are compared across layouts on their own.
"""

import re

import jax
import numpy as np
import pytest

from zaya_jax.experiment import load_experiment
from zaya_jax.train import balancing
from zaya_jax.train.optim import rule_for
from zaya_jax.train.program import build_program
from zaya_jax.train.step import make_gradient_step, reroute
from paths import TINY
from synthetic_batches import random_batch

STEPS = 3
NORM_RTOL = 1e-5  # the gradient norm of every step, the layouts' own fp32 summation order apart


def _overrides(balancer="adam", **mesh):
    base = {"train.global_batch_size": 8, "train.seq_len": 32, "train.steps": 10, "optim.warmup_steps": 1,
            "optim.lr": 1e-2, "train.loss_vocab_chunk": 100, "model.num_hidden_layers": 2, "train.scan_unroll": 1,
            "mesh.data": 1, "mesh.fsdp": 1, "mesh.expert": 1, "optim.balancer": balancer}
    if balancer == "adam":
        base["optim.balance_lr"] = 3e-3  # the most adam takes: its steps still show in the biases
    base.update({f"mesh.{k}": v for k, v in mesh.items()})
    return [f"--config.{k}={v}" for k, v in base.items()]


def _run(overrides, devices, steps=STEPS, read_hlo=None):
    """Losses, parameters, biases and gradient norms of `steps` steps; `read_hlo` is handed the
    step's HLO text (the program that then runs)."""
    program = build_program(load_experiment(TINY, overrides), devices=devices)
    state = program.init()
    step = program.jitted_train_step()
    if read_hlo is not None:
        read_hlo(step.lower(program.placed_abstract_state(), program.abstract_batch()).as_text())
    losses, norms = [], []
    for batch in [random_batch(8, 32)] * steps:  # one batch, repeated: the loss must fall
        state, metrics = step(state, program.place_batch(batch))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.array(losses), jax.device_get(state.params), jax.device_get(state.biases), np.array(norms)


@pytest.fixture(scope="module")
def single():
    return _run(_overrides(), jax.devices()[:1])


# Expert-parallel training is checked against the same losses by the resharded-resume tests
# (tests/test_resume.py: fsdp4 x expert2 and expert2 x fsdp2), and its gradients in test_layouts.py.
# data x fsdp x tensor, two micro-batches: the data replicas' loop (parallel/grad_reduction.py, which
# runs for several micro-batches only) with GSPMD axes inside it, where XLA's partitioner aborted
# on its own embedding gather (parallel/embedding_schedule.py now writes that lookup out).
@pytest.mark.parametrize("mesh, accum", [(dict(data=8), 1), (dict(fsdp=8), 1), (dict(tsp=8), 1),
                                         (dict(sequence=4, data=2), 1), (dict(tensor=2, sequence=4), 1),
                                         (dict(data=2, fsdp=2, tensor=2), 2)],
                         ids=lambda v: str(v) if isinstance(v, dict) else f"accum{v}")
def test_layout_trains_like_one_device(single, mesh, accum):
    losses, params, biases, norms = _run(_overrides(**mesh) + [f"--config.train.grad_accum_steps={accum}"],
                                         jax.devices())
    ref_losses, ref_params, ref_biases, ref_norms = single
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=NORM_RTOL)
    assert losses[-1] < losses[0]
    for key in ref_params:
        # atol: each layout sums the embedding's gradient in its own order (per-device scatter-adds,
        # then over the devices: parallel/embedding_schedule.py), and ten Adam steps magnify that
        # fp32 rounding on the smallest gradients (tensor 2 x sequence 4: one of 34,816 entries off by 2.3e-5).
        np.testing.assert_allclose(params[key], ref_params[key], rtol=1e-3, atol=3e-5, err_msg=key)
    for key in ref_biases:
        np.testing.assert_allclose(biases[key], ref_biases[key], atol=1e-6, err_msg=key)


@pytest.mark.parametrize("mesh", [dict(tsp=8), dict(data=2, fsdp=2, tensor=2)], ids=str)
def test_the_spread_balancer_reads_and_moves_the_same_under_a_layout(mesh):
    """The default balancer's inputs (route sums: token counts exactly, probability sums to fp32
    rounding) under a layout and on one device, and the biases it sets from them: the train step's
    own update (`balancing.update_biases`) applied to the route sums of the train step's first half."""
    def first_step(overrides, devices):
        program = build_program(load_experiment(TINY, overrides), devices=devices)
        state = program.init()
        batch = program.place_batch(random_batch(8, 32))
        grads_step = program._under_mesh(make_gradient_step(program.modeldef, program.step_cfg))
        _, sums = jax.jit(grads_step)(state.params, state.biases, batch)
        biases, _ = balancing.update_biases(state.biases, sums["routes"], program.modeldef.bias_key, program.balancer,
                                            state.balance_state)
        return np.asarray(sums["routes"]), jax.device_get(state.biases), jax.device_get(biases)

    routes, _, biases = first_step(_overrides("spread", **mesh), jax.devices())
    ref_routes, before, ref_biases = first_step(_overrides("spread"), jax.devices()[:1])
    np.testing.assert_array_equal(routes[:, balancing.TOKENS], ref_routes[:, balancing.TOKENS])
    np.testing.assert_allclose(routes, ref_routes, rtol=1e-5)
    for key in ref_biases:
        assert np.abs(ref_biases[key] - before[key]).max() > 1e-3  # the step moved them
        np.testing.assert_allclose(biases[key], ref_biases[key], atol=1e-6, err_msg=key)


def test_zigzag_layout_trains_and_evaluates_like_one_device(single):
    # tsp4 x data2: 8 zigzag chunks of 4 tokens (placed by the program); the eval step too.
    overrides = _overrides(tsp=4, data=2)
    losses, params, _, norms = _run(overrides, jax.devices())
    np.testing.assert_allclose(losses, single[0], rtol=2e-5)
    np.testing.assert_allclose(norms, single[3], rtol=NORM_RTOL)
    programs = [build_program(load_experiment(TINY, o), devices=d)
                for o, d in ((overrides, jax.devices()), (_overrides(), jax.devices()[:1]))]
    assert [p.zigzagged for p in programs] == [True, False]
    batch = random_batch(8, 32, seed=1)
    evals = [jax.device_get(p.jitted_eval_step()(single[1], single[2], p.place_eval_batch(batch, 8)))
             for p in programs]
    np.testing.assert_allclose(evals[0], evals[1], rtol=2e-5)


def test_parameters_are_sharded_as_the_rules_say():
    program = build_program(load_experiment(TINY, _overrides(fsdp=2, expert=4)), devices=jax.devices())
    state = program.init()
    wq = state.params["layers/attn/wq"]  # [L, H, nq, d]: the layer axis whole, H over fsdp
    gate = state.params["layers/moe/experts/gate"]  # [L, E, H, I]: E over expert, H over fsdp
    assert tuple(wq.sharding.spec[:2]) == (None, "fsdp")
    assert tuple(gate.sharding.spec[:3]) == (None, "expert", "fsdp")
    assert gate.addressable_shards[0].data.shape == (2, 1, 64, 128)
    flat = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]  # moments follow their parameter
    moments = [x for path, x in flat if "'layers/moe/experts/gate'" in jax.tree_util.keystr(path)]
    assert moments and all(x.sharding.spec == gate.sharding.spec for x in moments)
    # Where the 4 experts divide over expert x fsdp, fsdp splits the experts, not their hidden dimension.
    split = build_program(load_experiment(TINY, _overrides(fsdp=2, expert=2)), devices=jax.devices()[:4])
    assert tuple(split.param_shardings()["layers/moe/experts/gate"].spec[:3]) == (None, ("expert", "fsdp"), None)


@pytest.fixture(scope="module")
def fsdp_experts_step():
    """The compiled step (HLO text) of fsdp 2 x sequence 4 without remat, and the experts' [L, E, H, I]."""
    program = build_program(load_experiment(TINY, _overrides(fsdp=2, sequence=4) + ["--config.train.remat=none"]),
                            devices=jax.devices())
    hlo = program.jitted_train_step().lower(program.placed_abstract_state(), program.abstract_batch()).compile().as_text()
    return hlo, program.modeldef.param_shapes["layers/moe/experts/gate"]


def test_experts_fsdp_shards_are_gathered_without_relaying_out_the_layers(fsdp_experts_step):
    # Left to GSPMD, the backward gathered each layer's [1, E/fsdp, H, I] slice of the scanned
    # weights on its experts' dimension, and XLA made that dimension major over the layers: a
    # copy of every layer's expert shards before the loop, held through the step
    # (parallel/experts_schedule.py). Every array of the stacked shards' shape keeps their layout.
    hlo, (layers, experts, hidden, width) = fsdp_experts_step
    shard = f"f32[{layers},{experts // 2},{hidden},{width}]"
    layouts = set(re.findall(re.escape(shard) + r"(\{[0-9,]*\})", hlo))
    assert layouts == {"{3,2,1,0}"}, f"{shard} relaid out as {layouts - {'{3,2,1,0}'}}"


def test_a_backward_without_remat_does_not_keep_the_experts_gathered_layers(fsdp_experts_step):
    # The schedule's all-gathered layer [E, H, I] is made again in the backward
    # (model/remat.without_weight_copies); kept, the layer scan would stack every layer's,
    # [L, E, H, I] on each device, where fsdp stores [L, E/fsdp, H, I].
    hlo, (layers, experts, hidden, width) = fsdp_experts_step
    stacked = [f"[{layers},{experts},{hidden},{width}]", f"[{layers},{experts},{width},{hidden}]"]
    assert [hlo.count(s) for s in stacked] == [0, 0]


def test_gradient_accumulation_matches_one_big_batch(single):
    losses, params, _, norms = _run(_overrides() + ["--config.train.grad_accum_steps=4"], jax.devices()[:1])
    np.testing.assert_allclose(losses, single[0], rtol=2e-5)
    np.testing.assert_allclose(norms, single[3], rtol=NORM_RTOL)
    for key in params:
        np.testing.assert_allclose(params[key], single[1][key], rtol=1e-3, atol=2e-5, err_msg=key)


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_policies_do_not_change_the_numbers(single, policy):
    losses = _run(_overrides() + [f"--config.train.remat={policy}"], jax.devices()[:1])[0]
    np.testing.assert_allclose(losses, single[0], rtol=1e-5)


PALLAS = ["--config.model.attention_kernel=pallas", "--config.model.moe_kernel=pallas",
          "--config.model.norm_kernel=pallas"]


def _shard_maps(hlo: str) -> int:
    return hlo.count("sdy.manual_computation")


def _lowered_hlo(overrides) -> str:
    program = build_program(load_experiment(TINY, overrides), devices=jax.devices())
    return program.jitted_train_step().lower(program.placed_abstract_state(), program.abstract_batch()).as_text()


def test_pallas_kernels_run_per_batch_shard_and_train_like_one_device(single):
    # Pallas kernels (interpret mode here) are opaque to GSPMD on a GPU, so the model shard_maps
    # them over the batch axes; the run must still match the single-device XLA-kernel run.
    overrides = _overrides(data=4, fsdp=2) + PALLAS
    # One shard_map per kernel call (per layer: attention, three norms and the experts' schedule; then
    # the final norm), and one more for each call's transpose in the backward, and per layer one
    # where the backward casts and fuses the experts' weights again (remat.without_weight_copies).
    # Unrolled, every layer has its own; scanned, the block body holds them once, and JAX's partial
    # evaluation of the scan stages the experts' schedule once more in the backward (it sorts the
    # tokens again).
    # One micro-batch: no data replicas' loop around them (parallel/grad_reduction.py; see
    # tests/test_gpu_lowering.py for kernels inside it). Two more: the embedding lookup's forward
    # and backward (parallel/embedding_schedule.py; fsdp splits the table). And one per Muon weight
    # in the update (parallel/muon_spread.py).
    layers = load_experiment(TINY, overrides).model.num_hidden_layers
    lookup = 2
    muon = sum(rule_for(path).optimizer == "muon" for path in
               build_program(load_experiment(TINY, overrides), devices=jax.devices()).modeldef.param_axes)
    assert _shard_maps(_lowered_hlo(overrides + ["--config.train.scan_layers=false"])) == \
        2 * (5 * layers + 1) + layers + lookup + muon, "a Pallas kernel is not shard_mapped over the batch axes"
    scanned = []  # the run's own program: one block per scan iteration (train.scan_unroll=1)
    losses, params, _, norms = _run(overrides, jax.devices(), read_hlo=lambda hlo: scanned.append(_shard_maps(hlo)))
    assert scanned == [2 * (5 + 1) + 1 + 1 + lookup + muon]
    ref_losses, ref_params, _, ref_norms = single
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=NORM_RTOL)
    for key in ref_params:
        np.testing.assert_allclose(params[key], ref_params[key], rtol=1e-3, atol=2e-5, err_msg=key)


# bf16 compute (fp32 master weights and islands) under every layout family: the steps compile on
# XLA's CPU compiler (which aborts on them unless the schedules' shard_maps are manual over
# every mesh axis, see parallel/batch_map.schedule_map) and the losses stay within bf16 rounding of
# one device's. fsdp alone runs the experts' schedule only, TSP both schedules; the two mixes add
# expert, tensor, sequence and data. One layer, two steps without warmup: the second loss is
# after a full-lr update.
BF16 = ["--config.model.compute_dtype=bfloat16", "--config.model.num_hidden_layers=1", "--config.optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def single_bf16():
    return _run(_overrides() + BF16, jax.devices()[:1], steps=2)[0]


@pytest.mark.parametrize("mesh", [dict(fsdp=8), dict(tsp=8), dict(tsp=2, fsdp=2, expert=2),
                                  dict(tensor=2, sequence=2, data=2)], ids=str)
def test_bf16_layout_trains_like_one_device(single_bf16, mesh):
    losses = _run(_overrides(**mesh) + BF16, jax.devices(), steps=2)[0]
    np.testing.assert_allclose(losses[0], single_bf16[0], rtol=1e-5)  # the forward: bf16 matmuls, fp32 loss
    np.testing.assert_allclose(losses[1], single_bf16[1], rtol=2e-3)  # after a step (measured: 5e-4 at most)
    assert losses[1] < losses[0] - 0.5


HYBRID = ["--config.model.layer_pattern=LC", "--config.model.linear_decay=retention"]


@pytest.fixture(scope="module")
def single_hybrid():
    return _run(_overrides() + HYBRID, jax.devices()[:1])


@pytest.mark.parametrize("mesh", [dict(sequence=4, data=2), dict(tsp=4, data=2), dict(tensor=2, sequence=2, fsdp=2)],
                         ids=str)
def test_hybrid_model_trains_like_one_device(single_hybrid, mesh):
    # A linear-attention layer (LASP-2, zigzag placement) before a CCA layer.
    losses, params, _, norms = _run(_overrides(**mesh) + HYBRID, jax.devices())
    ref_losses, ref_params, _, ref_norms = single_hybrid
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=NORM_RTOL)
    assert losses[-1] < losses[0]
    assert ref_params["layers/linear_attn/wq"].shape[0] == 1  # one L layer, stacked apart from CCA's
    for key in ref_params:
        np.testing.assert_allclose(params[key], ref_params[key], rtol=1e-3, atol=2e-5, err_msg=key)


def _solve_step(overrides, devices, updated=True):
    """The second train step (the first one's learning rate is 0), and beside it the `solve` balancer
    run by hand on the first micro-batch routed through the step's updated weights (`updated`) or
    the weights it started from."""
    program = build_program(load_experiment(TINY, overrides), devices=devices)
    step, batch = program.jitted_train_step(), program.place_batch(random_batch(8, 32))
    state, _ = step(program.init(), batch)
    before = jax.device_get(state)
    new, _ = step(state, batch)
    weights = new.params if updated else jax.device_put(before.params, program.state_shardings.params)
    route = program._under_mesh(lambda p, b, x: reroute(program.modeldef, p, b, x, program.step_cfg))
    first = jax.tree.map(lambda x: x[0], batch)
    rerouted = jax.jit(route)(weights, jax.device_put(before.biases), first)
    key = program.modeldef.bias_key
    by_hand, _ = program.balancer.update(jax.numpy.asarray(before.biases[key]), rerouted, ())
    return np.asarray(rerouted.probs), before.biases[key], jax.device_get(new.biases[key]), np.asarray(by_hand)


def test_the_solve_balancer_solves_on_the_routing_of_the_updated_model():
    """`solve`: the step's new biases are the solve on its first micro-batch routed by
    the weights after the optimizer step, not by the weights the step's gradients were taken at."""
    overrides = _overrides("solve")
    _, before, stepped, by_hand = _solve_step(overrides, jax.devices()[:1])
    assert np.abs(stepped - before).max() > 1e-3  # the step moved them
    np.testing.assert_allclose(stepped, by_hand, atol=1e-6)
    _, _, _, stale = _solve_step(overrides, jax.devices()[:1], updated=False)
    assert np.abs(stale - stepped).max() > 1e-4


@pytest.mark.parametrize("mesh", [dict(tsp=8), dict(data=2, expert=4)], ids=str)
def test_the_solve_balancer_routes_and_moves_the_same_under_a_layout(mesh):
    """The re-routed probabilities under a layout equal one device's to fp32 rounding (each class's
    sorted values: a sequence layout places the tokens in its own order), and the biases solved on
    them agree (a token at a tie or on a margin edge may count on the other side)."""
    probs, _, biases, _ = _solve_step(_overrides("solve", **mesh), jax.devices())
    ref_probs, _, ref_biases, _ = _solve_step(_overrides("solve"), jax.devices()[:1])

    def per_class(p):
        return np.sort(p.reshape(p.shape[0], -1, p.shape[-1]), axis=1)

    np.testing.assert_allclose(per_class(probs), per_class(ref_probs), atol=1e-5)
    np.testing.assert_allclose(biases, ref_biases, atol=1e-4)


def test_the_gradient_step_then_the_update_step_is_the_train_step():
    """The halves benchmarks time apart (`Program.jitted_gradient_step`, `jitted_update_step`)
    compose to the train step, two steps running (the second from the first's state), to fp32
    rounding: three programs fuse their fp32 sums apart."""
    program = build_program(load_experiment(TINY, _overrides()), devices=jax.devices()[:1])
    whole, halves = program.init(), program.init()
    step, gradient, update = program.jitted_train_step(), program.jitted_gradient_step(), program.jitted_update_step()
    for batch in (random_batch(8, 32), random_batch(8, 32, seed=1)):
        placed = program.place_batch(batch)
        whole, metrics = step(whole, placed)
        grads, sums = gradient(halves.params, halves.biases, placed)
        halves, split = update(halves, grads, sums, placed)
        np.testing.assert_allclose(float(split["loss"]), float(metrics["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(jax.device_get(whole)), jax.tree.leaves(jax.device_get(halves))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
