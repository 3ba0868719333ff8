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
    (dict(data=2, expert=4), (None, "data", None), (1, 8, 12)),  # 1 matrix: the expert replicas sum it back
    (dict(data=2, expert=2, tsp=2), (None, "data", None), (8, 8, 12)),  # 4 each, gathered over expert x tsp
    (dict(data=2, expert=4), (None, "data", None), (10, 8, 12)),  # 5 each: 2 a replica, the last 2 padding
], ids=["split matrix dims, padded", "split batch dims", "merged fan-out", "one matrix, summed back",
        "gathered over two axes", "gathered, padded"])
def test_matrices_held_where_their_state_lives_give_the_plain_newton_schulz(mesh, spec, shape):
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = fake_mesh(**mesh)
    weight = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    mats_shape = (*shape[:-2], shape[-2] * shape[-1]) if shape[-1] == 6 else shape
    run = spread_matrices(mesh, {"w": (P(*spec), shape)})

    def spread(fn):
        return jax.jit(lambda w: run(fn, w.reshape(mats_shape), "w"), in_shardings=NamedSharding(mesh, P(*spec)))

    # A map of whole matrices that rounds nothing (each reversed, rows and columns, and tripled)
    # comes back bit for bit: every matrix met whole and went back to its own place.
    turned = lambda x: x[..., ::-1, ::-1] * 3
    np.testing.assert_array_equal(spread(turned)(weight), turned(weight.reshape(mats_shape)))
    # Newton–Schulz's fp32 rounding depends on how XLA lays out and orders the matmuls, which
    # differ where the matrices arrive by all-to-all; its five quintic steps amplify that (up to
    # 1.2e-5 here against the plain one's, both within 1.2e-5 of float64).
    want = jax.jit(newton_schulz)(weight.reshape(mats_shape))
    np.testing.assert_allclose(spread(newton_schulz)(weight), want, rtol=2e-5, atol=2e-5)


def _collectives(hlo: str) -> list[tuple[str, int]]:
    """(op, elements of its result per device, a tuple's summed) for each collective in `hlo`."""
    out = []
    for result, op in re.findall(r"= (\([^)]*\)|\S+) (all-to-all|all-gather|all-reduce|collective-permute)\(", hlo):
        dims = re.findall(r"f32\[([\d,]+)\]", result)
        out.append((op.replace("-", "_"), sum(math.prod(int(d) for d in shape.split(",")) for shape in dims)))
    return out


def test_a_weight_of_few_matrices_moves_no_more_than_its_matrices():
    """One [128, 256] matrix whose state is split on its rows over `data` and repeated over 4
    `expert` replicas: its halves meet by one all-to-all and the result comes back as that one
    matrix. Left to GSPMD, the batch was padded to 8 matrices (one per device) before it moved:
    every device sent and received a quarter of all 8, and gathered 4 of them back."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh, spec, shape = fake_mesh(data=2, expert=4), P(None, "data", None), (1, 128, 256)
    run = spread_matrices(mesh, {"w": (spec, shape)})
    fn = jax.jit(lambda w: run(newton_schulz, w * 2, "w"), in_shardings=NamedSharding(mesh, spec),
                 out_shardings=NamedSharding(mesh, spec))
    moved = [elements for _, elements in _collectives(fn.lower(np.zeros(shape, np.float32)).compile().as_text())]
    assert moved and max(moved) == 128 * 256, moved


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


@pytest.mark.parametrize("layers, mesh", [(4, dict(data=2, expert=4)), (4, dict(data=2, fsdp=2, expert=2)),
                                          (4, dict(tensor=2, sequence=4)), (1, dict(data=2, expert=4))],
                         ids=["data 2 x expert 4", "data 2 x fsdp 2 x expert 2", "tensor 2 x sequence 4",
                              "one layer: summed back"])
def test_the_explorer_prices_the_spreads_collectives_as_compiled(layers, mesh):
    """The bytes each kind of collective in the compiled update moves per device (scalars aside: the
    gradient norm's sum) are those `explore.step_time` prices for Muon's spread: the exchanges'
    padded tiles, the gather's padded parts, and the sum where a gather would be mostly padding.
    Under fsdp the experts' state splits over fsdp on the expert dimension, between whole matrices."""
    from collections import Counter

    from zaya_jax import hardware
    from zaya_jax.explore import step_time
    from zaya_jax.explore.workload import Workload

    program, compiled = _compiled_update(layers, **mesh)
    moved = Counter()
    for op, elements in _collectives(compiled.as_text()):
        moved[op] += 4 * elements
    run = Workload.from_experiment(program.exp, hardware.profile("cpu"), 1, 8)
    priced = Counter()
    for t in step_time.transfers(run, dict(program.mesh.shape)):
        if t.what.startswith("Muon's"):
            priced[t.op] += t.nbytes * t.calls
    assert priced == moved
