"""What a training process does differently when it is one of several: wait for the others.

Barriers go through the distributed runtime's coordination service (a key-value store), never
through a device collective: CPU collectives (gloo) give up when peers arrive more than 30 s
apart, and processes build, restore and compile at different speeds. Orbax is switched to the
same kind of barrier for its own synchronisation.
"""

from __future__ import annotations

import itertools

import jax

from zaya_jax import jax_compat
from zaya_jax.errors import ZayaError, quoted

_serial = itertools.count()


def use_coordination_barriers() -> None:
    """Make Orbax synchronise processes through the coordination service (an absl flag of its own)."""
    if jax.process_count() == 1:
        return
    jax_compat.use_orbax_coordination_barriers()


def barrier(name: str, timeout_s: int) -> None:
    """Return once every process has called `barrier(name)` (each name used once per run)."""
    if jax.process_count() == 1:
        return
    try:
        jax_compat.wait_at_barrier(f"zaya_{name}_{next(_serial)}", timeout_s * 1000)
    except jax_compat.JaxInternalsMoved:
        raise
    except Exception as e:  # noqa: BLE001
        raise ZayaError(f"not every process reached {name!r} within distributed.initialization_timeout_s "
                        f"({timeout_s}s): {quoted(e)}") from None
