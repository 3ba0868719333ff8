"""Training data: corpora, tokenizers, packing and batches (numpy only, no model)."""

import json

import numpy as np
import pytest

from zaya_jax.data import (
    ByteTokenizer,
    HFTokenizer,
    TextBatches,
    load_documents,
    load_tokenizer,
    pack_documents,
)
from zaya_jax.errors import ZayaError

EOS, PAD = 2, 0


def _docs(lengths, start=10):
    """Documents of distinct tokens, so every token in a stream is identifiable."""
    out, next_id = [], start
    for n in lengths:
        out.append(list(range(next_id, next_id + n)))
        next_id += n
    return out


def _check_packing(docs, seq_len):
    rows = pack_documents(docs, seq_len, eos_id=EOS, pad_id=PAD)
    stream = [t for d in docs if d for t in d + [EOS]]
    # Rows tile the stream with stride seq_len: flattened, the targets are the stream minus its
    # first token and the inputs the stream minus its last, then only padding. Nothing is dropped
    # or duplicated.
    n = len(stream) - 1
    flat_in, flat_tgt = rows.inputs.ravel(), rows.targets.ravel()
    assert flat_tgt[:n].tolist() == stream[1:] and flat_in[:n].tolist() == stream[:-1]
    assert (flat_tgt[n:] == PAD).all() and (rows.segment_ids.ravel()[n + 1:] == 0).all()
    assert rows.num_rows == -(-n // seq_len)
    # Check the per-row metadata against the document index of every stream token.
    doc_of = [i for i, d in enumerate(x for x in docs if x) for _ in d + [EOS]]
    for r in range(rows.num_rows):
        expect_seg, expect_pos = 0, 0
        for s in range(seq_len):
            i = r * seq_len + s  # stream index of this input
            if i >= len(stream):  # padding: only at the end of the last row
                assert r == rows.num_rows - 1 and rows.inputs[r, s] == PAD
                assert rows.segment_ids[r, s] == rows.positions[r, s] == rows.loss_mask[r, s] == 0
                continue
            if s == 0 or doc_of[i] != doc_of[i - 1]:
                expect_seg, expect_pos = expect_seg + 1, 0
            assert rows.segment_ids[r, s] == expect_seg and rows.positions[r, s] == expect_pos
            # Trained only where the target is in the input's document (its own eos included).
            same_doc = i + 1 < len(stream) and doc_of[i + 1] == doc_of[i]
            assert rows.loss_mask[r, s] == float(same_doc), (r, s)
            assert same_doc or stream[i] == EOS  # only an eos precedes a boundary
            expect_pos += 1
    return rows


@pytest.mark.parametrize("lengths,seq_len", [
    ([5, 3, 8, 1, 12], 4),
    ([5, 3, 8, 1, 12], 7),
    ([3, 3], 4),  # stream of 8 = 2 rows of 4 + 1: no padding at all
    ([40], 8),  # one document spanning many rows
    ([2, 0, 2], 3),  # empty documents are skipped
    ([1], 16),  # one short partial row
])
def test_packing_invariants(lengths, seq_len):
    rows = _check_packing(_docs(lengths), seq_len)
    assert rows.inputs.dtype == rows.targets.dtype == rows.segment_ids.dtype == np.int32
    assert rows.positions.dtype == np.int32 and rows.loss_mask.dtype == np.float32
    assert rows.inputs.shape == (rows.num_rows, seq_len)


def test_packing_example_by_hand():
    rows = pack_documents([[10, 11], [20, 21, 22]], seq_len=4, eos_id=EOS, pad_id=PAD)
    # stream: 10 11 e | 20 21 22 e  → rows [10 11 e 20 | 21] and [21 22 e pad | pad]
    assert rows.inputs.tolist() == [[10, 11, 2, 20], [21, 22, 2, 0]]
    assert rows.targets.tolist() == [[11, 2, 20, 21], [22, 2, 0, 0]]
    assert rows.segment_ids.tolist() == [[1, 1, 1, 2], [1, 1, 1, 0]]
    assert rows.positions.tolist() == [[0, 1, 2, 0], [0, 1, 2, 0]]
    assert rows.loss_mask.tolist() == [[1, 1, 0, 1], [1, 1, 0, 0]]
    assert rows.num_loss_tokens == 5  # 11, e, 21, 22, e; 20 follows an eos and is not trained


def test_packing_no_documents():
    assert pack_documents([[], []], 8, EOS).num_rows == 0
    with pytest.raises(ZayaError, match="seq_len"):
        pack_documents([[1]], 0, EOS)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🙂\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and min(ids) >= 3 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
    assert tok.vocab_size == 259 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.decode([3 + 0xFF]) == "\ufffd"  # invalid UTF-8 decodes with replacement
    assert load_tokenizer("bytes").encode("a") == [ord("a") + 3]
    assert load_tokenizer("bytes", eos_id=2).eos_id == 2
    with pytest.raises(ZayaError, match="fixed ids"):
        load_tokenizer("bytes", eos_id=5)


def _hf_tokenizer_file(path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "</s>"])
    tok.train_from_iterator(["the cat sat on the mat", "a dog and a cat"], trainer)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def test_hf_tokenizer_round_trip(tmp_path):
    file = _hf_tokenizer_file(tmp_path)
    tok = load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.eos_id) == (0, 2) and tok.vocab_size == 3 + 8
    ids = tok.encode("the cat sat on a mat")
    assert len(ids) == 6 and all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == "the cat sat on a mat"
    assert tok.encode_batch(["a dog", "the cat"]) == [tok.encode("a dog"), tok.encode("the cat")]
    assert load_tokenizer(str(file), eos_id=1, pad_id=2).eos_id == 1
    with pytest.raises(ZayaError, match="outside the vocabulary"):
        load_tokenizer(str(file), eos_id=999)


def test_builtin_corpus():
    docs = load_documents("builtin:python-docs")
    assert len(docs) > 50 and all(d.strip() for d in docs)
    assert docs == load_documents("builtin:python-docs")  # stable order


def test_file_and_directory_corpora(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second doc", encoding="utf-8")
    (tmp_path / "a.jsonl").write_text(
        '{"text": "j1"}\n\n{"text": "j2", "id": 3}\n{"text": ""}\n', encoding="utf-8")
    (tmp_path / "sub" / "c.txt").write_text("nested ü", encoding="utf-8")
    (tmp_path / "ignored.md").write_text("not data", encoding="utf-8")
    assert load_documents(str(tmp_path)) == ["j1", "j2", "second doc", "nested ü"]
    assert load_documents(str(tmp_path / "b.txt")) == ["second doc"]
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    assert load_documents(str(tmp_path / "c.jsonl"), text_field="body") == ["x"]


def test_large_txt_is_split_into_paragraph_groups(tmp_path):
    para = "word " * 2000  # 10 KB
    text = "\n\n".join(f"{i} {para}" for i in range(150))  # ~1.5 MB
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    docs = load_documents(str(tmp_path / "big.txt"))
    assert 15 < len(docs) < 30 and all(len(d) < 80_000 for d in docs)
    assert "\n\n".join(docs) == text


def _write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("name,data,needle", [
    ("empty.txt", b"", "empty"),
    ("blank.txt", b"  \n\n ", "empty"),
    ("bad.txt", b"ok\n\xff\xfe", "byte offset 3"),
    ("bad.jsonl", b'{"text": "a"}\n{"text": \n', "line 2"),
    ("nofield.jsonl", b'{"text": "a"}\n{"body": "b"}\n', "line 2"),
    ("notobj.jsonl", b'["text"]\n', "line 1"),
    ("numtext.jsonl", b'{"text": 5}\n', "line 1"),
    ("allempty.jsonl", b'{"text": ""}\n', "no non-empty"),
    ("data.csv", b"a,b\n", ".jsonl"),
])
def test_bad_corpus_inputs(tmp_path, name, data, needle):
    source = _write(tmp_path / name, data)
    with pytest.raises(ZayaError, match=needle) as err:
        load_documents(source)
    assert source in str(err.value) and "\n" not in str(err.value)


def test_bad_corpus_sources(tmp_path):
    with pytest.raises(ZayaError, match="does not exist") as err:
        load_documents(str(tmp_path / "missing.txt"))
    assert "missing.txt" in str(err.value)
    with pytest.raises(ZayaError, match="builtin:python-docs"):
        load_documents("builtin:nope")
    with pytest.raises(ZayaError, match="no .txt or .jsonl") as err:
        load_documents(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_bad_tokenizer_inputs(tmp_path, monkeypatch):
    with pytest.raises(ZayaError, match="does not exist") as err:
        load_tokenizer(str(tmp_path / "nope.json"))
    assert "nope.json" in str(err.value)
    with pytest.raises(ZayaError, match="does not exist") as err:
        load_tokenizer(str(tmp_path))  # a directory without tokenizer.json
    assert "tokenizer.json" in str(err.value)
    broken = _write(tmp_path / "broken.json", b"{not json")
    with pytest.raises(ZayaError, match="could not be parsed") as err:
        load_tokenizer(broken)
    assert broken in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)
    with pytest.raises(ZayaError, match="pip install tokenizers"):
        load_tokenizer(broken)


def _corpus(n=60, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    return [f"doc{i} " + " ".join(rng.choice(words, rng.integers(3, 40))) for i in range(n)]


def test_batches_deterministic_and_seeded():
    docs, tok = _corpus(), ByteTokenizer()
    a = TextBatches(docs, tok, seq_len=32, seed=1, heldout_fraction=0.1)
    b = TextBatches(docs, tok, seq_len=32, seed=1, heldout_fraction=0.1)
    c = TextBatches(docs, tok, seq_len=32, seed=2, heldout_fraction=0.1)
    for step in (0, 3, 50):
        for key, value in a.train_batch(step, 8).items():
            assert np.array_equal(value, b.train_batch(step, 8)[key])
    assert not np.array_equal(a.train_batch(0, 8)["inputs"], c.train_batch(0, 8)["inputs"])
    batch = a.train_batch(0, 8)
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
    assert all(v.shape == (8, 32) for v in batch.values())
    assert a.train_tokens == int(a.train.loss_mask.sum()) > 0


def test_epochs_cover_rows_and_reshuffle():
    data = TextBatches(_corpus(), ByteTokenizer(), seq_len=16, seed=0)
    n, bs = data.num_train_rows, 7
    assert data.num_eval_rows == 0 and list(data.eval_batches(4)) == []
    # Samples 0..3n-1 across batches that straddle epoch boundaries.
    steps = -(-3 * n // bs)
    seen = np.concatenate([data.train_batch(s, bs)["inputs"] for s in range(steps)])[: 3 * n]
    all_rows = sorted(r.tobytes() for r in data.train.inputs)
    epochs = seen.reshape(3, n, -1)
    for e in epochs:
        assert sorted(r.tobytes() for r in e) == all_rows  # each epoch visits every row once
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])


def test_fewer_rows_than_batch_wraps():
    data = TextBatches(["tiny doc"], ByteTokenizer(), seq_len=4, seed=0)
    assert data.num_train_rows == 2  # 8 bytes + eos = 8 targets
    batch = data.train_batch(0, 10)
    assert sorted(batch["inputs"][:2].tolist()) == sorted(data.train.inputs.tolist())
    assert batch["inputs"].shape == (10, 4)
    with pytest.raises(ZayaError, match="no training rows"):
        TextBatches(["", ""], ByteTokenizer(), seq_len=4)


def test_heldout_disjoint_and_eval_batches():
    docs, tok = _corpus(50), ByteTokenizer()
    data = TextBatches(docs, tok, seq_len=32, seed=3, heldout_fraction=0.2)
    train, held = set(data.train_doc_indices.tolist()), set(data.heldout_doc_indices.tolist())
    assert not train & held and train | held == set(range(50)) and len(held) == 10
    # Documents begin with a unique "docN" tag: held-out documents never appear in train rows.
    train_text = tok.decode(data.train.inputs.ravel())
    assert all(f"doc{i} " not in train_text for i in held)
    batches = list(data.eval_batches(batch_size=4))
    assert len(batches) == -(-data.num_eval_rows // 4) and all(b["inputs"].shape == (4, 32) for b in batches)
    stacked = np.concatenate([b["inputs"] for b in batches])[: data.num_eval_rows]
    assert np.array_equal(stacked, data.heldout.inputs)
    padding = np.concatenate([b["loss_mask"] for b in batches])[data.num_eval_rows:]
    assert padding.sum() == 0
    assert [b["inputs"].tolist() for b in data.eval_batches(4)] == [b["inputs"].tolist() for b in batches]
    assert len(list(data.eval_batches(4, max_batches=1))) == 1
