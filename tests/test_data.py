"""Training data: tokenizers, packing, the Grain pipeline (determinism, shares, resume, mixtures).

Document sources (every file format and its errors) are tested in test_sources.py.
"""

import json

import numpy as np
import pytest

import grain

from zaya_jax.data import (
    ByteTokenizer,
    DataPipeline,
    DataSettings,
    HFTokenizer,
    PackedRowsIterDataset,
    load_tokenizer,
    pack_documents,
    parse_mixture,
)
from zaya_jax.data.lanes import merge_states
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


def _write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


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


# ---- streaming packing ------------------------------------------------------------------------
def _stream_rows(docs, seq_len):
    return PackedRowsIterDataset(grain.MapDataset.source([np.asarray(d, np.int32) for d in docs])
                                 .to_iter_dataset(), seq_len, eos_id=EOS, pad_id=PAD)


@pytest.mark.parametrize("seed", range(6))
def test_stream_packing_equals_pack_documents_and_resumes_anywhere(seed):
    rng = np.random.default_rng(seed)
    seq_len = int(rng.integers(1, 12))
    docs = _docs(rng.integers(0, 25, size=int(rng.integers(1, 9))).tolist())
    expected = pack_documents(docs, seq_len, eos_id=EOS, pad_id=PAD)
    iterator, states, rows = iter(_stream_rows(docs, seq_len)), [], []
    for row in iterator:
        rows.append(row)
        states.append(iterator.get_state())
    assert len(rows) == expected.num_rows
    for i, row in enumerate(rows):
        assert all(np.array_equal(row[k], getattr(expected, k)[i]) for k in row)
    for i, state in enumerate(states):  # restored after row i, it yields exactly rows i+1...
        resumed = iter(_stream_rows(docs, seq_len))
        resumed.set_state(json.loads(json.dumps(state)))
        rest = list(resumed)
        assert [r["inputs"].tolist() for r in rest] == [r["inputs"].tolist() for r in rows[i + 1:]]


# ---- the pipeline -----------------------------------------------------------------------------
def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


def _corpus(tmp_path, n=40, name="c.jsonl", tag="doc"):
    rng = np.random.default_rng(len(name))
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    texts = [f"<{tag}{i}> " + " ".join(rng.choice(words, rng.integers(3, 30))) for i in range(n)]
    return _jsonl(tmp_path / name, texts), texts


def _pipeline(source, seed=0, weights="", heldout=0.0, lanes=4, seq_len=32):
    settings = DataSettings(source=source, weights=weights, seq_len=seq_len, seed=seed,
                            heldout_fraction=heldout, read_threads=2, lanes=lanes)
    return DataPipeline(settings, ByteTokenizer())


def _documents_in(batches, tok=ByteTokenizer()):
    """Rebuild the token stream from consecutive rows (they overlap by one) and split it at eos."""
    first = batches[0]["inputs"][0, 0]
    stream = np.concatenate([[first]] + [b["targets"][i] for b in batches for i in range(len(b["targets"]))])
    text = tok.decode(np.where(stream == EOS, ord("\n") + 3, stream))
    return text.split("\n")


def test_same_seed_same_batches_other_seed_other_order(tmp_path):
    source, _ = _corpus(tmp_path)
    take = lambda p: [next(it) for it in [p.train_iterator()] for _ in range(12)]  # noqa: E731
    a, b, c = take(_pipeline(source, seed=1)), take(_pipeline(source, seed=1)), take(_pipeline(source, seed=2))
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))
    assert set(a[0]) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
    assert all(v.shape == (4, 32) for v in a[0].values())


def test_every_epoch_visits_each_document_once_in_a_new_order(tmp_path):
    source, texts = _corpus(tmp_path, n=30)
    tokens = sum(len(t) + 1 for t in texts)
    it = _pipeline(source, seq_len=16, lanes=1).train_iterator()  # one lane: the whole global order
    batches = [next(it) for _ in range(-(-3 * tokens // 16) + 16)]
    docs = _documents_in(batches)[:90]
    epochs = [docs[0:30], docs[30:60], docs[60:90]]
    for epoch in epochs:  # nothing dropped, duplicated or cut: every document whole, once
        assert sorted(epoch) == sorted(texts)
    assert epochs[0] != epochs[1] != epochs[2]


def test_lanes_deal_the_global_order_so_an_epoch_covers_the_corpus_once(tmp_path):
    source, texts = _corpus(tmp_path, n=41)
    pipe = _pipeline(source, seq_len=16, lanes=4)
    seen = []
    for lane in range(4):  # lane l reads documents l, l+4, ... of the epoch's order
        share = len(range(lane, 41, 4))
        it = pipe.train_iterator([lane])
        seen.append(set(_documents_in([next(it) for _ in range(200)])[:share]))
    assert all(not (seen[i] & seen[j]) for i in range(4) for j in range(i + 1, 4))
    assert set().union(*seen) == set(texts)


def test_a_process_reading_some_lanes_gets_exactly_those_rows_of_the_global_batch(tmp_path):
    source, _ = _corpus(tmp_path)
    full = _pipeline(source, lanes=8).train_iterator()
    part = _pipeline(source, lanes=8).train_iterator([5, 2])
    for _ in range(6):
        whole, mine = next(full), next(part)
        assert all(np.array_equal(whole[k][[5, 2]], mine[k]) for k in whole)


@pytest.mark.parametrize("readers_after", [1, 4], ids=["2 readers resume as 1", "2 readers resume as 4"])
def test_lane_states_saved_by_some_readers_resume_in_any_other_number(tmp_path, readers_after):
    """Resharding the data: what 2 processes saved continues in 1 or 4, no row repeated or skipped."""
    source, _ = _corpus(tmp_path, n=30)
    uninterrupted = _pipeline(source, lanes=8).train_iterator()
    expected = [next(uninterrupted) for _ in range(10)]
    before = [_pipeline(source, lanes=8).train_iterator(lanes) for lanes in ([0, 1, 2, 3], [4, 5, 6, 7])]
    first = [{k: np.concatenate([next(it)[k] for it in before]) for k in ("inputs",)} for _ in range(4)]
    saved = merge_states([json.loads(json.dumps(it.get_state())) for it in before])
    groups = np.array_split(np.arange(8), readers_after)
    after = [_pipeline(source, lanes=8).train_iterator(g.tolist()) for g in groups]
    for it in after:
        it.set_state(saved)
    rest = [{"inputs": np.concatenate([next(it)["inputs"] for it in after])} for _ in range(6)]
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(expected, first + rest))


def test_lane_states_refuse_a_missing_lane_and_disagreeing_copies(tmp_path):
    source, _ = _corpus(tmp_path)
    a, b = (_pipeline(source, lanes=4).train_iterator([0, 1]) for _ in range(2))
    next(a)
    with pytest.raises(ZayaError, match="different states for data lane 0"):
        merge_states([a.get_state(), b.get_state()])
    with pytest.raises(ZayaError, match="no lane 3"):
        _pipeline(source, lanes=4).train_iterator([3]).set_state(a.get_state())


@pytest.mark.parametrize("mixture", [False, True], ids=["one source", "mixture"])
def test_iterator_state_resumes_mid_epoch_exactly(tmp_path, mixture):
    a, _ = _corpus(tmp_path, name="a.jsonl", tag="a")
    b, _ = _corpus(tmp_path, name="b.jsonl", tag="b", n=25)
    source, weights = (f"{a},{b}", "3,1") if mixture else (a, "")
    it = _pipeline(source, weights=weights).train_iterator()
    for _ in range(7):  # mid-epoch: 7 x 4 rows of 32 tokens is less than the corpus
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    expected = [next(it) for _ in range(10)]
    resumed = _pipeline(source, weights=weights).train_iterator()
    resumed.set_state(state)
    got = [next(resumed) for _ in range(10)]
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(expected, got) for k in x)


def test_mixture_follows_its_weights(tmp_path):
    # Source a's documents hold only "a"s and b's only "b"s, so every row names its source.
    a = _jsonl(tmp_path / "a.jsonl", ["a" * n for n in range(5, 60)])
    b = _jsonl(tmp_path / "b.jsonl", ["b" * n for n in range(5, 60)])
    pipe = _pipeline(f"{a},{b}", weights="0.75,0.25", seq_len=8, lanes=1)
    counts = {"a": 0, "b": 0}
    it = pipe.train_iterator()
    for row in (next(it) for _ in range(800)):
        letters = set(ByteTokenizer().decode(row["inputs"][0]))
        assert len(letters) == 1
        counts[letters.pop()] += 1
    assert abs(counts["a"] / 800 - 0.75) < 0.02
    assert [m.weight for m in pipe.mixture] == [0.75, 0.25]


def test_heldout_documents_never_train_and_eval_batches_are_fixed(tmp_path):
    source, texts = _corpus(tmp_path, n=50)
    pipe = _pipeline(source, seed=3, heldout=0.2)
    train_idx, held_idx = pipe.splits[0]
    assert len(held_idx) == 10 and not set(train_idx) & set(held_idx)
    it = pipe.train_iterator([0])
    trained = set(_documents_in([next(it) for _ in range(240)]))
    assert not trained & {texts[i] for i in held_idx}
    batches = list(pipe.eval_batches(batch_size=4))
    assert all(b["inputs"].shape == (4, 32) for b in batches)
    assert {d for d in _documents_in(batches) if d.startswith("<")} == {texts[i] for i in held_idx}
    assert batches[-1]["loss_mask"][-1].sum() == 0  # the tail is padding, never scored
    assert [b["inputs"].tolist() for b in pipe.eval_batches(4)] == [b["inputs"].tolist() for b in batches]
    assert len(list(pipe.eval_batches(4, max_batches=1))) == 1
    rows = list(pipe.eval_batches(4, rows=[3, 1]))  # a process's share: the same batches, its rows
    assert len(rows) == len(batches) and all(np.array_equal(r["inputs"], b["inputs"][[3, 1]])
                                             for r, b in zip(rows, batches))


@pytest.mark.parametrize("source,weights,needle", [
    ("a.jsonl,", "", "empty entry"),
    ("a.jsonl,a.jsonl", "1,1", "twice"),
    ("a.jsonl,b.jsonl", "", "data.weights is empty"),
    ("a.jsonl,b.jsonl", "1", "one weight per source"),
    ("a.jsonl,b.jsonl", "1,x", "not a comma-separated list"),
    ("a.jsonl,b.jsonl", "1,0", "positive"),
])
def test_bad_mixtures(source, weights, needle):
    with pytest.raises(ZayaError, match=needle):
        parse_mixture(source, weights)


def test_more_lanes_than_documents_still_fill_every_row(tmp_path):
    source = _jsonl(tmp_path / "two.jsonl", ["one doc", "two doc"])
    batch = next(_pipeline(source, lanes=8, seq_len=8).train_iterator())
    assert batch["inputs"].shape == (8, 8) and batch["loss_mask"].sum(axis=1).min() > 0
