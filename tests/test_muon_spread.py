"""Muon's distributed Newton–Schulz (parallel/muon_spread.py) against the plain batched one, and
its per-device work in the compiled optimizer update falling with the number of devices."""

import math
import re

import jax
import numpy as np
import pytest

from zaya_jax.experiment import load_experiment
from meshes import fake_mesh
from zaya_jax.parallel.muon_spread import spread_matrices
from zaya_jax.train.muon import newton_schulz
from zaya_jax.train.program import build_program
from paths import TINY



@pytest.mark.parametrize("count, per_pass, passes", [(16, 1, 2), (16, 2, 1), (6, 1, 1), (20, 1, 3), (16, 16, 1)],
                         ids=["2 passes of 1", "one pass of 2", "6 padded to one each", "20 padded to 3 passes",
                              "at most 16 a pass: one"])
def test_spread_newton_schulz_equals_the_plain_one(count, per_pass, passes):
    batch = np.random.default_rng(0).normal(size=(count, 8, 12)).astype(np.float32)
    run = spread_matrices(fake_mesh(data=4, fsdp=2), pass_elements=per_pass * 8 * 12)
    fn = jax.jit(lambda b: run(newton_schulz, b))
    np.testing.assert_allclose(fn(batch), jax.jit(newton_schulz)(batch), rtol=2e-5, atol=2e-6)
    loops = re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', fn.lower(batch).compile().as_text())
    assert loops == ([str(passes)] if passes > 1 else [])


@pytest.mark.parametrize("mesh, spec, shape", [
    (dict(fsdp=2, tsp=4), (None, None, "fsdp", "tsp"), (3, 2, 8, 12)),  # 6 matrices padded to 8
    (dict(data=2, expert=4), ("data", "expert", None, None), (4, 4, 8, 12)),  # already whole, by device
    (dict(fsdp=2, tsp=4), (None, "fsdp", "tsp", None), (3, 8, 4, 6)),  # [L, H, nq, d] read as [L, H, nq·d]
], ids=["split matrix dims, padded", "split batch dims", "merged fan-out"])
def test_matrices_held_where_their_state_lives_give_the_plain_newton_schulz(mesh, spec, shape):
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = fake_mesh(**mesh)
    weight = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    mats_shape = (*shape[:-2], shape[-2] * shape[-1]) if shape[-1] == 6 else shape
    run = spread_matrices(mesh, {"w": (P(*spec), shape)})
    fn = jax.jit(lambda w: run(newton_schulz, w.reshape(mats_shape), "w"),
                 in_shardings=NamedSharding(mesh, P(*spec)))
    want = jax.jit(newton_schulz)(weight.reshape(mats_shape))
    np.testing.assert_allclose(fn(weight), want, rtol=2e-5, atol=2e-6)


def _compiled_update(layers, **mesh):
    """The program of the tiny model on `mesh` and its optimizer update compiled with the state placed as in training."""
    overrides = ["--config.train.global_batch_size=8", "--config.train.seq_len=32", "--config.mesh.data=1",
                 f"--config.model.num_hidden_layers={layers}", *[f"--config.mesh.{a}={n}" for a, n in mesh.items()]]
    program = build_program(load_experiment(TINY, overrides), jax.devices()[:math.prod(mesh.values())])
    state, shardings = program.placed_abstract_state(), program.state_shardings

    def update(params, opt_state, grads):
        with jax.sharding.use_abstract_mesh(program.mesh.abstract_mesh):
            return program.tx.update(grads, opt_state, params)

    step = jax.jit(update, in_shardings=(shardings.params, shardings.opt_state, shardings.params))
    return program, step.lower(state.params, state.opt_state, state.params).compile()


def _optimizer_flops(layers, **mesh):
    cost = _compiled_update(layers, **mesh)[1].cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_each_device_orthogonalises_its_share_of_the_matrices():
    # 8 layers: every Muon weight has a multiple of 8 matrices. Newton–Schulz is nearly all of the
    # update's FLOPs, so a device's FLOPs fall by the device count, under data (ZeRO-1) and fsdp.
    one = _optimizer_flops(8, data=1)
    for mesh in (dict(data=8), dict(fsdp=8)):
        assert _optimizer_flops(8, **mesh) / one == pytest.approx(1 / 8, rel=0.05), mesh


@pytest.mark.parametrize("mesh, exchanged", [(dict(tsp=8), True), (dict(fsdp=8), True), (dict(fsdp=2, tsp=4), True),
                                             (dict(data=2, expert=4), False)],
                         ids=["tsp 8", "fsdp 8", "fsdp 2 x tsp 4", "data 2 x expert 4"])
def test_matrices_move_to_the_spread_by_exchange_never_by_gathering_a_whole_weight(mesh, exchanged):
    """A stacked expert weight [L, E, H, I] split on H or I reaches the spread ([L·E] matrices over
    the devices) and comes back by all-to-all; split on L and E (ZeRO-1's data, expert) its
    matrices are already whole. No all-gather in the update rebuilds a whole expert weight (GSPMD
    does, unasked, unless the matrices are pinned where their state lives)."""
    program, compiled = _compiled_update(4, **mesh)
    hlo = compiled.as_text()
    whole = math.prod(program.modeldef.param_shapes["layers/moe/experts/gate"])
    gathered = [math.prod(int(d) for d in dims.split(",")) for dims in re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(", hlo)]
    assert max(gathered, default=0) < whole, (max(gathered), whole)
    assert ("all-to-all(" in hlo) == exchanged
