"""The mesh's embedding lookup (`parallel/embedding_schedule.py`) against `jnp.take` on one device,
values and the table's gradient, and the compiled step it keeps from gathering the global batch."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshes import fake_mesh
from paths import TINY
from zaya_jax.experiment import load_experiment
from zaya_jax.parallel.batch_map import rows_held_whole
from zaya_jax.parallel.embedding_schedule import lookup
from zaya_jax.parallel.rules import named_sharding
from zaya_jax.train.program import build_program

BATCH, LENGTH, VOCAB, WIDTH = 8, 8, 40, 16

LAYOUTS = [dict(fsdp=8), dict(tsp=8), dict(fsdp=2, tsp=4), dict(fsdp=2, tsp=2, tensor=2), dict(tensor=4, sequence=2),
           dict(data=2, fsdp=2, tsp=2), dict(fsdp=4, expert=2), dict(expert=2, tsp=2, sequence=2)]


def _case(seed=0):
    rng = np.random.RandomState(seed)
    table = jnp.asarray(rng.randn(VOCAB, WIDTH), jnp.float32)
    ids = rng.randint(0, VOCAB, (BATCH, LENGTH))
    ids[0, :4] = [0, VOCAB - 1, 7, 7]  # both ends of the vocabulary (the slices' edges), a repeated row
    cot = jnp.asarray(rng.randn(BATCH, LENGTH, WIDTH), jnp.float32)
    return table, jnp.asarray(ids, jnp.int32), cot


def _rows_and_grad(fn, table, ids, cot):
    @jax.jit
    def run(table, ids):
        rows, pull = jax.vjp(lambda t: fn(t, ids), table)
        return rows, pull(cot)[0]

    return run(table, ids)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_lookup_equals_one_device_take(layout):
    """Each device's rows and the table's gradient (a scatter-add summed over every device that
    read the row) equal `jnp.take` on one device, wherever the layout splits the table and ids."""
    table, ids, cot = _case()
    want_rows, want_grad = _rows_and_grad(lambda t, i: jnp.take(t, i, axis=0), table, ids, cot)

    mesh = fake_mesh(**layout)
    rows = named_sharding(("batch", "length"), mesh)
    table_sharding = named_sharding(("vocab", "embed"), mesh, table.shape)
    placed = (jax.device_put(table, table_sharding), jax.device_put(ids, rows),
              jax.device_put(cot, NamedSharding(mesh, P(*rows.spec, None))))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        got_rows, got_grad = _rows_and_grad(lookup, *placed)
    np.testing.assert_array_equal(np.asarray(got_rows), np.asarray(want_rows))
    np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-6, atol=1e-6)
    assert got_grad.sharding.is_equivalent_to(table_sharding, 2)


def test_inside_the_data_replicas_loop_each_replica_sums_only_its_own_rows():
    """Under `rows_held_whole(("data",))` (the replicas' micro-batch loop) the lookup leaves `data`
    to the caller: each replica's table gradient is of its own rows alone, reduced once outside."""
    table, ids, cot = _case(seed=1)
    mesh = fake_mesh(data=2, fsdp=2, tsp=2)

    def replica(table, ids, cot):
        with rows_held_whole(("data",)):
            rows, pull = jax.vjp(lambda t: lookup(t, ids), table)
            return rows, pull(cot)[0]

    mapped = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                   out_specs=(P("data"), P("data")), axis_names={"data"}, check_vma=False))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        got_rows, got_grads = mapped(table, ids, cot)
    half = BATCH // 2
    for r in range(2):
        want_rows, want_grad = _rows_and_grad(lambda t, i: jnp.take(t, i, axis=0), table,
                                              ids[r * half:(r + 1) * half], cot[r * half:(r + 1) * half])
        np.testing.assert_array_equal(np.asarray(got_rows[r * half:(r + 1) * half]), np.asarray(want_rows))
        np.testing.assert_allclose(np.asarray(got_grads[r * VOCAB:(r + 1) * VOCAB]), np.asarray(want_grad),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mesh_axes", [("fsdp", 4, "tsp", 2), ("data", 2, "fsdp", 2, "tsp", 2)], ids=str)
def test_a_step_never_gathers_the_global_batchs_embeddings(mesh_axes):
    """XLA's own gather moved the global micro-batch's rows [B, S, H] onto every device under fsdp
    and tsp; the compiled step holds no buffer of that shape, only each device's own rows."""
    sizes = dict(zip(mesh_axes[::2], mesh_axes[1::2]))
    overrides = ["--config.train.seq_len=32", "--config.train.global_batch_size=8",
                 "--config.model.num_hidden_layers=1"] + [f"--config.mesh.{a}={n}" for a, n in
                                                           {"data": 1, **sizes}.items()]
    program = build_program(load_experiment(TINY, overrides))
    hlo = program.compile_train_step()[0].as_text()
    hidden = program.modeldef.cfg.hidden_size
    shapes = set(re.findall(rf"f32\[(\d+),(\d+),{hidden}\]", hlo))
    assert ("8", "32") not in shapes, sorted(shapes)
    assert shapes, "no [rows, tokens, hidden] buffers found: the pattern no longer reads this HLO"
