"""How the model's layers run over devices: the hook a program fills and the model calls.

The model computes one device's math. A program that spreads it over a mesh hands the model a
`Schedule` (`parallel.mesh_schedule.MeshSchedule`), chosen once from its mesh; every layer then asks it
to run its attention, its experts and its kernels. `LOCAL`, the default, runs them right here:
one device, or GSPMD alone. The model never imports `parallel/`: the schedules use the model's
math, not the other way round.
"""

from __future__ import annotations

import jax.numpy as jnp


class Schedule:
    """One device: every method runs its work locally (returning None means "do it yourself")."""

    def attention(self, params: dict, x, seq, cfg):
        """The CCA layer's output, or None for the model's own single-device attention."""
        return None

    def linear_attention(self, params: dict, x, seq, cfg):
        """A linear-attention layer's output, or None for the model's own single-device form."""
        return None

    def experts(self, x, routing, gate, up, down, backend: str):
        """The experts' output [B, S, H], or None for the model's own sort-by-expert path."""
        return None

    def run_kernel(self, kernel: str, backend: str, fn, batched: tuple, replicated: tuple = ()):
        """fn(*batched, *replicated): a token-wise kernel (norm, whole-sequence attention)."""
        return fn(*batched, *replicated)

    def embed(self, table, ids):
        """The rows of the embedding `table` [V, H] for token `ids` [B, S]."""
        return jnp.take(table, ids, axis=0)


LOCAL = Schedule()
