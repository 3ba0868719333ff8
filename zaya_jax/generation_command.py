"""`zaya generate`: text in, text out, from a zaya-jax model or a Hugging Face directory.

Checks every flag before loading anything; finds the tokenizer (`--tokenizer`, else the one the
model directory holds: a training run leaves `tokenizer.txt` or `tokenizer.json` beside its model,
and Hugging Face directories hold `tokenizer.json`); streams one prompt's tokens to the terminal as
they come (several prompts print whole when done); ends with the tokens/s on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from zaya_jax.errors import ZayaError

EPILOG = """\
examples:
  zaya generate --model /tmp/zaya_tiny/model --prompt "def fib(n):" --max-new-tokens 80
  zaya generate --model /ckpt/hf_zaya --prompts prompts.jsonl --temperature 0.8 --top-p 0.95 --seed 1

--prompts FILE.jsonl: one prompt per line, a JSON string or an object with a "prompt" field.
Greedy by default (--temperature 0); a row stops at the tokenizer's end-of-text token unless --no-stop."""


def add_parser(jobs) -> None:
    p = jobs.add_parser("generate", help="continue text prompts with a trained model (cached decoding)",
                        description="Continue text prompts with a zaya-jax model or a Hugging Face ZAYA directory.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="WORKDIR/model of a run, a zaya-jax checkpoint or an HF directory")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE.jsonl", help="prompts, one per line")
    p.add_argument("--tokenizer", metavar="SPEC", help="'bytes' or a tokenizer.json (default: the model directory's)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, metavar="P", help="sample among the most likely tokens of total probability P")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (default float32)")


def generate_command(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ZayaError(f"unrecognized arguments: {' '.join(extra)}")
    _check_numbers(args)
    texts = _prompts(args)
    if not os.path.isdir(args.model):
        raise ZayaError(f"--model {args.model} does not exist or is not a directory")
    tokenizer = _tokenizer(args)
    prompts = [tokenizer.encode(t) for t in texts]
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise ZayaError(f"prompt {empty[0] + 1} is empty (it encodes to no tokens); give it some text")

    from zaya_jax.api import load
    from zaya_jax.data.tokenizer import check_fits
    from zaya_jax.generation import generate

    model = load(args.model, compute_dtype=args.dtype)
    check_fits(tokenizer, model.cfg.vocab_size, "pass the tokenizer the model was trained with (--tokenizer)")
    stream = _Stream(tokenizer, prompts[0]) if len(prompts) == 1 else None
    start = time.perf_counter()
    out = generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=() if args.no_stop else (tokenizer.eos_id,),
                   on_tokens=stream.on_tokens if stream else None)
    seconds = time.perf_counter() - start
    if stream:
        stream.finish()
    else:
        for text, tokens in zip(texts, out):
            print(json.dumps({"prompt": text, "completion": tokenizer.decode(tokens)}, ensure_ascii=False))
    count = sum(len(t) for t in out)
    print(f"zaya generate: {count} tokens for {len(prompts)} prompt(s) in {seconds:.1f}s "
          f"({count / seconds:.1f} tokens/s, compiling included)", file=sys.stderr)
    return 0


class _Stream:
    """Prints one row's text as its tokens come (a multi-byte character once it is whole)."""

    def __init__(self, tokenizer, prompt: list[int]):
        self.tokenizer, self.tokens, self.shown = tokenizer, [], ""
        print(tokenizer.decode(prompt), end="", flush=True)

    def on_tokens(self, tokens, active) -> None:
        if active[0]:
            self.tokens.append(int(tokens[0]))
            text = self.tokenizer.decode(self.tokens)
            if not text.endswith("\ufffd"):
                print(text[len(self.shown):], end="", flush=True)
                self.shown = text

    def finish(self) -> None:
        print(self.tokenizer.decode(self.tokens)[len(self.shown):], flush=True)


def _check_numbers(args) -> None:
    from zaya_jax.generation import check_sampling

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, flags=True)


def _prompts(args) -> list[str]:
    texts = list(args.prompt)
    if args.prompts:
        texts += _read_prompts(args.prompts)
    if not texts:
        raise ZayaError("no prompt: pass --prompt TEXT or --prompts FILE.jsonl")
    return texts


def _read_prompts(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ZayaError(f"cannot read --prompts {path}: {getattr(e, 'strerror', None) or e}") from None
    texts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise ZayaError(f"--prompts {path} line {n} is not JSON; write a JSON string or {{\"prompt\": ...}}") from None
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise ZayaError(f"--prompts {path} line {n} holds no prompt text; write a JSON string or {{\"prompt\": ...}}")
        texts.append(text)
    return texts


def _tokenizer(args):
    from zaya_jax.data.tokenizer import model_tokenizer

    return model_tokenizer(args.model, args.tokenizer)
