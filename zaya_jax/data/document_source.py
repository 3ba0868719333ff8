"""The interface every document source has: a sized, indexable, picklable sequence of texts."""

from __future__ import annotations

import operator


class DocumentSource:
    """A sized, indexable, picklable sequence of document texts; `name` is used in messages."""

    name: str

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> str:
        return self._read(self._check_index(index))

    def _read(self, index: int) -> str:
        """The document at `index`, already checked to lie in [0, len)."""
        raise NotImplementedError

    def _check_index(self, index) -> int:
        i, n = operator.index(index), len(self)
        if i < 0:
            i += n  # negative indices count from the end, as for a list
        if not 0 <= i < n:
            raise IndexError(f"document index {index} out of range for {self.name} ({n} documents)")
        return i

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {len(self)} documents)"
