"""Streaming packing: a Grain iterator of tokenized documents → fixed-length rows, checkpointable.

The rows are exactly those of `packing.pack_documents` on the same document stream (an eos after
each document, rows of `seq_len + 1` tokens overlapping by one, segment ids / positions / loss
mask per row), but cut on the fly from an endless stream, so a corpus never has to fit in
memory. The iterator's state is small and exact: the parent's state just before the document
that holds the next row's first token, and that token's offset in the document. Restoring it
replays that one document and continues with the very next row.
"""

from __future__ import annotations

import collections

import grain
import numpy as np

from zaya_jax.data.packing import rows_from_stream


class PackedRowsIterDataset(grain.IterDataset):
    """Rows of `seq_len` tokens from a parent yielding int32 token arrays (eos not included)."""

    def __init__(self, parent: grain.IterDataset, seq_len: int, eos_id: int, pad_id: int):
        super().__init__(parent)
        self._seq_len, self._eos_id, self._pad_id = int(seq_len), int(eos_id), int(pad_id)

    def __iter__(self) -> grain.DatasetIterator:
        return _PackedRowsIterator(self._parent.__iter__(), self._seq_len, self._eos_id, self._pad_id)

    def __str__(self) -> str:
        return f"PackedRowsIterDataset(seq_len={self._seq_len})"


class _PackedRowsIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, seq_len: int, eos_id: int, pad_id: int):
        super().__init__(parent)
        self._seq_len, self._eos_id, self._pad_id = seq_len, eos_id, pad_id
        # Documents (with eos) that the next row may draw from, each with the parent state
        # captured just before it was read; the next row starts at docs[0][offset].
        self._docs: collections.deque[tuple[dict, np.ndarray]] = collections.deque()
        self._offset = 0
        self._finished = False

    def _read_document(self) -> tuple[dict, np.ndarray]:
        while True:  # an empty document has nothing to predict: skip it, as pack_documents does
            before = self._parent.get_state()
            tokens = np.asarray(next(self._parent), np.int32)
            if tokens.size:
                return before, np.append(tokens, np.int32(self._eos_id))

    def __next__(self) -> dict[str, np.ndarray]:
        if self._finished:
            raise StopIteration
        need = self._seq_len + 1
        have = sum(t.size for _, t in self._docs) - self._offset
        while have < need:
            try:
                doc = self._read_document()
            except StopIteration:
                if have <= 1:  # one token left: it was already the last row's final target
                    self._finished = True
                    raise
                break
            self._docs.append(doc)
            have += doc[1].size
        row = self._cut_row(need)
        self._advance(have < need)
        return row

    def _cut_row(self, need: int) -> dict[str, np.ndarray]:
        tokens, owners, offset = [], [], self._offset
        for serial, (_, doc) in enumerate(self._docs):
            piece = doc[offset:offset + need]
            tokens.append(piece)
            owners.append(np.full(piece.size, serial, np.int64))
            need, offset = need - piece.size, 0
            if need == 0:
                break
        return rows_from_stream(np.concatenate(tokens), np.concatenate(owners), self._seq_len, self._pad_id)

    def _advance(self, was_last: bool) -> None:
        if was_last:
            self._finished = True
            return
        # Rows overlap by one token: the next row starts on this row's last token.
        position = self._offset + self._seq_len
        while position >= self._docs[0][1].size:
            position -= self._docs[0][1].size
            self._docs.popleft()
        self._offset = position

    def get_state(self) -> dict:
        parent = self._docs[0][0] if self._docs else self._parent.get_state()
        return {"parent": parent, "offset": int(self._offset), "finished": bool(self._finished)}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._docs.clear()
        self._offset = int(state["offset"])
        self._finished = bool(state.get("finished", False))
        # The next document read is the one the offset points into.

    def __str__(self) -> str:
        return f"PackedRowsDatasetIterator(seq_len={self._seq_len})"
