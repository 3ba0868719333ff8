"""The routing watch: say when one expert has taken nearly all of a layer's tokens for a while, and
keep each layer's worst routing between logged steps.

The step reports, per layer, the share of the layer's tokens its busiest expert took
(`balancing.load_summary`: `layer_top_share`, `layer_top_expert`). When that share stays at or
above `THRESHOLD` for `PATIENCE` steps in a row, the layer's routing has collapsed: the run goes
on, but the event log gets a `routing_collapse` event and the console a line under the progress
bar, once, until the layer recovers (a `routing_recovered` event). Like the bad-step policy it
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

THRESHOLD = 0.9  # one expert taking this share of a layer's tokens...
PATIENCE = 20  # ...for this many steps in a row is a collapse
PEAK_KEYS = ("layer_load_max", "layer_skip_fraction")  # kept at their peak between logged steps


class RoutingWatch:
    def __init__(self, events, note=lambda text: None, threshold: float = THRESHOLD, patience: int = PATIENCE):
        self.events, self.note = events, note
        self.threshold, self.patience = threshold, patience
        self.streak: np.ndarray | None = None  # steps in a row each layer has been over the threshold
        self._pending: tuple[int, tuple] | None = None
        self._peaks: dict[str, np.ndarray] = {}  # per key, each layer's largest value since the last record

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

    def interval_peaks(self, record: dict) -> dict:
        """Each layer's peak of `PEAK_KEYS` over the steps since the last call, the logged step's own
        values (in `record`) included, as `<key>_peak` lists and `load_max_peak` over the layers."""
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
            self._peaks[key] = np.maximum(self._peaks[key], values) if key in self._peaks else values
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
