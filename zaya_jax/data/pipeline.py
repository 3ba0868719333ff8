"""The Grain input pipeline: sources → held-out split → per-process share → shuffle → tokenize →
pack → mix → batch, with a checkpointable iterator.

Per source, documents are split (by document, seeded) into training and held-out sets. Each
process takes every `process_count`-th training document starting at its index, so processes
read disjoint documents and together fill the global batch. A process's documents are shuffled
with Grain's index shuffle (a new order every epoch, from `seed`), repeated forever, tokenized in
`read_threads` threads, and packed into rows by `PackedRowsIterDataset`. A mixture draws rows
from its sources by weight (Grain's `IterDataset.mix`). The iterator's `get_state()` is a small
JSON-able dict, saved in every checkpoint and restored on resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grain
import numpy as np

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

    @classmethod
    def from_config(cls, config) -> "DataSettings":
        d, t = config.data, config.train
        return cls(source=d.source, weights=d.weights, text_field=d.text_field, seq_len=t.seq_len,
                   seed=t.seed, heldout_fraction=d.heldout_fraction, read_threads=d.read_threads)


class DataPipeline:
    """Training and held-out batches for one process."""

    def __init__(self, settings: DataSettings, tokenizer, process_index: int = 0, process_count: int = 1):
        if not 0 <= process_index < process_count:
            raise ZayaError(f"process_index {process_index} is not in [0, {process_count})")
        self.settings, self.tokenizer = settings, tokenizer
        self.process_index, self.process_count = process_index, process_count
        self.mixture: list[SourceSpec] = parse_mixture(settings.source, settings.weights)
        self.sources: list[DocumentSource] = [open_source(m.spec, settings.text_field) for m in self.mixture]
        self.splits = [split_documents(len(src), settings.heldout_fraction, _seed(settings.seed, i))
                       for i, src in enumerate(self.sources)]
        for src, (train, _) in zip(self.sources, self.splits):
            if len(train) < process_count:
                raise ZayaError(f"data source {src.name} has {len(train)} training document(s), fewer than "
                                f"the {process_count} processes; add documents or lower data.heldout_fraction")

    # ---- training ---------------------------------------------------------------------------
    def train_dataset(self, batch_size: int) -> grain.IterDataset:
        """Endless batches of `batch_size` rows (this process's share of the global batch)."""
        if batch_size < 1:
            raise ZayaError(f"the per-process batch size must be at least 1, got {batch_size}")
        rows = {m.spec: self._train_rows(i) for i, m in enumerate(self.mixture)}
        if len(rows) == 1:
            mixed = next(iter(rows.values()))
        else:  # keyed by source, so a resumed run finds each source's state by name
            mixed = grain.IterDataset.mix(rows, {m.spec: m.weight for m in self.mixture})
        return mixed.batch(batch_size, drop_remainder=True)

    def train_iterator(self, batch_size: int) -> grain.DatasetIterator:
        return iter(self.train_dataset(batch_size))

    def _train_rows(self, i: int) -> grain.IterDataset:
        train, _ = self.splits[i]
        mine = train[self.process_index::self.process_count]
        order_seed = _seed(self.settings.seed, i, _ORDER_STREAM)
        docs = grain.MapDataset.source(_pairs(i, mine)).shuffle(seed=order_seed).repeat(None)
        return self._pack(docs)

    # ---- held-out ---------------------------------------------------------------------------
    def eval_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """This process's held-out rows in a fixed order; the last batch is padded (loss mask 0)."""
        if batch_size < 1:
            raise ZayaError(f"eval batch_size must be at least 1, got {batch_size}")
        pairs = np.concatenate([_pairs(i, h[self.process_index::self.process_count])
                                for i, (_, h) in enumerate(self.splits)])
        if not len(pairs):
            return
        batches = self._pack(grain.MapDataset.source(pairs)).batch(batch_size, drop_remainder=False)
        for count, batch in enumerate(batches):
            if max_batches is not None and count >= max_batches:
                return
            yield _pad_batch(batch, batch_size, self.tokenizer.pad_id)

    # ---- shared -----------------------------------------------------------------------------
    def _pack(self, pairs: grain.MapDataset) -> grain.IterDataset:
        """Rows from a dataset of (source index, document index) pairs."""
        sources, encode = self.sources, self.tokenizer.encode
        tokens = pairs.map(lambda pair: np.asarray(encode(sources[int(pair[0])][int(pair[1])]), np.int32))
        read = grain.ReadOptions(num_threads=self.settings.read_threads, prefetch_buffer_size=64)
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
