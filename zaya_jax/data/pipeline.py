"""The Grain input pipeline: sources → held-out split → shuffle → lanes → tokenize → pack → mix,
with a checkpointable iterator that does not depend on the process count.

Per source, documents are split (by document, seeded) into training and held-out sets. The
training documents are shuffled with Grain's index shuffle (a new order every epoch, from
`seed`) and repeated forever; that global order is dealt to `lanes` streams (`data/lanes.py`:
one per row of the global batch, lane r takes documents r, r + L, ...), each tokenized and
packed into rows by `PackedRowsIterDataset`. A mixture draws each lane's rows from its sources
by weight (Grain's `IterDataset.mix`). A process reads only the lanes of the rows its devices
hold, `read_threads` lanes at a time. The iterator's `get_state()` is a small JSON-able dict per
lane, saved in every checkpoint and restored on resume, by any number of processes.

Held-out rows are packed from the held-out documents in one fixed global order, the same on
every process; each process keeps the rows its devices hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grain
import numpy as np

from zaya_jax.data.lanes import LaneRows
from zaya_jax.data.mixture import SourceSpec, parse_mixture
from zaya_jax.data.sources import DocumentSource, open_source
from zaya_jax.data.stream_packing import PackedRowsIterDataset
from zaya_jax.errors import ZayaError

# Distinct streams of one seed: the held-out split and the per-epoch orders are independent.
_SPLIT_STREAM, _ORDER_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class DataSettings:
    source: str
    weights: str = ""
    text_field: str = "text"
    seq_len: int = 128
    seed: int = 0
    heldout_fraction: float = 0.0
    read_threads: int = 4
    lanes: int = 1  # row streams = rows of the global batch (train.global_batch_size)

    @classmethod
    def from_config(cls, config) -> "DataSettings":
        d, t = config.data, config.train
        return cls(source=d.source, weights=d.weights, text_field=d.text_field, seq_len=t.seq_len,
                   seed=t.seed, heldout_fraction=d.heldout_fraction, read_threads=d.read_threads,
                   lanes=t.global_batch_size)


class DataPipeline:
    """Training and held-out rows: all lanes of the global batch, or the ones a process holds."""

    def __init__(self, settings: DataSettings, tokenizer):
        if settings.lanes < 1:
            raise ZayaError(f"the data pipeline needs at least one lane (row of the global batch), got {settings.lanes}")
        self.settings, self.tokenizer = settings, tokenizer
        self.mixture: list[SourceSpec] = parse_mixture(settings.source, settings.weights)
        self.sources: list[DocumentSource] = [open_source(m.spec, settings.text_field) for m in self.mixture]
        self.splits = [split_documents(len(src), settings.heldout_fraction, _seed(settings.seed, i))
                       for i, src in enumerate(self.sources)]

    # ---- training ---------------------------------------------------------------------------
    def train_iterator(self, lanes=None) -> LaneRows:
        """Endless batches with one row per lane of `lanes` (default: all, i.e. the global batch)."""
        lanes = range(self.settings.lanes) if lanes is None else lanes
        bad = [lane for lane in lanes if not 0 <= lane < self.settings.lanes]
        if bad or not len(lanes):
            raise ZayaError(f"data lanes must be a non-empty subset of 0..{self.settings.lanes - 1}, got {list(lanes)[:8]}")
        return LaneRows({lane: self.lane(lane) for lane in lanes}, lanes, self.settings.read_threads)

    def lane(self, lane: int) -> grain.IterDataset:
        """The endless row stream of one lane (its sources mixed by weight)."""
        rows = {m.spec: self._lane_rows(i, lane) for i, m in enumerate(self.mixture)}
        if len(rows) == 1:
            return next(iter(rows.values()))
        # Keyed by source, so a resumed run finds each source's state by name.
        return grain.IterDataset.mix(rows, {m.spec: m.weight for m in self.mixture})

    def _lane_rows(self, i: int, lane: int) -> grain.IterDataset:
        train, _ = self.splits[i]
        order_seed = _seed(self.settings.seed, i, _ORDER_STREAM)
        docs = grain.MapDataset.source(_pairs(i, train)).shuffle(seed=order_seed).repeat(None)
        return self._pack(docs[lane::self.settings.lanes], threads=0)

    # ---- held-out ---------------------------------------------------------------------------
    def eval_batches(self, batch_size: int, max_batches: int | None = None,
                     rows=None) -> Iterator[dict[str, np.ndarray]]:
        """Held-out batches in a fixed global order, the last one padded (loss mask 0); of each,
        only `rows` (default all): a process's share, the same batches on every process."""
        if batch_size < 1:
            raise ZayaError(f"eval batch_size must be at least 1, got {batch_size}")
        pairs = np.concatenate([_pairs(i, h) for i, (_, h) in enumerate(self.splits)])
        if not len(pairs):
            return
        keep = np.arange(batch_size) if rows is None else np.asarray(rows)
        packed = self._pack(grain.MapDataset.source(pairs), threads=self.settings.read_threads)
        for count, batch in enumerate(packed.batch(batch_size, drop_remainder=False)):
            if max_batches is not None and count >= max_batches:
                return
            yield {k: v[keep] for k, v in _pad_batch(batch, batch_size, self.tokenizer.pad_id).items()}

    # ---- shared -----------------------------------------------------------------------------
    def _pack(self, pairs: grain.MapDataset, threads: int) -> grain.IterDataset:
        """Rows from a dataset of (source index, document index) pairs, read in `threads` threads
        (0: on the caller's thread; the lanes run in parallel instead)."""
        sources, encode = self.sources, self.tokenizer.encode
        tokens = pairs.map(lambda pair: np.asarray(encode(sources[int(pair[0])][int(pair[1])]), np.int32))
        read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=64 if threads else 0)
        return PackedRowsIterDataset(tokens.to_iter_dataset(read), self.settings.seq_len,
                                     eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id)

    def describe(self) -> str:
        parts = []
        for m, src, (train, held) in zip(self.mixture, self.sources, self.splits):
            weight = f" ×{m.weight:.2f}" if len(self.mixture) > 1 else ""
            parts.append(f"{src.name}{weight} ({len(train)} train / {len(held)} held-out docs)")
        return "; ".join(parts)


def split_documents(num_docs: int, heldout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) document indices, each sorted; held-out is a seeded random subset."""
    order = np.random.default_rng((seed, _SPLIT_STREAM)).permutation(num_docs)
    num_heldout = max(1, round(heldout_fraction * num_docs)) if heldout_fraction > 0 else 0
    num_heldout = min(num_heldout, max(num_docs - 1, 0))  # always leave a training document
    return np.sort(order[num_heldout:]), np.sort(order[:num_heldout])


def _seed(seed: int, source: int, stream: int = _SPLIT_STREAM) -> int:
    """A 32-bit seed per (run seed, source, stream); Grain's shuffle takes seeds below 2**32."""
    return int(np.random.default_rng((seed, source, stream)).integers(0, 2**32 - 1))


def _pairs(source: int, docs: np.ndarray) -> np.ndarray:
    return np.stack([np.full(len(docs), source, np.int64), docs.astype(np.int64)], axis=1)


def _pad_batch(batch: dict[str, np.ndarray], batch_size: int, pad_id: int) -> dict[str, np.ndarray]:
    missing = batch_size - batch["inputs"].shape[0]
    if missing == 0:
        return batch
    out = {}
    for name, value in batch.items():
        fill = pad_id if name in ("inputs", "targets") else 0
        out[name] = np.concatenate([value, np.full((missing,) + value.shape[1:], fill, value.dtype)])
    return out
