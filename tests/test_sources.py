"""Document sources: every format round-trips, reads are thread-safe and picklable, bad input is a ZayaError."""

import json
import pickle
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from zaya_jax.data.file_formats import _scan_lines
from zaya_jax.data.sources import DocumentSource, open_source
from zaya_jax.errors import ZayaError

DOCS = ["first doc", "", "zweite Übung ü", "line one\nline two", "x" * 5000]


def _write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)),
                    encoding="utf-8")
    return str(path)


def _write_parquet(path, docs, row_group_size=2, **columns):
    pq.write_table(pa.table({"text": docs, **columns}), path, row_group_size=row_group_size)
    return str(path)


def _write_arrayrecord(path, records):
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()
    return str(path)


def _all(source):
    return [source[i] for i in range(len(source))]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrayrecord"])
def test_formats_round_trip(tmp_path, fmt):
    spec = {"jsonl": lambda: _write_jsonl(tmp_path / "d.jsonl", DOCS),
            "parquet": lambda: _write_parquet(tmp_path / "d.parquet", DOCS),
            "arrayrecord": lambda: _write_arrayrecord(tmp_path / "d.arrayrecord",
                                                      [d.encode() for d in DOCS])}[fmt]()
    source = open_source(spec)
    assert isinstance(source, DocumentSource) and source.name == spec
    assert len(source) == len(DOCS) and _all(source) == DOCS and list(source) == DOCS
    assert source[-1] == DOCS[-1]
    for bad in (len(DOCS), -len(DOCS) - 1):
        with pytest.raises(IndexError):
            source[bad]
    clone = pickle.loads(pickle.dumps(source))
    assert _all(clone) == DOCS and clone.name == spec


def test_txt_and_builtin(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufeffsome text ü\n".encode())
    source = open_source(str(tmp_path / "a.txt"))
    assert _all(source) == ["some text ü\n"] and _all(pickle.loads(pickle.dumps(source))) == _all(source)
    docs = _all(open_source("builtin:python-docs"))
    assert len(docs) > 50 and all(d.strip() for d in docs)
    assert docs == _all(open_source("builtin:python-docs"))  # stable order


def test_large_txt_is_split_into_paragraph_groups(tmp_path):
    text = "\n\n".join(f"{i} {'word ' * 2000}" for i in range(150))  # ~1.5 MB
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    docs = _all(open_source(str(tmp_path / "big.txt")))
    assert 15 < len(docs) < 30 and all(len(d) < 80_000 for d in docs)
    assert "\n\n".join(docs) == text


def test_jsonl_blank_lines_text_field_and_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"body": "a"}\n\n  \t\r\n{"body": "b"}\r\n{"text": "c"}\n\n{"body": "d"}')
    source = open_source(str(path), text_field="body")
    assert len(source) == 4 and [source[i] for i in range(2)] == ["a", "b"] and source[3] == "d"
    with pytest.raises(ZayaError, match=r"line 5 has no 'body' field") as err:
        source[2]
    assert str(path) in str(err.value)


def test_jsonl_scan_across_blocks(tmp_path, monkeypatch):
    # Blocks smaller than a line exercise lines (blank or not) that span block boundaries.
    monkeypatch.setattr("zaya_jax.data.file_formats._SCAN_BLOCK", 7)
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "alpha beta"}\n' + " " * 20 + '\n\n{"text": "g"}\n' + " " * 9, encoding="utf-8")
    assert _all(open_source(str(path))) == ["alpha beta", "g"]


def test_jsonl_line_scan_matches_split(tmp_path, monkeypatch):
    # Random short files and block sizes against bytes.split: line bounds and blank-line detection.
    rng = random.Random(0)
    path = tmp_path / "d.jsonl"
    for _ in range(300):
        data = bytes(rng.choice(b"  \n\n\tab\r") for _ in range(rng.randrange(1, 30)))
        path.write_bytes(data)
        monkeypatch.setattr("zaya_jax.data.file_formats._SCAN_BLOCK", rng.randrange(1, 10))
        offsets, lines = _scan_lines(path)
        pieces = data.removesuffix(b"\n").split(b"\n")
        assert offsets[0] == 0 and offsets[-1] == len(data)
        assert [data[a:b].removesuffix(b"\n") for a, b in zip(offsets[:-1], offsets[1:])] == pieces
        assert list(lines) == [i for i, p in enumerate(pieces) if p.strip()]


def test_directory_concatenates_in_path_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("b doc", encoding="utf-8")
    _write_jsonl(tmp_path / "a.jsonl", ["a1", "a2"])
    _write_parquet(tmp_path / "sub" / "c.parquet", ["c1", "c2", "c3"])
    _write_arrayrecord(tmp_path / "sub" / "d.array_record", [b"d1"])
    (tmp_path / "ignored.md").write_text("not data", encoding="utf-8")
    source = open_source(str(tmp_path))
    expected = ["a1", "a2", "b doc", "c1", "c2", "c3", "d1"]
    assert source.name == str(tmp_path) and len(source) == len(expected)
    assert _all(source) == expected and _all(pickle.loads(pickle.dumps(source))) == expected


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrayrecord"])
def test_concurrent_reads_match_sequential(tmp_path, fmt):
    docs = [f"document {i} " * (i % 7 + 1) for i in range(500)]
    spec = {"jsonl": lambda: _write_jsonl(tmp_path / "d.jsonl", docs),
            "parquet": lambda: _write_parquet(tmp_path / "d.parquet", docs, row_group_size=37),
            "arrayrecord": lambda: _write_arrayrecord(tmp_path / "d.arrayrecord",
                                                      [d.encode() for d in docs])}[fmt]()
    source = open_source(spec)
    order = [(i * 7919) % len(docs) for i in range(4000)]  # jumps between row groups
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(source.__getitem__, order)) == [docs[i] for i in order]


def test_grain_can_wrap_a_source(tmp_path):
    grain = pytest.importorskip("grain")
    source = open_source(_write_jsonl(tmp_path / "d.jsonl", DOCS))
    assert list(grain.MapDataset.source(source)) == DOCS


@pytest.mark.parametrize("name,data,needle", [
    ("empty.txt", b"", "empty"),
    ("blank.txt", b"  \n\n ", "empty"),
    ("bad.txt", b"ok\n\xff\xfe", "byte offset 3"),
    ("empty.jsonl", b"", "empty"),
    ("blank.jsonl", b"\n  \n\r\n", "empty"),
    ("empty.parquet", b"", "empty"),
    ("empty.arrayrecord", b"", "empty"),
    ("corrupt.parquet", b"PAR1 not really parquet", "not a readable Parquet file"),
    ("corrupt.arrayrecord", b"not an array record" * 10, "not a readable ArrayRecord file"),
    ("data.csv", b"a,b\n", ".jsonl"),
])
def test_bad_files_fail_at_open(tmp_path, name, data, needle):
    (tmp_path / name).write_bytes(data)
    _assert_error(lambda: open_source(str(tmp_path / name)), needle, str(tmp_path / name))


@pytest.mark.parametrize("data,needle", [
    (b'{"text": "a"}\n\n{"text": \n', "line 3 is not valid JSON"),
    (b'{"text": "a"}\n{"body": "b"}\n', "line 2 has no 'text' field"),
    (b'{"text": "a"}\n{"text": 5}\n', "line 2: field 'text' is not a string"),
    (b'{"text": "a"}\n{"text": "\xff"}\n', "line 2 is not valid UTF-8 at byte offset 24"),
])
def test_bad_jsonl_lines_fail_at_read(tmp_path, data, needle):
    """What is inside a line's braces is checked when the line is read."""
    (tmp_path / "d.jsonl").write_bytes(data)
    source = open_source(str(tmp_path / "d.jsonl"))
    assert source[0] == "a"
    _assert_error(lambda: source[1], needle, str(tmp_path / "d.jsonl"))


@pytest.mark.parametrize("data,needle", [
    (b'{"text": "a"}\n["text"]\n', "line 2 does not start a JSON object (it begins with byte b'['"),
    (b'{"text": "a"}\nnull\n', "line 2 does not start a JSON object (it begins with byte b'n'"),
    (b'{"text": "a"}\n\nplain text\n{"text": "b"}\n\x00\x01\n', "line 3 does not start a JSON object (it begins "
                                                                    "with byte b'p'); each line must be one JSON "
                                                                    "object (2 such lines)"),
])
def test_a_line_that_is_not_an_object_anywhere_in_the_file_fails_at_open(tmp_path, data, needle):
    (tmp_path / "d.jsonl").write_bytes(data)
    _assert_error(lambda: open_source(str(tmp_path / "d.jsonl")), re.escape(needle), str(tmp_path / "d.jsonl"))
    (tmp_path / "ok.jsonl").write_bytes(b'{"text": "a"}\n  \t{"text": "indented"}\n')
    assert open_source(str(tmp_path / "ok.jsonl"))[1] == "indented"


def test_bad_parquet_and_arrayrecord_contents(tmp_path):
    no_rows = _write_parquet(tmp_path / "none.parquet", pa.array([], pa.string()))
    _assert_error(lambda: open_source(no_rows), r"empty \(no rows\)", no_rows)
    spec = _write_parquet(tmp_path / "d.parquet", ["a"], body=["b"], n=[1])
    _assert_error(lambda: open_source(spec, text_field="missing"), "no column 'missing'.*body", spec)
    _assert_error(lambda: open_source(spec, text_field="n"), "'n' has type int64, not string", spec)
    assert _all(open_source(spec, text_field="body")) == ["b"]
    no_records = _write_arrayrecord(tmp_path / "none.arrayrecord", [])
    _assert_error(lambda: open_source(no_records), r"empty \(no records\)", no_records)
    bad_utf8 = _write_arrayrecord(tmp_path / "bad.arrayrecord", [b"ok", b"\xffno"])
    source = open_source(bad_utf8)
    assert source[0] == "ok"
    _assert_error(lambda: source[1], "record 1 .*not valid UTF-8", bad_utf8)


def test_bad_specs(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    _assert_error(lambda: open_source(missing), "does not exist", missing)
    _assert_error(lambda: open_source("builtin:nope"), "builtin:python-docs", "builtin:nope")
    _assert_error(lambda: open_source(str(tmp_path)), "no .txt, .jsonl", str(tmp_path))


def _assert_error(call, needle, name):
    with pytest.raises(ZayaError, match=needle) as err:
        call()
    assert name in str(err.value) and "\n" not in str(err.value)
