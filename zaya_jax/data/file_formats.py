"""Sources read lazily from one file: JSON Lines, Parquet and ArrayRecord (`data/sources.py` opens them).

Each keeps only an index of its file (line offsets, row-group ends, the record count) and reads a
document when asked, through a handle opened on first use in each process (again after
unpickling: Grain pickles sources into its worker processes) and shared by threads.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from zaya_jax.data.document_source import DocumentSource
from zaya_jax.errors import ZayaError, quoted

# The jsonl line scan works on blocks of this many bytes so its temporaries stay small.
_SCAN_BLOCK = 16 << 20
_UTF8_BOM = b"\xef\xbb\xbf"
_PARQUET_CACHED_GROUPS = 4
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


# --- shared lazy file state ----------------------------------------------------------------


class LazyFileSource(DocumentSource):
    """A source reading one file through a handle opened on first use (again after unpickling).

    The handle and its lock are process-local, so pickling drops them; `_open_handle` creates one.
    """

    def __init__(self, path: Path):
        self.name, self._path = str(path), path
        self._lock = threading.Lock()
        self._handle = None

    def _open_handle(self):
        raise NotImplementedError

    def _get_handle(self):
        handle = self._handle
        if handle is None:
            with self._lock:  # two threads racing here must not both open a handle
                if self._handle is None:
                    self._handle = self._open_handle()
                handle = self._handle
        return handle

    def __getstate__(self):
        state = self.__dict__.copy()
        for key in self._process_local():
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._handle = None

    def _process_local(self) -> tuple[str, ...]:
        return ("_lock", "_handle")


# --- .jsonl ---------------------------------------------------------------------------------


class JsonlSource(LazyFileSource):
    """One document per non-blank line of a JSON Lines file, read with `os.pread` on demand."""

    def __init__(self, path: Path, text_field: str = "text"):
        super().__init__(path)
        self._text_field = text_field
        # _offsets[k]..._offsets[k+1] is line k (0-based, newline included); _lines the non-blank k.
        self._offsets, self._lines = _scan_lines(path)
        if not len(self._lines):
            raise ZayaError(f"data file {path} is empty (only blank lines); add one JSON object "
                            "per line or remove it")
        _check_objects(path, self._offsets, self._lines)

    def __len__(self) -> int:
        return len(self._lines)

    def _open_handle(self) -> int:
        try:
            return os.open(self._path, os.O_RDONLY)
        except OSError as e:
            raise ZayaError(f"data file {self._path} can no longer be opened ({e.strerror}); "
                            "keep data files in place while training") from e

    def _read(self, index: int) -> str:
        line = int(self._lines[index])
        start, end = int(self._offsets[line]), int(self._offsets[line + 1])
        # pread takes the offset explicitly, so threads sharing the fd never race on a position.
        raw = os.pread(self._get_handle(), end - start, start)
        return self._text(raw, line + 1, start)

    def _text(self, raw: bytes, lineno: int, start: int) -> str:
        where = f"data file {self._path} line {lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ZayaError(f"{where} is not valid UTF-8 at byte offset {start + e.start}; "
                            "re-encode the file as UTF-8") from e
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ZayaError(f"{where} is not valid JSON ({e.msg}); "
                            "each line must be one JSON object") from e
        field = self._text_field
        if not isinstance(record, dict):
            kind = _JSON_KINDS.get(type(record), type(record).__name__)
            raise ZayaError(f"{where} is a JSON {kind}, not an object; "
                            f"each line must be one JSON object with a '{field}' field")
        if field not in record:
            raise ZayaError(f"{where} has no '{field}' field; add it or pass the right text field")
        if not isinstance(record[field], str):
            raise ZayaError(f"{where}: field '{field}' is not a string; "
                            "store the document text as a JSON string")
        return record[field]

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                os.close(self._handle)
                self._handle = None

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            os.close(self._handle)


def _scan_lines(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Line start offsets (plus the file size) and the 0-based numbers of the non-blank lines.

    Scans a memory map block by block: newlines are where lines end, and a line is blank when all
    its bytes are ASCII whitespace. `carry` says whether the line still open at a block
    boundary has seen a non-blank byte.
    """
    data = np.memmap(path, dtype=np.uint8, mode="r")
    size = len(data)
    first = len(_UTF8_BOM) if bytes(data[:len(_UTF8_BOM)]) == _UTF8_BOM else 0
    starts, has_text, carry = [np.array([first], dtype=np.int64)], [], False
    for base in range(first, size, _SCAN_BLOCK):
        block = np.asarray(data[base:base + _SCAN_BLOCK])
        newlines = np.flatnonzero(block == ord("\n"))
        cuts = np.concatenate(([0], newlines + 1))
        cuts = cuts[cuts < len(block)]
        # One flag per piece between cuts: piece j < len(newlines) is the rest of the line ending
        # at newlines[j]; a piece after the last newline is the start of a line the next block ends.
        pieces = np.logical_or.reduceat(_non_blank(block), cuts)
        if len(newlines):
            closed = pieces[:len(newlines)].copy()
            closed[0] |= carry
            has_text.append(closed)
            carry = bool(pieces[len(newlines)]) if len(pieces) > len(newlines) else False
        else:
            carry = carry or bool(pieces[0])
        starts.append(newlines.astype(np.int64) + base + 1)
    if size > first and data[-1] != ord("\n"):  # a last line without a newline
        starts.append(np.array([size], dtype=np.int64))
        has_text.append(np.array([carry]))
    del data  # unmap now rather than when the garbage collector gets to it
    offsets = np.concatenate(starts)
    lines = np.flatnonzero(np.concatenate(has_text)) if has_text else np.zeros(0, dtype=np.int64)
    return offsets, lines


def _check_objects(path: Path, offsets: np.ndarray, lines: np.ndarray) -> None:
    """Every non-blank line opens a JSON object: its first byte is `{` (or whitespace before one).
    One look per line at the scan's offsets, so a line of plain text or binary anywhere in the file
    is refused when the file is opened, not when training reaches it; what is inside the braces
    is checked when the line is read."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    firsts = np.asarray(data[offsets[lines]])
    del data
    bad = np.flatnonzero((firsts != ord("{")) & _non_blank(firsts))
    if len(bad):
        line = int(lines[bad[0]])
        raise ZayaError(f"data file {path} line {line + 1} does not start a JSON object (it begins with byte "
                        f"{bytes([int(firsts[bad[0]])])!r}); each line must be one JSON object"
                        + (f" ({len(bad)} such lines)" if len(bad) > 1 else ""))


def _non_blank(block: np.ndarray) -> np.ndarray:
    """Which bytes are not ASCII whitespace (what bytes.strip removes: 9..13 and space)."""
    # uint8 arithmetic wraps bytes below 9 to above 246, so one compare covers both sides of 9..13;
    # several times faster than a 256-entry lookup table.
    return ((block - np.uint8(9)) > 4) & (block != ord(" "))


# --- .parquet -------------------------------------------------------------------------------


class ParquetSource(LazyFileSource):
    """One document per row of a Parquet file's string column `text_field`."""

    def __init__(self, path: Path, text_field: str = "text"):
        super().__init__(path)
        self._text_field = text_field
        self._handle = self._open_handle()
        _check_text_column(path, self._handle.schema_arrow, text_field)
        meta = self._handle.metadata
        self._group_ends = np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        if meta.num_rows == 0:
            raise ZayaError(f"data file {path} is empty (no rows); add documents to it or remove it")
        self._cache: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return int(self._group_ends[-1])

    def _open_handle(self):
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            return pq.ParquetFile(self._path)
        except (pa.ArrowException, OSError) as e:
            raise ZayaError(f"data file {self._path} is not a readable Parquet file "
                            f"({quoted(e)}); rewrite it with pyarrow or pass another file") from e

    def _read(self, index: int) -> str:
        group = int(np.searchsorted(self._group_ends, index, side="right"))
        start = int(self._group_ends[group - 1]) if group else 0
        text = self._row_group(group)[index - start].as_py()
        return "" if text is None else text

    def _row_group(self, group: int):
        # One lock for the cache and the read: a ParquetFile is not documented as thread-safe.
        handle = self._get_handle()
        with self._lock:
            column = self._cache.get(group)
            if column is None:
                column = handle.read_row_group(group, columns=[self._text_field]).column(0)
                self._cache[group] = column
                if len(self._cache) > _PARQUET_CACHED_GROUPS:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(group)
            return column

    def __setstate__(self, state):
        super().__setstate__(state)
        self._cache = OrderedDict()

    def _process_local(self) -> tuple[str, ...]:
        return ("_lock", "_handle", "_cache")


def _check_text_column(path: Path, schema, text_field: str) -> None:
    import pyarrow as pa
    columns = ", ".join(f"{f.name} ({f.type})" for f in schema)
    if text_field not in schema.names:
        raise ZayaError(f"data file {path} has no column '{text_field}' (columns: {columns}); "
                        "pass the right text field")
    kind = schema.field(text_field).type
    # str() for string_view: pa.types.is_string_view only exists from pyarrow 16.
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise ZayaError(f"data file {path} column '{text_field}' has type {kind}, not string "
                        f"(columns: {columns}); store the document text as a string column")


# --- ArrayRecord ----------------------------------------------------------------------------


class ArrayRecordSource(LazyFileSource):
    """One document per record of an ArrayRecord file; a record is the text's UTF-8 bytes.

    One reader serves all threads: its indexed `read([i])` is thread-safe (Grain's own
    ArrayRecordDataSource shares one reader per file the same way), unlike `seek`/`read()`.
    """

    def __init__(self, path: Path):
        super().__init__(path)
        self._handle = self._open_handle()
        self._len = self._handle.num_records()
        if self._len == 0:
            raise ZayaError(f"data file {path} is empty (no records); add documents to it or remove it")

    def __len__(self) -> int:
        return self._len

    def _open_handle(self):
        from array_record.python.array_record_module import ArrayRecordReader
        # Readahead helps sequential scans only; these reads are random.
        options = "readahead_buffer_size:0,max_parallelism:0"
        try:
            reader = ArrayRecordReader(str(self._path), options)
            if not reader.ok():
                reader.read([0])  # a reader that failed to open says why only when used
        except (RuntimeError, ValueError, OSError) as e:
            raise ZayaError(f"data file {self._path} is not a readable ArrayRecord file "
                            f"({quoted(e)}); rewrite it with ArrayRecordWriter or pass another "
                            "file") from e
        if not reader.ok():
            raise ZayaError(f"data file {self._path} is not a readable ArrayRecord file; "
                            "rewrite it with ArrayRecordWriter or pass another file")
        return reader

    def _read(self, index: int) -> str:
        raw = self._get_handle().read([index])[0]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ZayaError(f"data file {self._path} record {index} (from 0) is not valid UTF-8 at byte "
                            f"offset {e.start}; write each document's text encoded as UTF-8") from e

