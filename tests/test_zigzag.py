"""Zigzag placement (`parallel/zigzag.py`): the permutation, chunk ownership and halo routes, and
the causal balance of the real attention schedule, counted in the Pallas kernel's visited blocks.

The model under zigzag layouts equals one device in `test_layouts.py` (values and gradients) and
`test_train_step.py` (three train steps and the eval step).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from zaya_jax import hardware
from zaya_jax.config import preset
from zaya_jax.explore.step_time import hardware_flops
from zaya_jax.explore.workload import Workload, share
from zaya_jax.kernels import pallas_attention
from zaya_jax.model.cca import PARAM_AXES, CCAttention
from zaya_jax.model.segments import sequence_info
from zaya_jax.parallel import attention_schedule, zigzag
from meshes import fake_mesh, mesh_sizes
from zaya_jax.parallel.rules import named_sharding


def test_device_p_holds_chunks_p_and_2d_minus_1_minus_p():
    assert [zigzag.chunks_of(p, 4, True) for p in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [zigzag.chunks_of(p, 4, False) for p in range(4)] == [(0,), (1,), (2,), (3,)]
    assert zigzag.chunk_order(4, True).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    assert not zigzag.zigzagged(True, 1) and not zigzag.zigzagged(False, 4) and zigzag.zigzagged(True, 4)


def test_place_and_unplace_are_inverse_permutations():
    x = np.arange(2 * 16).reshape(2, 16)
    placed = zigzag.place(x, 2, True)
    # Device 0: chunks 0 and 3 (4 tokens each); device 1: chunks 1 and 2.
    assert placed[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    np.testing.assert_array_equal(zigzag.unplace(placed, 2, True), x)
    np.testing.assert_array_equal(zigzag.unplace(jnp.asarray(placed), 2, True), x)  # jax arrays too
    assert zigzag.place(x, 2, False) is x


def test_halo_routes_come_from_the_holder_of_the_chunk_before():
    routes = zigzag.previous_chunk_routes(4, True)
    # First chunks from the left neighbour's first; second chunks from the right neighbour's
    # second, but for device D-1, whose chunk D follows its own chunk D-1.
    assert [(r.slot, r.source_slot, r.pairs, r.local) for r in routes] == [
        (0, 0, ((0, 1), (1, 2), (2, 3)), ()), (1, 0, (), (3,)), (1, 1, ((1, 0), (2, 1), (3, 2)), ())]
    for devices in (2, 4, 8):
        for route in zigzag.previous_chunk_routes(devices, True):
            for source, dest in route.pairs + tuple((d, d) for d in route.local):
                before = zigzag.chunks_of(dest, devices, True)[route.slot] - 1
                assert zigzag.chunks_of(source, devices, True)[route.source_slot] == before


# ---------------------------------------------------------------------------------------------
# Causal balance: the Pallas forward visits key blocks 0 .. _key_steps(plan, i) - 1 for query
# block i; count them over the plans the real schedule builds, one lax.switch branch per device.

CFG = preset("tiny", attention_kernel="pallas", moe_kernel="xla", norm_kernel="xla")
B, S = 2, 2048


def _visited_blocks_per_device(devices: int, zigzagged: bool) -> list[int]:
    plans = []

    def record(q, k, v, segment_ids, plan):
        plans.append(plan)
        return jnp.zeros_like(q)

    mesh = fake_mesh(sequence=devices, data=8 // devices)
    row = named_sharding(("batch", "length"), mesh)
    params = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=named_sharding(PARAM_AXES[n], mesh, v.shape))
              for n, v in CCAttention(CFG, rngs=nnx.Rngs(0)).params().items()}
    x = jax.ShapeDtypeStruct((8, S, CFG.hidden_size), jnp.float32, sharding=NamedSharding(mesh, P(*row.spec, None)))
    ints = jax.ShapeDtypeStruct((8, S), jnp.int32, sharding=row)

    def layer(params, x, segments, positions):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            seq = sequence_info((8, S), segments, positions, 1)
            return attention_schedule.cca(params, x, seq, CFG, zigzagged=zigzagged)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pallas_attention, "_attention", record)
        jax.jit(layer).trace(params, x, ints, ints)
    per_device = len(plans) // devices  # lax.switch traces the branches in device order
    assert len(plans) == devices * zigzag.chunks_per_device(zigzagged)
    return [sum(_visited(plan) for plan in plans[d * per_device:(d + 1) * per_device]) for d in range(devices)]


def _visited(plan) -> int:
    blocks = plan.q_seq_pad // plan.blocks.block_q
    return sum(int(pallas_attention._key_steps(plan, i)) for i in range(blocks))


@pytest.mark.parametrize("devices", [4, 8])
def test_zigzag_balances_the_attention_blocks_each_device_visits(devices):
    contiguous = _visited_blocks_per_device(devices, zigzagged=False)
    balanced = _visited_blocks_per_device(devices, zigzagged=True)
    assert sum(balanced) == pytest.approx(sum(contiguous), rel=0.02)  # the same work, spread evenly
    assert max(contiguous) / min(contiguous) > devices  # about 2D-1: the last chunk sees that many times the first's keys
    assert max(balanced) / min(balanced) < 1.1


def test_the_explorer_prices_the_busiest_sequence_devices_attention():
    # Zigzag's explorer share comes from the same ownership function: balanced; contiguous: (2D-1)/D.
    assert zigzag.busiest_causal_share(4, True) == 1.0
    assert zigzag.busiest_causal_share(4, False) == pytest.approx(7 / 4)
    run = Workload(preset("tiny"), 4096, 8, 1, "none", hardware.profile("h100"), 1, 8)
    sizes = mesh_sizes(sequence=8)
    contiguous = dataclasses.replace(run, zigzag=False)
    assert hardware_flops(contiguous, sizes, share(contiguous, sizes)) > hardware_flops(run, sizes, share(run, sizes))
