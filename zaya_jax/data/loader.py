"""Batches for training and evaluation from an in-memory corpus.

`TextBatches` tokenizes documents once, splits them (by document, never by row) into train and
held-out sets, packs each split into rows, and serves deterministic batches: train batch `step`
depends only on (seed, step), each epoch visits the train rows in a fresh seeded order, and
evaluation walks the held-out rows in a fixed order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from zaya_jax.data.packing import PackedRows, pack_documents
from zaya_jax.errors import ZayaError

# Distinct streams of the same seed, so the split and the epoch orders are independent.
_SPLIT_STREAM, _EPOCH_STREAM = 0, 1


class TextBatches:
    """Train and held-out batches of packed rows."""

    def __init__(self, documents: Sequence[str], tokenizer, seq_len: int, seed: int = 0,
                 heldout_fraction: float = 0.0):
        if not 0.0 <= heldout_fraction < 1.0:
            raise ZayaError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        if seed < 0:
            raise ZayaError(f"seed must be non-negative, got {seed}")
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.pad_id = int(tokenizer.pad_id)
        self._orders: dict[int, np.ndarray] = {}
        token_lists = tokenizer.encode_batch(list(documents))
        self.train_doc_indices, self.heldout_doc_indices = split_documents(
            len(token_lists), heldout_fraction, seed)
        self.train = self._pack(token_lists, self.train_doc_indices, tokenizer)
        self.heldout = self._pack(token_lists, self.heldout_doc_indices, tokenizer)
        if self.train.num_rows == 0:
            raise ZayaError(f"no training rows: the {len(self.train_doc_indices)} training "
                            "documents have no tokens; use a larger corpus or a smaller heldout_fraction")

    def _pack(self, token_lists, indices: np.ndarray, tokenizer) -> PackedRows:
        return pack_documents([token_lists[i] for i in indices], self.seq_len,
                              eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)

    @property
    def num_train_rows(self) -> int:
        return self.train.num_rows

    @property
    def num_eval_rows(self) -> int:
        return self.heldout.num_rows

    @property
    def train_tokens(self) -> int:
        """Tokens trained on per epoch (loss-mask ones)."""
        return self.train.num_loss_tokens

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """The rows for global step `step`: samples step*B .. step*B+B-1 of the epoch sequence."""
        if batch_size < 1 or step < 0:
            raise ZayaError(f"train_batch needs step >= 0 and batch_size >= 1, got {step}, {batch_size}")
        sample = step * batch_size + np.arange(batch_size, dtype=np.int64)
        epoch, offset = np.divmod(sample, self.num_train_rows)
        rows = np.empty(batch_size, np.int64)
        # A batch can straddle epochs (or span several when rows < batch size): use each epoch's order.
        for e in np.unique(epoch):
            here = epoch == e
            rows[here] = self._epoch_order(int(e))[offset[here]]
        return self.train.as_dict(rows)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        # Consecutive steps reuse an epoch's order; keep only the latest few to bound memory.
        if epoch not in self._orders:
            if len(self._orders) >= 4:
                self._orders.pop(next(iter(self._orders)))
            rng = np.random.default_rng((self.seed, _EPOCH_STREAM, epoch))
            self._orders[epoch] = rng.permutation(self.num_train_rows)
        return self._orders[epoch]

    def eval_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Held-out rows in order; the last batch is filled with all-padding rows (mask 0)."""
        if batch_size < 1:
            raise ZayaError(f"eval batch_size must be at least 1, got {batch_size}")
        num_batches = -(-self.num_eval_rows // batch_size)
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
        for b in range(num_batches):
            batch = self.heldout.as_dict(slice(b * batch_size, (b + 1) * batch_size))
            yield _pad_batch(batch, batch_size, self.pad_id)


def split_documents(num_docs: int, heldout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) document indices, each sorted; held-out is a seeded random subset."""
    order = np.random.default_rng((seed, _SPLIT_STREAM)).permutation(num_docs)
    num_heldout = max(1, round(heldout_fraction * num_docs)) if heldout_fraction > 0 else 0
    num_heldout = min(num_heldout, max(num_docs - 1, 0))  # always leave a training document
    return np.sort(order[num_heldout:]), np.sort(order[:num_heldout])


def _pad_batch(batch: dict[str, np.ndarray], batch_size: int, pad_id: int) -> dict[str, np.ndarray]:
    missing = batch_size - batch["inputs"].shape[0]
    if missing == 0:
        return batch
    out = {}
    for name, value in batch.items():
        fill = pad_id if name in ("inputs", "targets") else 0
        out[name] = np.concatenate([value, np.full((missing,) + value.shape[1:], fill, value.dtype)])
    return out
