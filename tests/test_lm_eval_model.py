"""The lm-eval-harness model `zaya` (`zaya_jax/harness/`) against lm-eval's own `hf` model on the
checkpoint `zaya convert to-hf` exports: the same local tasks (multiple choice, rolling perplexity,
generation until a stop string), the same per-example log-likelihoods to 1e-4, the same greedy
texts, the same scores. `max_length` is cut to 32 tokens on both sides, so contexts are truncated
on the left and long documents span several rolling windows."""

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("torch")

from zaya_jax.checkpoint import convert  # noqa: E402
from zaya_jax.config import preset  # noqa: E402
from zaya_jax.errors import ZayaError  # noqa: E402

MAX_LENGTH = 32
CORPUS = ["The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine.",
          "Paris is the capital of France.", "Two plus two is four.", "The sun rises in the east."]
QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " the lazy dog", " nine"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " east"], "answer": 0},
    {"question": " ".join(CORPUS[:4]) + " The sun rises in the", "choices": [" east", " fox jumps"], "answer": 0},
    {"question": "", "choices": ["A stitch in time", "Paris"], "answer": 0},
]
TEXTS = [{"text": t} for t in (" ".join(CORPUS), CORPUS[1], " ".join(CORPUS[::-1] * 2))]
TASKS = {
    "zaya_mc": dict(output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice="{{choices}}",
                    doc_to_target="{{answer}}", metric_list=[{"metric": "acc"}]),
    "zaya_ppl": dict(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                     metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]),
    "zaya_gen": dict(output_type="generate_until", doc_to_text="{{question}}", doc_to_target="{{choices[answer]}}",
                     generation_kwargs={"until": ["."], "max_gen_toks": 8, "do_sample": False},
                     metric_list=[{"metric": "exact_match"}]),
}


def _tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


def _tasks(folder):
    rows = {"zaya_mc": QUESTIONS, "zaya_ppl": TEXTS, "zaya_gen": QUESTIONS[:3]}
    for name, spec in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
        task = dict(task=name, dataset_path="json", dataset_kwargs={"data_files": {"test": str(data)}},
                    test_split="test", **spec)
        (folder / f"{name}.yaml").write_text(json.dumps(task))  # JSON is YAML


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(our checkpoint with its tokenizer, the HF export of it, the task folder)."""
    import torch
    from hf_reference import hf_model

    root = tmp_path_factory.mktemp("lm_eval")
    hf_dir, tasks = root / "hf", root / "tasks"
    hf_dir.mkdir(), tasks.mkdir()
    vocab = _tokenizer(hf_dir)
    cfg = preset("tiny", vocab_size=vocab)
    hf = hf_model(cfg, 0)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(0.25)  # logits of a trained model's size: nats per token, not tens
        for name, buffer in hf.named_buffers():  # HF's loader resets the skip class's bias to its released -1
            if name.endswith("balancing_biases"):
                buffer[-1] = -1.0
    hf.save_pretrained(str(hf_dir))
    convert.from_hf(str(hf_dir), str(root / "ckpt"), progress=False)
    convert.to_hf(str(root / "ckpt"), str(root / "export"), progress=False)
    _tasks(tasks)
    return root / "ckpt", root / "export", tasks


def _evaluate(model, model_args, tasks):
    from lm_eval.tasks import TaskManager

    import zaya_jax.harness.lm_eval_model  # noqa: F401  (registers "zaya")

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=sorted(TASKS), batch_size=4,
                                   task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                   bootstrap_iters=0, random_seed=0)


@pytest.fixture(scope="module")
def results(models):
    ckpt, export, tasks = models
    ours = _evaluate("zaya", f"model={ckpt},max_length={MAX_LENGTH}", tasks)
    theirs = _evaluate("hf", dict(pretrained=str(export), max_length=MAX_LENGTH, device="cpu", dtype="float32"), tasks)
    return ours, theirs


def _by_doc(result, task):
    return {s["doc_id"]: s for s in result["samples"][task]}


def test_multiple_choice_loglikelihoods_equal_lm_evals_hf_model(results):
    ours, theirs = results
    mine, ref = _by_doc(ours, "zaya_mc"), _by_doc(theirs, "zaya_mc")
    assert sorted(mine) == list(range(len(QUESTIONS)))
    for doc in mine:
        got = [r[0] for r in mine[doc]["resps"]]
        want = [r[0] for r in ref[doc]["resps"]]
        np.testing.assert_allclose([float(g[0]) for g in got], [float(w[0]) for w in want], atol=1e-4, rtol=0)
        assert [bool(g[1]) for g in got] == [bool(w[1]) for w in want]
    assert ours["results"]["zaya_mc"]["acc,none"] == theirs["results"]["zaya_mc"]["acc,none"]


def test_rolling_loglikelihoods_and_perplexities_equal_lm_evals_hf_model(results, models):
    from zaya_jax.data.tokenizer import load_tokenizer

    ours, theirs = results
    mine, ref = _by_doc(ours, "zaya_ppl"), _by_doc(theirs, "zaya_ppl")
    for doc in mine:
        np.testing.assert_allclose(float(mine[doc]["resps"][0][0]), float(ref[doc]["resps"][0][0]), atol=1e-4, rtol=0)
    words = load_tokenizer(str(models[0] / "tokenizer.json"))
    assert max(len(words.encode(t["text"])) for t in TEXTS) > 2 * MAX_LENGTH  # several windows
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["zaya_ppl"][metric] == pytest.approx(theirs["results"]["zaya_ppl"][metric], rel=1e-5)


def test_generated_texts_equal_lm_evals_hf_model(results):
    ours, theirs = results
    mine, ref = _by_doc(ours, "zaya_gen"), _by_doc(theirs, "zaya_gen")
    texts = [mine[d]["resps"][0][0] for d in sorted(mine)]
    assert texts == [ref[d]["resps"][0][0] for d in sorted(ref)]
    assert any(texts) and all("." not in t for t in texts)  # cut at the stop string


def test_bad_model_arguments_are_one_line_errors(models):
    from zaya_jax.harness.lm_eval_model import ZayaLM

    ckpt = str(models[0])
    cases = [({}, "needs model=DIR"), ({"model": ckpt, "colour": "red"}, "unknown model argument(s) for zaya: colour"),
             ({"model": ckpt, "batch_size": "0"}, "batch_size must be a positive integer"),
             ({"model": ckpt, "max_length": "nan"}, "max_length must be a positive integer"),
             ({"model": ckpt, "tokenizer": "bytes"}, None)]
    for kwargs, message in cases:
        if message is None:
            ZayaLM(**kwargs)  # a smaller tokenizer than the vocabulary is fine
            continue
        with pytest.raises(ZayaError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ZayaLM(**kwargs)


def test_zaya_eval_prints_lm_evals_table_and_writes_its_results(models, results, tmp_path, capsys):
    from zaya_jax.cli import main

    ckpt, _, tasks = models
    out = tmp_path / "scores.json"
    code = main(["eval", f"--model={ckpt}", f"--tasks={tasks}/zaya_mc.yaml", f"--tasks={tasks}/zaya_gen.yaml",
                 f"--max-length={MAX_LENGTH}", f"--output={out}", "--log-samples"])
    table = capsys.readouterr().out
    assert code == 0
    assert "|zaya_mc" in table and "|acc" in table and "|zaya_gen" in table and "|exact_match" in table
    written = json.loads(out.read_text())
    assert written["results"]["zaya_mc"]["acc,none"] == results[0]["results"]["zaya_mc"]["acc,none"]
    assert len(written["samples"]["zaya_mc"]) == len(QUESTIONS)


def test_zaya_eval_refuses_bad_input_in_one_line_before_loading(models, tmp_path):
    from zaya_process import zaya

    ckpt, _, tasks = models
    cases = [([f"--model={tmp_path}/none", f"--tasks={tasks}/zaya_mc.yaml"], "does not exist or is not a directory"),
             ([f"--model={ckpt}", "--tasks=no_such_task_anywhere"], "unknown lm-eval task(s): no_such_task_anywhere"),
             ([f"--model={ckpt}", f"--tasks={tmp_path}/missing.yaml"], "missing.yaml does not exist"),
             ([f"--model={ckpt}", f"--tasks={tasks}/zaya_mc.yaml", "--log-samples"], "pass --output too"),
             ([f"--model={ckpt}", f"--tasks={tasks}/zaya_mc.yaml", "--batch-size=0"], "--batch-size must be at least 1"),
             ([f"--model={ckpt}", f"--tasks={tasks}/zaya_mc.yaml", f"--output={tmp_path}/no/such/s.json"],
              "does not exist")]
    for args, message in cases:
        proc = zaya("eval", *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (args, proc.stderr)


def test_generation_arguments_the_model_cannot_honour_are_one_line_errors(models):
    from zaya_jax.harness.lm_eval_model import ZayaLM

    lm = ZayaLM(model=str(models[0]), max_length=str(MAX_LENGTH))
    with pytest.raises(ZayaError, match=r"does not take generation argument\(s\) \['num_beams'\]"):
        lm._generate_group(["x"], {"until": ["."], "num_beams": 2})
    with pytest.raises(ZayaError, match="generating 40 new tokens needs a max_length above 40 \\(it is 32\\)"):
        lm._generate_group(["x"], {"until": ["."], "max_gen_toks": 40})
