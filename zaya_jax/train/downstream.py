"""Downstream evaluation inside training: lm-eval tasks and fixed prompts, from the live state.

At every evaluation step (`eval.every_steps` and the end), after the held-out loss:
  * `eval.tasks` (lm-eval task names or task YAMLs, checked before the run writes anything) run
    through lm-eval's `zaya` model (`harness/lm_eval_model.py`) built on this program: scoring is
    the program's own compiled score step over its mesh (`Program.jitted_score_step`, every batch
    [eval batch size, seq_len]), generation `zaya_jax.generate` on the same arrays. No export and
    no second copy of the weights. `eval.task_limit` caps the examples per task. Each metric goes to
    metrics.jsonl and TensorBoard as `task/<task>/<metric>`.
  * `eval.prompts` continue greedily for `eval.prompt_tokens` tokens; each sample goes to
    WORKDIR/samples.jsonl and to TensorBoard's text tab.
A task that fails is one line in the log (and an `eval_failed` event); the run goes on.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import jax
import numpy as np

from zaya_jax.errors import ZayaError, quoted
from zaya_jax.train.step import BATCH_KEYS

SAMPLES_NAME = "samples.jsonl"


def check_tasks(config) -> tuple | None:
    """(lm-eval's TaskManager, the resolved tasks) of `eval.tasks`, or None: a bad name is a
    `ZayaError` before the run writes anything."""
    names = [t for t in config.eval.tasks.split(",") if t.strip()]
    if not names:
        return None
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ZayaError("eval.tasks needs lm-eval-harness: pip install 'zaya-jax[eval]' (or set eval.tasks='')") from None
    from zaya_jax.harness.tasks import resolve_tasks

    return resolve_tasks(names)


class Downstream:
    """The configured tasks and prompts of a run, evaluated on demand from a train state."""

    def __init__(self, program, tasks, tokenizer, workdir: str, primary: bool):
        self.program, self.tasks, self.words, self.primary = program, tasks, tokenizer, primary
        self.c = program.exp.config
        self.samples_path = os.path.join(workdir, SAMPLES_NAME)
        self._score_step = None

    @property
    def active(self) -> bool:
        return bool(self.tasks) or bool(self.c.eval.prompts)

    def run(self, state, step: int, writer, note, events) -> None:
        if self.tasks:
            scores = {}
            model = self._model(state)
            for task in self.tasks[1]:
                name = task["task"] if isinstance(task, dict) else task
                try:
                    scores.update(self._scores(model, task))
                except Exception as e:  # a task's data or metric: lm-eval raises whatever it meets
                    error = quoted(e, first_line=True)
                    note(f"step {step}: eval task {name} failed, training goes on: {error}")
                    events.write("eval_task_failed", step=step, task=name, error=error)
            if scores:
                writer.write(step, scores)
                note(f"step {step}: " + ", ".join(f"{k.removeprefix('task/')} {v:.4f}" for k, v in scores.items()))
        if self.c.eval.prompts:
            self._samples(state, step, writer)

    # ---- tasks --------------------------------------------------------------------------------
    def _model(self, state):
        from zaya_jax.harness.lm_eval_model import ZayaLM

        return ZayaLM.from_parts(self.words, self._scorer(state), self._generator(state),
                                 vocab_size=self.program.modeldef.cfg.vocab_size,
                                 max_gen_toks=min(256, self.c.train.seq_len - 1), seed=self.c.train.seed)

    def _scores(self, model, task) -> dict[str, float]:
        """One task (or group) at a time, so one that fails costs only its own scores."""
        from lm_eval.evaluator import evaluate
        from lm_eval.tasks import get_task_dict

        # lm-eval's progress bars would tear the trainer's; its warnings still reach the log.
        with contextlib.redirect_stderr(io.StringIO()):
            results = evaluate(model, get_task_dict([task], self.tasks[0]), limit=self.c.eval.task_limit or None,
                               log_samples=False, bootstrap_iters=0, verbosity="ERROR")
        return task_metrics(results["results"])

    def _scorer(self, state):
        from zaya_jax.harness.scoring import Scorer

        program, size = self.program, self._size()
        if self._score_step is None:
            self._score_step = program.jitted_score_step()
        rows = program.local_rows(size)

        def row_scores(ids, targets, weights):
            valid = (np.arange(ids.shape[1]) < _lengths(weights)[:, None]).astype(np.int32)
            batch = {"inputs": ids, "targets": targets, "segment_ids": valid,
                     "positions": np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy(),
                     "loss_mask": weights}
            placed = program.place_eval_batch({k: batch[k][rows] for k in BATCH_KEYS}, size)
            return jax.device_get(self._score_step(state.params, state.biases, placed))

        return Scorer(row_scores, batch_size=size, max_length=self.c.train.seq_len, fixed_width=True)

    def _generator(self, state):
        from zaya_jax.generation import generate

        model = self.program.modeldef.merge(state.params, state.biases)
        return lambda prompts, **kwargs: generate(model, prompts, **kwargs)

    def _size(self) -> int:
        from zaya_jax.train.evaluation import eval_batch_size

        return eval_batch_size(self.program)

    # ---- prompts ------------------------------------------------------------------------------
    def _samples(self, state, step: int, writer) -> None:
        prompts = list(self.c.eval.prompts)
        keep = self.c.train.seq_len - self.c.eval.prompt_tokens
        ids = [(self.words.encode(p) or [self.words.eos_id])[-keep:] for p in prompts]
        out = self._generator(state)(ids, max_new_tokens=self.c.eval.prompt_tokens, stop=(self.words.eos_id,))
        if not self.primary:
            return
        lines = [{"step": step, "prompt": p, "completion": self.words.decode(t)} for p, t in zip(prompts, out)]
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
        for n, line in enumerate(lines):
            writer.write_text(step, f"samples/{n}", f"**{line['prompt']}**{line['completion']}")


def task_metrics(results: dict) -> dict[str, float]:
    """lm-eval's results → `task/<task>/<metric>` scalars (its `,none` filter suffix dropped; stderr
    and non-numbers left out)."""
    out = {}
    for task, metrics in sorted(results.items()):
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = metric if filt == "none" else f"{metric}/{filt}"
            if np.isfinite(value):
                out[f"task/{task}/{name}"] = float(value)
    return out


def _lengths(weights: np.ndarray) -> np.ndarray:
    """Each row's real length: up to its last scored position (a row's continuation ends it)."""
    scored = weights > 0
    return np.where(scored.any(axis=1), scored.shape[1] - np.argmax(scored[:, ::-1], axis=1), 0)
