"""The routing watch: say when a layer keeps overloading an expert, and keep each layer's worst
routing between logged steps.

The step reports, per layer, its busiest expert's load as a multiple of the fair share
(`balancing.load_summary`: `layer_load_max`, with `layer_top_expert` and `layer_top_share`). When
that stays at or above `THRESHOLD` for `PATIENCE` steps in a row, counted from step
`SETTLE_STEPS` on, the layer's routing has gone wrong, whichever expert is the busy one: a
balancer that herds a layer's tokens from expert to expert trips it as surely as one expert that
keeps them all. The run goes on, but the event log gets a `routing_overload` event and the
console a line under the progress bar, once, until the layer comes back under the threshold (a
`routing_recovered` event). Like the bad-step policy it
reads each step's numbers one step late, after the next step is dispatched, so the devices never
wait for the host.

Every step's per-layer `layer_load_max` (the busiest expert's share times E) and
`layer_skip_fraction` pass through it too, so a logged record carries their peaks over every step
since the previous record (`interval_peaks`): routing that goes bad and recovers between two
logged steps still shows, at no cost beyond the [L] numbers it already fetches each step.
"""

from __future__ import annotations

import jax
import numpy as np

THRESHOLD = 2.0  # a layer's busiest expert at this multiple of its fair share (whichever expert)...
PATIENCE = 10  # ...for this many steps in a row...
SETTLE_STEPS = 10  # ...from this step on (a fresh router's first steps are uneven) is an overload
PEAK_KEYS = ("layer_load_max", "layer_skip_fraction")  # kept at their peak between logged steps


class RoutingWatch:
    def __init__(self, events, note=lambda text: None, threshold: float = THRESHOLD, patience: int = PATIENCE):
        self.events, self.note = events, note
        self.threshold, self.patience = threshold, patience
        self.streak: np.ndarray | None = None  # steps in a row each layer has been at or over the threshold
        self._pending: tuple[int, tuple] | None = None
        self._peaks: dict[str, np.ndarray] = {}  # per key, each layer's largest value since the last record
        self._recorded = -1  # the last logged step: its values are in that record, not the next

    def after_step(self, step: int, metrics: dict) -> None:
        """Call after dispatching `step`; looks at the step before it."""
        watched = tuple(metrics[k] for k in ("layer_top_share", "layer_top_expert") + PEAK_KEYS)
        previous, self._pending = self._pending, (step, watched)
        if previous:
            self._look(*previous)

    def flush(self) -> None:
        if self._pending:
            self._look(*self._pending)
            self._pending = None

    def interval_peaks(self, record: dict, step: int) -> dict:
        """Each layer's peak of `PEAK_KEYS` over the steps since the last call, the logged `step`'s own
        values (in `record`) included, as `<key>_peak` lists and `load_max_peak` over the layers."""
        self._recorded = step
        out = {}
        for key in PEAK_KEYS:
            now = np.asarray(record[key], np.float64)
            peak = np.maximum(self._peaks.pop(key, now), now)
            out[f"{key}_peak"] = peak.round(4).tolist()
        out["load_max_peak"] = float(max(out["layer_load_max_peak"]))
        return out

    def _look(self, step: int, arrays) -> None:
        share, expert, *tracked = (np.asarray(a) for a in jax.device_get(arrays))
        for key, values in zip(PEAK_KEYS, tracked):
            if step > self._recorded:
                self._peaks[key] = np.maximum(self._peaks[key], values) if key in self._peaks else values
        load = tracked[PEAK_KEYS.index("layer_load_max")]
        over = (load >= self.threshold) & (step >= SETTLE_STEPS)
        if self.streak is None:
            self.streak = np.zeros(load.shape, np.int64)
        was_over = self.streak >= self.patience
        self.streak = np.where(over, self.streak + 1, 0)
        for layer in np.flatnonzero(self.streak == self.patience):
            e, x, s = int(expert[layer]), float(load[layer]), float(share[layer])
            self.events.write("routing_overload", step=step, layer=int(layer), expert=e, load=round(x, 3),
                              share=round(s, 4), steps=self.patience)
            self.note(f"step {step}: warning: layer {layer} has sent ≥ {self.threshold:g}× the fair share to one "
                      f"expert for {self.patience} steps in a row (now expert {e}, {x:.1f}×, {100 * s:.0f}% of its "
                      "tokens); see optim.balancer and optim.balance_lr")
        for layer in np.flatnonzero(was_over & ~over):
            self.events.write("routing_recovered", step=step, layer=int(layer), load=round(float(load[layer]), 3))
            self.note(f"step {step}: layer {layer}'s routing recovered (busiest expert {load[layer]:.1f}× its fair "
                      "share)")
