"""The host side of the bad-step guard: log each skipped step, and act on a streak of them.

The compiled step decides and skips (`train/step_guard.py`); this reads its verdict one step late,
after the next step is dispatched, so the devices never wait for the host. Every skipped step is
an event (`bad_step`) and a line under the progress bar. When `fault.max_consecutive_bad_steps`
steps in a row were bad, `after_step` says what to do: `rollback` (to the newest checkpoint, with
the data iterator left where it is, so the data that caused the streak is skipped), or `stop`
(`fault.on_bad_steps=stop`, or `fault.max_rollbacks` used up in this attempt, or no checkpoint to
go back to). Every process reaches the same decision at the same step: it reads the same verdicts.
Reading one step late makes the action land after the same step in every run and every process.
"""

from __future__ import annotations

import jax

_VERDICT = ("bad_step", "bad_steps", "consecutive_bad_steps", "loss", "grad_norm")


class BadStepPolicy:
    def __init__(self, fault, events, note=lambda text: None):
        self.limit, self.on_bad = int(fault.max_consecutive_bad_steps), fault.on_bad_steps
        # Counted per attempt, from what every process saw itself: the same count everywhere.
        self.max_rollbacks, self.rollbacks = int(fault.max_rollbacks), 0
        self.events, self.note = events, note
        self._pending: tuple[int, dict] | None = None
        self.reason = ""

    def after_step(self, step: int, metrics: dict) -> str | None:
        """Call after dispatching `step`; judges the step before it. None, "rollback" or "stop"."""
        previous, self._pending = self._pending, (step, {k: metrics[k] for k in _VERDICT})
        return self._judge(*previous) if previous else None

    def flush(self) -> None:
        """Log the last step's verdict (the loop ended; nothing more to act on)."""
        if self._pending:
            self._judge(*self._pending)
            self._pending = None

    def forget(self) -> None:
        """The pending step was undone (a rollback): its verdict no longer matters."""
        self._pending = None

    def _judge(self, step: int, metrics: dict) -> str | None:
        bad, total, streak, loss, grad_norm = (jax.device_get(metrics[k]) for k in _VERDICT)
        if not bad:
            return None
        self.events.write("bad_step", step=step, loss=_number(loss), grad_norm=_number(grad_norm),
                          consecutive=int(streak), total=int(total))
        self.note(f"step {step}: bad step skipped (loss {float(loss):.4g}, grad norm {float(grad_norm):.4g}; "
                  f"{int(streak)} in a row, {int(total)} in all)")
        if not self.limit or streak < self.limit:
            return None
        self.reason = f"{int(streak)} bad steps in a row up to step {step} (fault.max_consecutive_bad_steps = {self.limit})"
        if self.on_bad == "rollback" and self.rollbacks < self.max_rollbacks:
            self.rollbacks += 1
            return "rollback"
        if self.on_bad == "rollback":
            self.reason += f", and the {self.max_rollbacks} rollback(s) fault.max_rollbacks allows are used up"
        return "stop"


def _number(value) -> float | None:
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None
