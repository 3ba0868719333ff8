"""Gradients reduced once per step (parallel/grad_reduction.py) and ZeRO-1 (optim.shard_over_data):
counted in the compiled train step on fake CPU devices with explore/hlo_census.py, and the reduced
gradients themselves (not only what Muon/AdamW make of them) equal to one device's."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from zaya_jax.experiment import load_experiment
from zaya_jax.explore.hlo_census import census, total
from meshes import fake_mesh
from zaya_jax.train.program import build_program
from zaya_jax.train import balancing
from zaya_jax.train.step import make_gradient_step
from paths import TINY
from synthetic_batches import random_batch

RUN = ["--config.train.global_batch_size=16", "--config.train.seq_len=32", "--config.model.num_hidden_layers=2",
       "--config.train.scan_unroll=1",
       "--config.train.loss_vocab_chunk=100", "--config.mesh.data=1"]


def _program(accum, *extra, **mesh):
    overrides = RUN + [f"--config.train.grad_accum_steps={accum}", *extra]
    overrides += [f"--config.mesh.{axis}={size}" for axis, size in mesh.items()]
    return build_program(load_experiment(TINY, overrides), jax.devices()[:math.prod(mesh.values())])


def _over_data(program):
    """(op, bytes, runs) of every reduction spanning `data` in the compiled step."""
    compiled, _ = program.compile_train_step()
    return sorted((c.op, c.bytes, c.runs) for c in census(compiled.as_text(), dict(program.mesh.shape))
                  if c.op in ("all-reduce", "reduce-scatter") and "data" in c.axes)


def _solve_sums(program):
    """(op, bytes, runs) of the solve balancer's margin counts summed over the replicas: tokens per
    class and two counts per class and edge, fp32, once per solve iteration."""
    layers, classes = program.modeldef.cfg.num_hidden_layers, program.modeldef.cfg.num_experts + 1
    return ("all-reduce", 4 * layers * classes * (1 + 2 * len(balancing.EDGES)), balancing.SOLVE_ITERATIONS)


def _shard_bytes(program, shardings, keys):
    shapes = program.modeldef.param_shapes
    return sum(4 * math.prod(shardings[k].shard_shape(shapes[k])) for k in keys)


@pytest.mark.parametrize("mesh", [dict(data=2), dict(data=2, fsdp=2, tsp=2)], ids=str)
def test_gradients_are_reduced_over_data_once_per_step_whatever_the_micro_batch_count(mesh):
    # The same reductions, not twice as many; and none sized by the micro-batch (the re-route's
    # forward runs on each replica's rows, not on activations gathered over data).
    program = _program(4, **mesh)
    two, four = _over_data(_program(2, **mesh)), _over_data(program)
    assert two == four
    # None inside the micro-batch loop; the solve's counts once per its iterations.
    assert [r for r in four if r[2] != 1] == [_solve_sums(program)]


def test_a_one_iteration_layer_scan_copies_no_weights_outside_the_micro_batch_loop():
    """What the forward makes from the weights alone (the experts' gathered and fused weights) is
    loop-invariant in the micro-batch loop; where the layer scan is one iteration (no loop of its
    own) XLA's loop-invariant code motion lifted it out and held every layer's copy through the
    whole step. The weights pass a barrier with each micro-batch (`train/step.py`)."""
    program = _program(2, "--config.train.scan_unroll=2", fsdp=2)  # two layers: one scan iteration
    hlo = program.compile_train_step()[0].as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}\n")]  # the step's own computation, outside every loop
    lifted = [line.split(" = ")[0].strip() for line in entry.splitlines() if re.search(r'op_name="[^"]*jvp\([^"]*/experts/', line)]
    assert "while(" in entry and not lifted, lifted


@pytest.mark.parametrize("mesh", [dict(data=2), dict(data=2, fsdp=2, expert=2)], ids=str)
def test_zero1_reduce_scatters_each_split_gradient_onto_its_optimizer_shard(mesh):
    """Each device reduces its own tiles of a weight split over other axes too: GSPMD had gathered
    such a gradient whole before the reduction over the manual `data` (the reduce-scatters' results
    then half the whole weight, not half the device's shard)."""
    program = _program(2, **mesh)
    reductions = _over_data(program)
    split = [k for k, dim in program.data_split.items() if dim is not None]
    # Over data alone every weight of the tiny model splits; a norm already split over fsdp does not.
    assert split and (len(split) == len(program.data_split) or len(mesh) > 1)
    scattered = sum(b * runs for op, b, runs in reductions if op == "reduce-scatter")
    assert scattered == _shard_bytes(program, program.optimizer_shardings(), split)


def test_without_zero1_every_gradient_is_all_reduced_once():
    program = _program(4, "--config.optim.shard_over_data=false", data=2)
    reductions = _over_data(program)
    assert not [r for r in reductions if r[0] == "reduce-scatter"]
    grads = _shard_bytes(program, program.param_shardings(), program.data_split)
    # The gradients, plus the loss, token count and expert counts [L, E+1] summed with them, and
    # the bad-step guard's two norms: a few hundred bytes of scalars XLA packs in beside them. The
    # solve balancer's counts are their own.
    reductions.remove(_solve_sums(program))
    summed = sum(b * runs for _, b, runs in reductions)
    assert grads <= summed <= grads + 1024


def test_zero1_divides_the_optimizer_states_device_bytes_by_the_data_degree():
    off, on = _program(1, "--config.optim.shard_over_data=false", data=8), _program(1, data=8)
    measured = [p.lower_train_step().compile().memory_analysis().argument_size_in_bytes for p in (off, on)]

    def moments(program):  # per-device bytes of each optimizer moment, as the program places it
        placed = jax.tree.leaves(program.placed_abstract_state().opt_state)
        return [4 * math.prod(x.sharding.shard_shape(x.shape)) for x in placed if x.ndim > 0]

    whole, split = moments(off), moments(on)
    assert measured[0] - measured[1] == sum(whole) - sum(split)  # params, batch and scalars unchanged
    assert sum(split) <= sum(whole) / 8 * 1.01  # all but a few bytes of it split 8 ways


@functools.cache
def _one_step(accum, **mesh):
    """(loss, grad_norm, params) of the train step's first step on `_batch`, as logged."""
    program = _program(accum, "--config.optim.lr=1e-2", "--config.optim.warmup_steps=1", **mesh)
    state, step = program.init(), program.jitted_train_step()
    state, metrics = step(state, program.place_batch(_batch(program)))
    return float(metrics["loss"]), float(metrics["grad_norm"]), jax.device_get(state.params)


def test_the_data_replicas_micro_batch_loop_equals_one_device():
    # The same batch in 4 micro-batches on data=2 (ZeRO-1) and in one on one device: loss, gradient
    # norm and update. Muon and AdamW are blind to a constant gradient scale: the norm is not.
    loss, norm, params = _one_step(4, data=2)
    ref_loss, ref_norm, ref_params = _one_step(1, data=1)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-6)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)
    for key in ref_params:
        np.testing.assert_allclose(params[key], ref_params[key], rtol=1e-4, atol=2e-6, err_msg=key)


def test_logged_loss_is_the_masked_mean_of_per_token_cross_entropy():
    """The train step's `loss` on 4 micro-batches over data=2, with padding and masked tokens and a
    vocabulary chunk (100) that does not divide the vocabulary (272), against float64 numpy:
    log-softmax of the model's full logits at the initial parameters, averaged over the mask."""
    program = _program(1, data=1)
    assert program.modeldef.cfg.vocab_size % program.exp.config.train.loss_vocab_chunk != 0
    batch = _batch(program)
    params, biases = _initial()
    forward = jax.jit(lambda p, b, x: program.modeldef.merge(p, b)(x["inputs"], x["segment_ids"], x["positions"]))
    logits = np.asarray(forward(params, biases, batch), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    token_ce = -np.take_along_axis(log_probs, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"]
    assert 0 < mask.sum() < 0.9 * mask.size  # padding and masked tokens both left out
    np.testing.assert_allclose(_one_step(4, data=2)[0], (token_ce * mask).sum() / mask.sum(), rtol=2e-6)


def _batch(program):
    """Padding and masked tokens: the mean is over the mask's count, not the batch's tokens."""
    config = program.exp.config.train
    return random_batch(config.global_batch_size, config.seq_len, padded_tails=True)


def _gradients(accum, *extra, **mesh):
    """The train step's reduced mean gradients and their norm (`step.make_gradient_step`, the code
    path training runs) at the initial parameters, jitted with the program's shardings."""
    program = _program(accum, *extra, **mesh)
    params, biases = _initial()  # the same seed's init on any layout; its compile skipped
    step = program._under_mesh(make_gradient_step(program.modeldef, program.step_cfg))
    sh = program.state_shardings
    step = jax.jit(step, in_shardings=(sh.params, sh.biases, program.batch_sharding()))
    grads, sums = step(params, biases, program.place_batch(_batch(program)))
    return jax.device_get(grads), float(sums["grad_norm"])


@functools.cache
def _initial():
    state = _program(1, data=1).init()
    return jax.device_get(state.params), jax.device_get(state.biases)


@functools.cache
def _one_device_gradients():
    return _gradients(1, data=1)


# One micro-batch: GSPMD reduces inside the backward. Several on data > 1: the replicas' loop
# (parallel/grad_reduction.py), reduce-scattered onto ZeRO-1's shards (on by default; every weight of
# the tiny model splits) or, with it off, all-reduced. Three compiles cover the layout families;
# tests/test_train_step.py checks the norm under more layouts.
@pytest.mark.parametrize("accum, mesh, extra", [
    (1, dict(data=2, fsdp=2, sequence=2), ()),
    (2, dict(data=2, fsdp=2, tsp=2), ()),
    (4, dict(data=2, sequence=2), ("--config.optim.shard_over_data=false",)),
], ids=["accum1-data2-fsdp2-sequence2", "accum2-data2-fsdp2-tsp2-zero1", "accum4-data2-sequence2"])
@pytest.mark.slow
def test_reduced_gradients_and_their_norm_equal_one_devices(accum, mesh, extra):
    grads, norm = _gradients(accum, *extra, **mesh)
    ref_grads, ref_norm = _one_device_gradients()
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)
    for key, ref in ref_grads.items():
        # fp32 sums in another order: within 1e-5 of the largest entry of that gradient
        np.testing.assert_allclose(grads[key], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=key)


def test_census_counts_a_collective_once_per_loop_iteration_and_names_its_axes():
    mesh = fake_mesh(data=2, tsp=2)

    def body(x):
        def step(_, y):
            return jax.lax.psum(y, "data") * 0.5
        return jax.lax.fori_loop(0, 3, step, x) + jax.lax.psum(x, "tsp")

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("data", "tsp")), out_specs=P(("data", "tsp")),
                               check_vma=False))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(("data", "tsp"))))
    found = census(fn.lower(x).compile().as_text(), dict(mesh.shape))
    assert total(found, "all-reduce", "data") == (3, 3 * 2 * 4 * 4)  # [2, 4] f32 per device, 3 times
    assert total(found, "all-reduce", "tsp") == (1, 2 * 4 * 4)
