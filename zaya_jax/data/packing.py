"""Packing: tokenized documents → fixed-length training rows with per-document metadata.

Each document gets an eos appended; the documents form one token stream, cut into rows of
`seq_len + 1` tokens that overlap by one (inputs row[:-1], targets row[1:]), so every token but
the very first is a target exactly once. Per row we also emit segment ids, positions and a loss
mask, all in the layout the model expects (see `zaya_jax.model.segments`).

`pack_documents` packs a whole list at once and is the reference; the training pipeline cuts the
same rows on the fly from an endless stream (`stream_packing`), through `rows_from_stream`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zaya_jax.errors import ZayaError

PAD_SEGMENT = 0


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Stacked rows, each array [num_rows, seq_len]."""

    inputs: np.ndarray  # int32 token ids fed to the model
    targets: np.ndarray  # int32 next-token ids
    segment_ids: np.ndarray  # int32; documents numbered 1, 2, ... within each row, 0 = padding
    positions: np.ndarray  # int32; position within the document, restarting at each row
    loss_mask: np.ndarray  # float32; 1 where the target continues the input's document

    @property
    def num_rows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def as_dict(self, rows: int | np.ndarray | slice = slice(None)) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)}


def pack_documents(token_lists, seq_len: int, eos_id: int, pad_id: int = 0) -> PackedRows:
    """Pack documents (lists of token ids, eos not included) into rows of `seq_len` tokens."""
    if seq_len < 1:
        raise ZayaError(f"seq_len must be at least 1, got {seq_len}")
    tokens, doc = _stream(token_lists, eos_id)
    num_rows = -(-(len(tokens) - 1) // seq_len) if len(tokens) > 1 else 0
    # Pad the stream so the last, partial row can be cut like the rest; doc -1 marks padding.
    padded = num_rows * seq_len + 1
    tokens = np.concatenate([tokens, np.full(padded - len(tokens), pad_id, np.int32)])
    doc = np.concatenate([doc, np.full(padded - len(doc), -1, np.int64)])
    index = np.arange(num_rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    row_tokens, row_doc = tokens[index], doc[index]
    return _rows(row_tokens, row_doc[:, :-1], row_doc[:, 1:])


def rows_from_stream(tokens: np.ndarray, owners: np.ndarray, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One row from up to `seq_len + 1` stream tokens and the document serial of each (padded)."""
    missing = seq_len + 1 - tokens.size
    tokens = np.concatenate([tokens, np.full(missing, pad_id, np.int32)])[None]
    owners = np.concatenate([owners, np.full(missing, -1, np.int64)])[None]
    return _rows(tokens, owners[:, :-1], owners[:, 1:]).as_dict(0)


def _stream(token_lists, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """All tokens with eos after each document, and the document index of every token."""
    # An empty document would be a lone eos whose only "context" is another document: skip it.
    docs = [np.asarray(t, np.int32) for t in token_lists]
    docs = [np.append(t, np.int32(eos_id)) for t in docs if t.size]
    if not docs:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    lengths = np.array([d.size for d in docs])
    return np.concatenate(docs), np.repeat(np.arange(len(docs)), lengths)


def _rows(row_tokens: np.ndarray, doc_in: np.ndarray, doc_out: np.ndarray) -> PackedRows:
    seq_len = doc_in.shape[1]
    is_pad = doc_in < 0
    starts = np.ones_like(doc_in, bool)
    starts[:, 1:] = doc_in[:, 1:] != doc_in[:, :-1]
    segment_ids = np.where(is_pad, PAD_SEGMENT, np.cumsum(starts, axis=1))
    # A document continued from the previous row restarts at position 0: the model masks its
    # lookback (attention, CCA taps) by segment within a row only, so the earlier part is not in
    # its context; positions restarting per row also match `positions_from_segments`.
    idx = np.broadcast_to(np.arange(seq_len), doc_in.shape)
    positions = np.where(is_pad, 0, idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1))
    # A document's eos belongs to it, so predicting the eos is trained; predicting the next
    # document's first token from an eos is not (nothing in the context determines it).
    loss_mask = (doc_in == doc_out) & ~is_pad
    return PackedRows(
        inputs=row_tokens[:, :-1].astype(np.int32),
        targets=row_tokens[:, 1:].astype(np.int32),
        segment_ids=segment_ids.astype(np.int32),
        positions=positions.astype(np.int32),
        loss_mask=loss_mask.astype(np.float32),
    )
