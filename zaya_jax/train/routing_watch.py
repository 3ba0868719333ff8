"""The routing-collapse watch: say when one expert has taken nearly all of a layer's tokens for a while.

The step reports, per layer, the share of the layer's tokens its busiest expert took
(`balancing.load_summary`: `layer_top_share`, `layer_top_expert`). When that share stays at or
above `THRESHOLD` for `PATIENCE` steps in a row, the layer's routing has collapsed: the run goes
on, but the event log gets a `routing_collapse` event and the console a line under the progress
bar, once, until the layer recovers (a `routing_recovered` event). Like the bad-step policy it
reads each step's numbers one step late, after the next step is dispatched, so the devices never
wait for the host.
"""

from __future__ import annotations

import jax
import numpy as np

THRESHOLD = 0.9  # one expert taking this share of a layer's tokens...
PATIENCE = 20  # ...for this many steps in a row is a collapse


class RoutingWatch:
    def __init__(self, events, note=lambda text: None, threshold: float = THRESHOLD, patience: int = PATIENCE):
        self.events, self.note = events, note
        self.threshold, self.patience = threshold, patience
        self.streak: np.ndarray | None = None  # steps in a row each layer has been over the threshold
        self._pending: tuple[int, tuple] | None = None

    def after_step(self, step: int, metrics: dict) -> None:
        """Call after dispatching `step`; looks at the step before it."""
        previous, self._pending = self._pending, (step, (metrics["layer_top_share"], metrics["layer_top_expert"]))
        if previous:
            self._look(*previous)

    def flush(self) -> None:
        if self._pending:
            self._look(*self._pending)
            self._pending = None

    def _look(self, step: int, arrays) -> None:
        share, expert = (np.asarray(a) for a in jax.device_get(arrays))
        over = share >= self.threshold
        if self.streak is None:
            self.streak = np.zeros(share.shape, np.int64)
        was_collapsed = self.streak >= self.patience
        self.streak = np.where(over, self.streak + 1, 0)
        for layer in np.flatnonzero(self.streak == self.patience):
            e, s = int(expert[layer]), float(share[layer])
            self.events.write("routing_collapse", step=step, layer=int(layer), expert=e, share=round(s, 4),
                              steps=self.patience)
            self.note(f"step {step}: warning: layer {layer}'s routing collapsed: expert {e} took "
                      f"{100 * s:.0f}% of its tokens (≥ {100 * self.threshold:.0f}% for {self.patience} steps in a "
                      "row); see optim.balancer and optim.balance_lr")
        for layer in np.flatnonzero(was_collapsed & ~over):
            self.events.write("routing_recovered", step=step, layer=int(layer), share=round(float(share[layer]), 4))
            self.note(f"step {step}: layer {layer}'s routing recovered (busiest expert {100 * share[layer]:.0f}%)")
