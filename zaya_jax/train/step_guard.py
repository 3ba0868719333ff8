"""Bad steps: a non-finite or spiking loss or gradient norm skips the update, on every device alike.

The train step judges each step from its loss and (pre-clip) gradient norm, both reduced over the
whole global batch inside the compiled step, so every device and every process computes the same
verdict. A step is bad when either value is NaN/inf, or, once `window` good steps have been seen,
when either lies more than `sigmas` standard deviations above the mean of the last `window` good
steps (the z-score rule of OLMo's skip-step optimizer). A bad step keeps the parameters, the
optimizer state, the balancing biases and the step counter as they were; only the guard's own
counters move. Its history is part of the train state, so it is checkpointed and a resumed run
judges exactly as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GuardSettings:
    sigmas: float = 6.0  # 0: only non-finite values are bad
    window: int = 128  # good steps the spike rule looks back over (and waits for)

    @classmethod
    def from_config(cls, fault) -> "GuardSettings":
        return cls(float(fault.spike_sigmas), int(fault.spike_window))


@dataclasses.dataclass
class GuardState:
    history: jax.Array  # [window, 2] float32: (loss, grad_norm) of recent good steps, a ring
    seen: jax.Array  # int32: good steps recorded (the ring's write position is seen % window)
    bad_total: jax.Array  # int32: bad steps so far
    consecutive: jax.Array  # int32: bad steps in a row, up to this one


jax.tree_util.register_dataclass(GuardState, data_fields=["history", "seen", "bad_total", "consecutive"],
                                 meta_fields=[])


def init(settings: GuardSettings) -> GuardState:
    counters = [jnp.zeros((), jnp.int32) for _ in range(3)]  # distinct buffers: the step donates each
    return GuardState(jnp.zeros((max(settings.window, 1), 2), jnp.float32), *counters)


def is_bad(guard: GuardState, loss: jax.Array, grad_norm: jax.Array, settings: GuardSettings) -> jax.Array:
    """The verdict on this step (a bool scalar)."""
    values = jnp.stack([loss, grad_norm]).astype(jnp.float32)
    nonfinite = ~jnp.all(jnp.isfinite(values))
    if not settings.sigmas or settings.window < 2:
        return nonfinite
    mean = jnp.mean(guard.history, axis=0)
    std = jnp.std(guard.history, axis=0)
    spike = jnp.any(values > mean + settings.sigmas * std) & (guard.seen >= settings.window)
    return nonfinite | spike


def record(guard: GuardState, loss: jax.Array, grad_norm: jax.Array, bad: jax.Array) -> GuardState:
    """The guard after this step: a good step enters the history, a bad one the counters."""
    values = jnp.stack([loss, grad_norm]).astype(jnp.float32)
    slot = guard.seen % guard.history.shape[0]
    history = jnp.where(bad, guard.history, guard.history.at[slot].set(values))
    one = bad.astype(jnp.int32)
    return GuardState(history, guard.seen + 1 - one, guard.bad_total + one, (guard.consecutive + 1) * one)


def keep_if_bad(bad: jax.Array, before, after):
    """`before` where the step was bad, else `after`, leaf by leaf (shardings kept)."""
    return jax.tree.map(lambda b, a: jnp.where(bad, b, a), before, after)
