"""Document sources: random access to the documents of a corpus, without loading it into memory.

`open_source(spec)` turns a source string into a `DocumentSource`: a sized, indexable sequence of
document texts that `grain.MapDataset.source(...)` can wrap. Grain calls `__getitem__` from several
threads at once and pickles sources into worker processes, so every source reads thread-safely
(`os.pread`, or a shared reader behind a lock) and opens its files lazily again after unpickling.

Forms of `spec`:
  * `builtin:python-docs`: the topic texts that ship with Python (`pydoc_data`), so every machine
    has a corpus; held in memory.
  * `*.txt`: one document, or paragraph-grouped chunks of about 64 KiB when above 1 MiB; held in
    memory (put large corpora in one of the formats below).
  * `*.jsonl`: one JSON object per line, the text in `text_field`; blank lines are skipped. Only
    the byte offset of each line is kept; a line is parsed when it is read.
  * `*.parquet`: one row per document, the text in the string column `text_field` (a null reads as
    ""). Reads load the whole row group holding the row (text column only) and keep the last few in
    a cache, so random access is cheap only with small row groups or locality in the index order.
  * `*.arrayrecord` / `*.array_record`: one record per document, each record the document's text
    as UTF-8 bytes, nothing else. Write with `ArrayRecordWriter(path, "group_size:1")`: larger
    groups make each random read decompress a whole group.
  * a directory: every file of the forms above beneath it, recursively, in path order, as one
    concatenated source.

Problems with the files found while opening (missing, empty, unreadable, wrong schema) raise
`ZayaError` at `open_source`; problems inside one document (a bad JSON line, a non-UTF-8 record)
raise it when that document is read, naming the file and the line or record. The text may be ""
(callers skip empty documents).
"""

from __future__ import annotations

import json
import operator
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from zaya_jax.errors import ZayaError, quoted

BUILTIN_CORPORA = ("python-docs",)
_BUILTIN_PREFIX = "builtin:"
# A .txt file above this size is a corpus in one file, not one document: split it so a single
# document does not dominate the held-out split or one epoch's ordering.
_SPLIT_ABOVE_CHARS = 1 << 20
_CHUNK_CHARS = 64 << 10
_ARRAY_RECORD_SUFFIXES = (".arrayrecord", ".array_record")
_SUFFIXES = (".txt", ".jsonl", ".parquet") + _ARRAY_RECORD_SUFFIXES
_FORMS = ("a .txt, .jsonl, .parquet or .arrayrecord file, a directory of them, "
          f"or {', '.join(_BUILTIN_PREFIX + name for name in BUILTIN_CORPORA)}")
# The jsonl line scan works on blocks of this many bytes so its temporaries stay small.
_SCAN_BLOCK = 16 << 20
_UTF8_BOM = b"\xef\xbb\xbf"
_PARQUET_CACHED_GROUPS = 4
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


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


def open_source(spec: str, text_field: str = "text") -> DocumentSource:
    """The documents of `spec` (see the module docstring); raises ZayaError if it holds none."""
    if spec.startswith(_BUILTIN_PREFIX):
        return _builtin(spec[len(_BUILTIN_PREFIX):])
    path = Path(spec).expanduser()
    if not path.exists():
        raise ZayaError(f"data source {spec} does not exist; pass {_FORMS}")
    if path.is_dir():
        return _directory(path, text_field)
    return _file(path, text_field)


class _ListSource(DocumentSource):
    """Documents already in memory (the built-in corpus, .txt files)."""

    def __init__(self, name: str, docs: list[str]):
        self.name, self._docs = name, docs

    def __len__(self) -> int:
        return len(self._docs)

    def _read(self, index: int) -> str:
        return self._docs[index]


class _ConcatSource(DocumentSource):
    """Several sources end to end; a global index maps to (source, local index) by bisection."""

    def __init__(self, name: str, parts: list[DocumentSource]):
        self.name, self._parts = name, parts
        self._ends = np.cumsum([len(p) for p in parts])

    def __len__(self) -> int:
        return int(self._ends[-1])

    def _read(self, index: int) -> str:
        part = int(np.searchsorted(self._ends, index, side="right"))
        start = int(self._ends[part - 1]) if part else 0
        return self._parts[part][index - start]


def _builtin(name: str) -> DocumentSource:
    if name not in BUILTIN_CORPORA:
        raise ZayaError(f"unknown built-in corpus {_BUILTIN_PREFIX}{name}; pass {_FORMS}")
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise ZayaError(f"{_BUILTIN_PREFIX}{name} needs the pydoc_data module, which this Python "
                        "lacks; install your distribution's full Python stdlib or pass a text file") from e
    docs = [topics[key] for key in sorted(topics) if topics[key].strip()]
    return _ListSource(_BUILTIN_PREFIX + name, docs)


def _directory(path: Path, text_field: str) -> DocumentSource:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _SUFFIXES)
    if not files:
        raise ZayaError(f"directory {path} has no .txt, .jsonl, .parquet or .arrayrecord files; "
                        "add some or pass a file")
    return _ConcatSource(str(path), [_file(file, text_field) for file in files])


def _file(path: Path, text_field: str) -> DocumentSource:
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ZayaError(f"data file {path} is not a supported format; pass {_FORMS}")
    if path.stat().st_size == 0:
        raise ZayaError(f"data file {path} is empty; add documents to it or remove it")
    if suffix == ".txt":
        return _ListSource(str(path), _txt(path))
    if suffix == ".jsonl":
        return _JsonlSource(path, text_field)
    if suffix == ".parquet":
        return _ParquetSource(path, text_field)
    return _ArrayRecordSource(path)


# --- .txt -----------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ZayaError(f"data file {path} is not valid UTF-8 at byte offset {e.start}; "
                        "re-encode it as UTF-8") from e
    text = text.removeprefix("\ufeff")  # a BOM is encoding metadata, not text to train on
    if not text.strip():
        raise ZayaError(f"data file {path} is empty; add text to it or remove it")
    return text


def _txt(path: Path) -> list[str]:
    text = _read_text(path)
    if len(text) <= _SPLIT_ABOVE_CHARS:
        return [text]
    return _chunk_paragraphs(text)


def _chunk_paragraphs(text: str) -> list[str]:
    """Group blank-line-separated paragraphs greedily into documents of about _CHUNK_CHARS."""
    docs, current, size = [], [], 0
    for para in text.split("\n\n"):
        if not para.strip():
            continue
        current.append(para)
        size += len(para) + 2
        if size >= _CHUNK_CHARS:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    return docs


# --- shared lazy file state ----------------------------------------------------------------


class _LazyFileSource(DocumentSource):
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


class _JsonlSource(_LazyFileSource):
    """One document per non-blank line of a JSON Lines file, read with `os.pread` on demand."""

    def __init__(self, path: Path, text_field: str = "text"):
        super().__init__(path)
        self._text_field = text_field
        # _offsets[k]..._offsets[k+1] is line k (0-based, newline included); _lines the non-blank k.
        self._offsets, self._lines = _scan_lines(path)
        if not len(self._lines):
            raise ZayaError(f"data file {path} is empty (only blank lines); add one JSON object "
                            "per line or remove it")

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


def _non_blank(block: np.ndarray) -> np.ndarray:
    """Which bytes are not ASCII whitespace (what bytes.strip removes: 9..13 and space)."""
    # uint8 arithmetic wraps bytes below 9 to above 246, so one compare covers both sides of 9..13;
    # several times faster than a 256-entry lookup table.
    return ((block - np.uint8(9)) > 4) & (block != ord(" "))


# --- .parquet -------------------------------------------------------------------------------


class _ParquetSource(_LazyFileSource):
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


class _ArrayRecordSource(_LazyFileSource):
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


__all__ = ["BUILTIN_CORPORA", "DocumentSource", "open_source"]
