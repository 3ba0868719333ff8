"""Corpora: turn a source string into a list of document texts.

A source is a built-in corpus (`builtin:python-docs`, shipped with Python, so every machine has
it), a `.txt` file (one document), a `.jsonl` file (one document per line, text in a named field)
or a directory holding such files. Everything is read into memory; anything malformed raises
`ZayaError` naming the file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from zaya_jax.errors import ZayaError

BUILTIN_CORPORA = ("python-docs",)
_BUILTIN_PREFIX = "builtin:"
# A .txt file above this size is a corpus in one file, not one document: split it so a single
# document does not dominate the held-out split or one epoch's ordering.
_SPLIT_ABOVE_CHARS = 1 << 20
_CHUNK_CHARS = 64 << 10


def load_documents(source: str, text_field: str = "text") -> list[str]:
    """All documents of `source`, in a deterministic order; raises ZayaError if there are none."""
    if source.startswith(_BUILTIN_PREFIX):
        return _builtin(source[len(_BUILTIN_PREFIX):])
    path = Path(source).expanduser()
    if not path.exists():
        raise ZayaError(f"data source {source} does not exist; pass a .txt/.jsonl file, a directory, "
                        f"or one of {_builtin_names()}")
    if path.is_dir():
        docs = _directory(path, text_field)
    else:
        docs = _file(path, text_field)
    if not docs:
        raise ZayaError(f"data source {path} holds no documents; add non-empty text to it")
    return docs


def _builtin_names() -> str:
    return ", ".join(_BUILTIN_PREFIX + name for name in BUILTIN_CORPORA)


def _builtin(name: str) -> list[str]:
    if name != "python-docs":
        raise ZayaError(f"unknown built-in corpus {_BUILTIN_PREFIX}{name}; known: {_builtin_names()}")
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise ZayaError(f"{_BUILTIN_PREFIX}{name} needs the pydoc_data module, which this Python "
                        "lacks; install your distribution's full Python stdlib or pass a text file") from e
    return [topics[key] for key in sorted(topics) if topics[key].strip()]


def _directory(path: Path, text_field: str) -> list[str]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))
    if not files:
        raise ZayaError(f"directory {path} has no .txt or .jsonl files; add some or pass a file")
    docs = []
    for file in files:
        docs.extend(_file(file, text_field))
    return docs


def _file(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".jsonl":
        return _jsonl(path, text_field)
    if path.suffix == ".txt":
        return _txt(path)
    raise ZayaError(f"data file {path} is neither .txt nor .jsonl; rename it or convert it")


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


def _jsonl(path: Path, text_field: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        text = _jsonl_text(path, lineno, line, text_field)
        if text.strip():
            docs.append(text)
    if not docs:
        raise ZayaError(f"data file {path} has no non-empty '{text_field}' values; "
                        "check the file or pass the right text field")
    return docs


def _jsonl_text(path: Path, lineno: int, line: str, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ZayaError(f"data file {path} line {lineno} is not valid JSON ({e.msg}); "
                        "each line must be one JSON object") from e
    if not isinstance(record, dict) or text_field not in record:
        raise ZayaError(f"data file {path} line {lineno} has no '{text_field}' field; "
                        "add it or pass the right text field")
    if not isinstance(record[text_field], str):
        raise ZayaError(f"data file {path} line {lineno}: field '{text_field}' is not a string; "
                        "store the document text as a JSON string")
    return record[text_field]
