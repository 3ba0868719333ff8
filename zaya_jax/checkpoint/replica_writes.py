"""Who writes a replicated array: the one policy both Orbax writers (train checkpoints, the model) use.

Orbax can split the writing of an array held by several replicas (data parallelism) among the
replicas ("replica-parallel"), each writing a slice. Each slice is cut on its device by a small
XLA program of its own: one compile per array shape and replica. That spreads the file writes
over the processes of a multi-process job; within one process the same process writes every
slice anyway, so there it only adds the compiles (about a second per save of a tiny model on 4
CPU devices). So: off in a single process; in several, Orbax's own choice for the platform (it
keeps it off on GPUs), and never for a slice under `MIN_SLICE_BYTES`, which writes faster than
its program compiles. Which replica writes changes no stored byte.
"""

from __future__ import annotations

import jax
import numpy as np

MIN_SLICE_BYTES = 1 << 20


def use_replica_parallel() -> bool | None:
    """False in one process; None (Orbax decides by platform) across processes."""
    return None if jax.process_count() > 1 else False


def v1_context():
    """An Orbax v1 context that writes `jax.Array`s as this module says."""
    from orbax.checkpoint.experimental import v1 as ocpv1

    context = ocpv1.Context()
    context.array.saving.use_replica_parallel = use_replica_parallel()
    context.array.saving.min_slice_bytes_for_replica_parallel = MIN_SLICE_BYTES
    return context


def type_handler_registry():
    """Orbax's standard handlers, with `jax.Array`s written as this module says (the v0 API)."""
    from orbax.checkpoint import type_handlers as th

    saving = v1_context().array.saving  # its array metadata store is the one Orbax's own handlers use
    array = th.ArrayHandler(use_replica_parallel=saving.use_replica_parallel,
                            min_slice_bytes_for_replica_parallel=saving.min_slice_bytes_for_replica_parallel,
                            array_metadata_store=saving.array_metadata_store)
    scalar = th.ScalarHandler()
    return th.create_type_handler_registry(
        (int, scalar), (float, scalar), (bytes, scalar), (np.number, scalar),
        (np.ndarray, th.NumpyHandler()), (jax.Array, array), (str, th.StringHandler()))
