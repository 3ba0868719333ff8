"""Who writes a replicated array (`checkpoint/replica_writes.py`): within one process, saving a
data-parallel state cuts no per-replica slices, so a save compiles nothing.

Orbax's default on CPU splits every replicated array among its replicas, one slicing program per
array shape and replica, compiled at the save; the shapes here are this test's own, so a program
compiled by another test cannot hide one."""


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from zaya_jax.checkpoint import orbax_store, replica_writes
from zaya_jax.config import ModelConfig
from zaya_jax.train.checkpoints import RunCheckpoints


def _replicated(shapes):
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    sharding = NamedSharding(mesh, PartitionSpec())
    return {f"w{i}": jax.device_put(jnp.full(shape, i + 0.5, jnp.float32), sharding) for i, shape in enumerate(shapes)}


class _NoLanes:
    """The data item's part of a save: no lanes (this test is about the arrays)."""

    def get_state(self):
        return {"lanes": {}}


def test_a_train_checkpoint_in_one_process_compiles_nothing(tmp_path, compiles):
    state = _replicated([(1028, 1024), (4, 12)])
    checkpoints = RunCheckpoints(str(tmp_path / "checkpoints"), keep=1)
    try:
        with compiles:
            checkpoints.save(1, state, _NoLanes(), {"version": 0})
            checkpoints.wait()
    finally:
        checkpoints.close()
    assert compiles.names == []
    restored = _restored(tmp_path, state)
    for key in state:
        np.testing.assert_array_equal(restored[key], state[key])


def _restored(tmp_path, state):
    checkpoints = RunCheckpoints(str(tmp_path / "checkpoints"), keep=1)
    try:
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        return checkpoints.restore(1, abstract, None)
    finally:
        checkpoints.close()


def test_a_model_save_in_one_process_compiles_nothing(tmp_path, compiles):
    arrays = _replicated([(1024, 1036), (12, 4)])
    with compiles:
        orbax_store.save_groups(str(tmp_path / "model"), ModelConfig(), [arrays])
    assert compiles.names == []
    stored = orbax_store.load_arrays(str(tmp_path / "model"), arrays, orbax_store.stored_shapes(str(tmp_path / "model")))
    for key in arrays:
        np.testing.assert_array_equal(stored[key], arrays[key])


def test_several_processes_leave_the_choice_to_orbax(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert replica_writes.use_replica_parallel() is None
    assert replica_writes.type_handler_registry().get(jax.Array) is not None
