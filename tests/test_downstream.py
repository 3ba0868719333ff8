"""Downstream evaluation inside training (`train/downstream.py`): lm-eval tasks scored from the
live train state through the program's own score step, equal to `zaya eval`'s path on the run's
exported model (itself equal to lm-eval's `hf` model, tests/test_lm_eval_model.py); samples of
fixed prompts in samples.jsonl and TensorBoard; a failing task is one line and the run goes on;
an unknown task is refused before the workdir exists."""

import json
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from paths import ROOT, TINY  # noqa: E402
from run_outputs import tensorboard_events  # noqa: E402
from zaya_process import zaya  # noqa: E402

TASKS = os.path.join(ROOT, "experiments", "eval_tasks")
SEQ_LEN = 32  # shorter than the cloze contexts and the paragraphs: truncation and several windows
PROMPTS = ["def fib(n):", "The for statement"]
RUN = ["--config.train.steps=4", "--config.optim.warmup_steps=1", "--config.train.global_batch_size=8",
       f"--config.train.seq_len={SEQ_LEN}", "--config.model.num_hidden_layers=2", "--config.train.scan_unroll=1",
       "--config.eval.batches=1", "--config.eval.every_steps=2", "--config.eval.prompt_tokens=12",
       f"--config.eval.prompts={PROMPTS!r}"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("downstream")
    broken = root / "broken.yaml"  # its data file exists when the run starts, but is not JSON
    (root / "broken.jsonl").write_text("{not json\n")
    broken.write_text(json.dumps(dict(task="broken", dataset_path="json", test_split="test",
                                      dataset_kwargs={"data_files": {"test": "broken.jsonl"}},
                                      output_type="multiple_choice", doc_to_text="{{q}}", doc_to_choice="{{c}}",
                                      doc_to_target="{{a}}", metric_list=[{"metric": "acc"}])))
    tasks = f"{TASKS}/python_cloze.yaml,{TASKS}/python_paragraphs.yaml,{broken}"
    workdir = root / "run"
    result = zaya("train", f"--config={TINY}", f"--workdir={workdir}", *RUN, f"--config.eval.tasks={tasks}")
    assert result.returncode == 0, result.stderr
    return workdir, result


def _scores(workdir):
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("task/")}
            for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "task/python_cloze/acc" in r}


def test_task_scores_at_every_evaluation_equal_zaya_evals_on_the_exported_model(run):
    import zaya_jax.harness.lm_eval_model  # noqa: F401  (registers "zaya")
    from zaya_jax.harness.tasks import resolve_tasks

    workdir, _ = run
    scores = _scores(workdir)
    assert sorted(scores) == [2, 4]
    assert set(scores[4]) == {"task/python_cloze/acc", "task/python_cloze/acc_norm",
                              "task/python_paragraphs/word_perplexity", "task/python_paragraphs/bits_per_byte"}
    assert scores[2] != scores[4]  # the live state, not one copy of it
    tags = {(event.step, value.tag) for event in tensorboard_events(workdir / "tensorboard") for value in event.summary.value}
    assert {(2, "task/python_cloze/acc"), (4, "task/python_paragraphs/bits_per_byte")} <= tags
    manager, tasks = resolve_tasks([f"{TASKS}/python_cloze.yaml", f"{TASKS}/python_paragraphs.yaml"])
    ref = lm_eval.simple_evaluate(model="zaya", model_args=f"model={workdir / 'model'},max_length={SEQ_LEN}",
                                  tasks=tasks, task_manager=manager, bootstrap_iters=0)["results"]
    assert scores[4]["task/python_cloze/acc"] == ref["python_cloze"]["acc,none"]
    assert scores[4]["task/python_cloze/acc_norm"] == ref["python_cloze"]["acc_norm,none"]
    for metric in ("word_perplexity", "bits_per_byte"):
        assert scores[4][f"task/python_paragraphs/{metric}"] == pytest.approx(ref["python_paragraphs"][f"{metric},none"],
                                                                              rel=1e-5)


def test_a_failing_task_is_one_line_per_evaluation_and_the_run_goes_on(run):
    workdir, result = run
    failed = [line for line in result.stderr.splitlines() if "eval task broken failed, training goes on" in line]
    assert len(failed) == 2 and "step 2:" in failed[0] and "step 4:" in failed[1]
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "eval_task_failed"] == [2, 4]
    assert "Traceback" not in result.stderr


def test_prompt_samples_go_to_samples_jsonl_and_tensorboards_text_tab(run):
    workdir, _ = run
    samples = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [(2, PROMPTS[0]), (2, PROMPTS[1]), (4, PROMPTS[0]), (4, PROMPTS[1])]
    assert all(isinstance(s["completion"], str) for s in samples)
    texts = [(event.step, value.tag) for event in tensorboard_events(workdir / "tensorboard")
             for value in event.summary.value if value.tag.startswith("samples/")]
    assert sorted(texts) == [(2, "samples/0/text_summary"), (2, "samples/1/text_summary"),
                             (4, "samples/0/text_summary"), (4, "samples/1/text_summary")]


def test_an_unknown_task_is_refused_before_the_workdir_exists(tmp_path):
    result = zaya("train", f"--config={TINY}", f"--workdir={tmp_path / 'w'}", "--config.eval.tasks=no_such_task_anywhere")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "unknown lm-eval task(s): no_such_task_anywhere" in lines[0]
    assert not (tmp_path / "w").exists()
