"""Lanes: the global batch as a fixed set of independent row streams, so data reshards exactly.

Row r of every global batch comes from lane r, one packed row stream of its own (`DataPipeline`
builds them: lane r reads documents r, r + L, r + 2L, ... of the shuffled global order). The
lanes depend on the seed and the global batch size only, never on how many processes read
them: a process runs the lanes of the rows its devices hold, processes holding the same rows
run the same lanes (and get the same rows), and the state of a run's data is the state of
each lane, keyed by lane number. A checkpoint written by N processes therefore restores into
any other number: each process takes its lanes' states from wherever they were saved, and no
document is repeated or skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import grain
import numpy as np

from zaya_jax.errors import ZayaError


class LaneRows:
    """Iterator over batches that stack one row from each of `lanes` (in the given order)."""

    def __init__(self, streams: Mapping[int, grain.IterDataset], lanes: Sequence[int], threads: int = 1):
        self.lanes = [int(lane) for lane in lanes]
        self._iters = [iter(streams[lane]) for lane in self.lanes]
        # Lanes are independent, so they advance in parallel (tokenizing releases the GIL).
        self._pool = ThreadPoolExecutor(max(1, min(threads, len(self._iters))), thread_name_prefix="zaya-lanes")

    def __iter__(self) -> "LaneRows":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = list(self._pool.map(next, self._iters))
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

    def get_state(self) -> dict:
        """JSON-able: `{"lanes": {"<lane>": state}}`, this iterator's lanes only."""
        return {"lanes": {str(lane): it.get_state() for lane, it in zip(self.lanes, self._iters)}}

    def set_state(self, state: dict) -> None:
        """Restore from a state holding (at least) these lanes, e.g. `merge_states` of every process's."""
        saved = state.get("lanes", {}) if isinstance(state, dict) else {}
        missing = [lane for lane in self.lanes if str(lane) not in saved]
        if missing:
            raise ZayaError(f"the saved data state has no lane {missing[0]} (it holds {len(saved)} lanes); "
                            "it was written with another train.global_batch_size or is incomplete")
        for lane, it in zip(self.lanes, self._iters):
            it.set_state(saved[str(lane)])

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def merge_states(states: Sequence[dict]) -> dict:
    """One state holding every lane found in `states` (the per-process files of a checkpoint).

    Processes that share rows saved the same lane; their copies must agree."""
    merged: dict[str, dict] = {}
    for state in states:
        for lane, lane_state in state.get("lanes", {}).items():
            if merged.setdefault(lane, lane_state) != lane_state:
                raise ZayaError(f"two processes saved different states for data lane {lane}; the checkpoint "
                                "is inconsistent: resume from the one before it")
    return {"lanes": merged}
