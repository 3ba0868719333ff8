"""`zaya eval`: lm-eval-harness tasks on a zaya-jax model, the lm-eval table printed at the end.

The short form of `lm_eval --model zaya --model_args model=DIR ...`: checks the tasks (names lm-eval
knows, or task YAML files) before loading the model, runs them through the `zaya` model
(`harness/lm_eval_model.py`: compiled, batched, data-parallel over this process's devices),
prints lm-eval's results table, and with `--output` writes lm-eval's results (and, with
`--log-samples`, every example's inputs and answers) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

from zaya_jax.errors import ZayaError

EPILOG = """\
examples:
  zaya eval --model /tmp/zaya_tiny/model --tasks my_tasks/copy.yaml
  zaya eval --model /ckpt/hf_zaya --tasks hellaswag,arc_easy --batch-size 32 --output scores.json
  zaya eval --model /ckpt/run/model --tasks my_group --include-path my_tasks/ --limit 100

Tasks are downloaded by lm-eval (Hugging Face datasets) on first use; a task YAML with
dataset_path: json and local data_files needs no network. Needs the eval extra: pip install 'zaya-jax[eval]'."""


def add_parser(jobs) -> None:
    p = jobs.add_parser("eval", help="score a model on lm-eval-harness tasks", epilog=EPILOG,
                        description="Run lm-eval-harness tasks on a zaya-jax model or a Hugging Face ZAYA directory.",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="WORKDIR/model of a run, a zaya-jax checkpoint or an HF directory")
    p.add_argument("--tasks", required=True, action="append", metavar="TASKS",
                   help="comma-separated lm-eval task names or task YAML files (repeatable)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR", help="a folder of extra task YAMLs (repeatable)")
    p.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--limit", type=float, metavar="N", help="at most N examples per task (a fraction below 1: that share)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="rows per compiled forward (default 8)")
    p.add_argument("--max-length", type=int, metavar="N", help="context length in tokens (default: the model's)")
    p.add_argument("--tokenizer", metavar="SPEC", help="'bytes' or a tokenizer.json (default: the model directory's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (default float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of lm-eval's few-shot sampling and of sampled generation")
    p.add_argument("--output", metavar="FILE.json", help="write lm-eval's results here")
    p.add_argument("--log-samples", action="store_true", help="with --output: every example's inputs and answers too")


def eval_command(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ZayaError(f"unrecognized arguments: {' '.join(extra)}")
    _check(args)
    try:
        import lm_eval
    except ImportError:
        raise ZayaError("zaya eval needs lm-eval-harness: pip install 'zaya-jax[eval]'") from None
    from zaya_jax.harness.tasks import resolve_tasks

    manager, tasks = resolve_tasks(args.tasks, args.include_path)
    from zaya_jax.harness.lm_eval_model import ZayaLM

    model = ZayaLM(model=args.model, tokenizer=args.tokenizer, batch_size=args.batch_size, max_length=args.max_length,
                   dtype=args.dtype, seed=args.seed)
    results = lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager, num_fewshot=args.num_fewshot,
                                      limit=args.limit, log_samples=args.log_samples, random_seed=args.seed,
                                      numpy_random_seed=args.seed, torch_random_seed=args.seed,
                                      fewshot_random_seed=args.seed)
    print(lm_eval.utils.make_table(results))
    if "groups" in results:
        print(lm_eval.utils.make_table(results, "groups"))
    if args.output:
        _write(args.output, results)
    return 0


def _check(args) -> None:
    for name in ("batch_size", "max_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ZayaError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ZayaError(f"--num-fewshot must be 0 or more, got {args.num_fewshot}")
    if args.limit is not None and not args.limit > 0:
        raise ZayaError(f"--limit must be a positive number (examples, or a share below 1), got {args.limit}")
    if args.log_samples and not args.output:
        raise ZayaError("--log-samples writes into --output FILE.json; pass --output too")
    if not os.path.isdir(args.model):
        raise ZayaError(f"--model {args.model} does not exist or is not a directory")
    if args.output and os.path.isdir(args.output):
        raise ZayaError(f"--output {args.output} is a directory; name a file")
    if args.output:
        from zaya_jax.explore.report import check_writable

        check_writable(args.output)  # before the evaluation, not after it


def _write(path: str, results: dict) -> None:
    from lm_eval.utils import handle_non_serializable

    from zaya_jax.explore.report import write_atomic

    write_atomic(path, lambda f: json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False))
