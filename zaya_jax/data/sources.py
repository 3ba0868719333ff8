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
    the byte offset of each line is kept; a line that does not open an object (plain text,
    binary) is refused at open, what is inside the braces is parsed when the line is read.
  * `*.parquet`: one row per document, the text in the string column `text_field` (a null reads as
    ""). Reads load the whole row group holding the row (text column only) and keep the last few in
    a cache, so random access is cheap only with small row groups or locality in the index order.
  * `*.arrayrecord` / `*.array_record`: one record per document, each record the document's text
    as UTF-8 bytes, nothing else. Write with `ArrayRecordWriter(path, "group_size:1")`: larger
    groups make each random read decompress a whole group.
  * a directory: every file of the forms above beneath it, recursively, in path order, as one
    concatenated source.

Problems with the files found while opening (missing, empty, unreadable, wrong schema, a first
document that does not read) raise `ZayaError` at `open_source`; problems inside a later document (a bad JSON line, a non-UTF-8 record)
raise it when that document is read, naming the file and the line or record. The text may be ""
(callers skip empty documents).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from zaya_jax.data.document_source import DocumentSource
from zaya_jax.data.file_formats import ArrayRecordSource, JsonlSource, ParquetSource
from zaya_jax.errors import ZayaError

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
        opened = JsonlSource(path, text_field)
    elif suffix == ".parquet":
        opened = ParquetSource(path, text_field)
    else:
        opened = ArrayRecordSource(path)
    if len(opened):
        opened[0]  # a file that is not its format (binary, another schema) fails here, before the run starts
    return opened


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


__all__ = ["BUILTIN_CORPORA", "DocumentSource", "open_source"]
