"""The lm-eval-harness model `zaya`: a zaya-jax model scored and sampled in lm-eval's conventions.

Importing this module registers `zaya` in lm-eval's model registry, so
`lm_eval.simple_evaluate(model="zaya", model_args="model=DIR")` and `zaya eval` find it. It follows
lm-eval's `hf` model wherever the two could differ: the continuation is scored after the context's
tokens with trailing spaces moved to the continuation (lm-eval's `TemplateLM`), rows longer than
`max_length` lose tokens on the left, an empty context is the prefix token (the tokenizer's
end-of-text, which is what precedes a document in our training data), rolling log-likelihoods use
lm-eval's disjoint windows, and `generate_until` stops at the task's stop strings or end-of-text
and cuts the text at the first stop string.

Needs the `eval` extra (`pip install 'zaya-jax[eval]'`).
"""

from __future__ import annotations

import json
import math
from typing import Callable

from zaya_jax.errors import ZayaError

try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ZayaError("evaluation needs lm-eval-harness: pip install 'zaya-jax[eval]'") from e

from tqdm import tqdm

from zaya_jax.harness.scoring import Scorer, model_scorer

SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p", "until", "max_gen_toks", "seed"}
Generator = Callable[..., list[list[int]]]  # zaya_jax.generate with the model bound


@register_model("zaya")
class ZayaLM(TemplateLM):
    """`model=DIR` (a zaya-jax checkpoint, a run's WORKDIR/model or an HF directory; `pretrained`
    is accepted as its alias), `tokenizer` (default: the model directory's), `batch_size` (rows per
    compiled forward, split over the local devices), `max_length` (default: the model's
    `max_position_embeddings`), `max_gen_toks` (256), `dtype` (float32), `prefix_token_id`, `seed`
    (of sampled generation, where a task samples and names no seed). `batch_size=auto` is 8."""

    def __init__(self, model: str | None = None, pretrained: str | None = None, tokenizer: str | None = None,
                 batch_size: int | str = 8, max_length: int | None = None, max_gen_toks: int = 256,
                 dtype: str = "float32", prefix_token_id: int | None = None, device: str | None = None,
                 max_batch_size: int | None = None, seed: int = 0, **unknown):
        super().__init__()
        del device, max_batch_size  # lm-eval's own flags: JAX places work on its local devices
        if unknown:
            raise ZayaError(f"unknown model argument(s) for zaya: {', '.join(sorted(unknown))}; the zaya model takes "
                            "model, tokenizer, batch_size, max_length, max_gen_toks, dtype, prefix_token_id, seed")
        path = model or pretrained
        if not path:
            raise ZayaError("the zaya model needs model=DIR (a zaya-jax checkpoint, a run's WORKDIR/model or an HF directory)")
        from zaya_jax.api import load
        from zaya_jax.data.tokenizer import model_tokenizer

        words = model_tokenizer(str(path), tokenizer)
        loaded = load(str(path), compute_dtype=dtype)
        self.setup(words, model_scorer(loaded, batch_size=_batch_size(batch_size), max_length=_count("max_length", max_length)),
                   _bound_generate(loaded), max_gen_toks=max_gen_toks, prefix_token_id=prefix_token_id,
                   vocab_size=loaded.cfg.vocab_size, seed=seed)

    @classmethod
    def from_parts(cls, tokenizer, scorer: Scorer, generator: Generator, *, vocab_size: int,
                   max_gen_toks: int = 256, prefix_token_id: int | None = None, seed: int = 0) -> "ZayaLM":
        """A `zaya` model on a scorer and a generator already built (the trainer's live state)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm.setup(tokenizer, scorer, generator, max_gen_toks=max_gen_toks, prefix_token_id=prefix_token_id,
                 vocab_size=vocab_size, seed=seed)
        return lm

    def setup(self, tokenizer, scorer: Scorer, generator: Generator, *, max_gen_toks, prefix_token_id, vocab_size, seed):
        from zaya_jax.data.tokenizer import check_fits

        check_fits(tokenizer, vocab_size, "pass the tokenizer the model was trained with (tokenizer=...)")
        self.words, self.scorer, self.generator = tokenizer, scorer, generator
        self.max_gen_toks = _count("max_gen_toks", max_gen_toks)
        self._prefix = None if prefix_token_id is None else int(prefix_token_id)
        self.seed = int(seed)

    # ---- lm-eval's interface ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.words.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.eot_token_id if self._prefix is None else self._prefix

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        del add_special_tokens, kwargs  # our tokenizers add no specials: training never saw any
        return self.words.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.words.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        with tqdm(total=len(requests), disable=disable_tqdm, desc="zaya: loglikelihood") as bar:
            answers = self.scorer.score([(context, continuation) for _, context, continuation in requests],
                                        on_batch=bar.update)
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for n, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        with tqdm(total=len(windows), disable=disable_tqdm, desc="zaya: loglikelihood_rolling") as bar:
            for n, (logprob, _) in zip(owner, self.scorer.score(windows, on_batch=bar.update)):
                totals[n] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for n, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(n)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="zaya: generate_until") as bar:
            for members in groups.values():
                texts = self._generate_group([requests[n].args[0] for n in members], requests[members[0]].args[1])
                for n, text in zip(members, texts):
                    out[n] = text
                    self.cache_hook.add_partial("generate_until", requests[n].args, text)
                bar.update(len(members))
        return out

    # ---- generation ---------------------------------------------------------------------------
    def _generate_group(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        unknown = set(gen_kwargs) - SAMPLING_KEYS - {"max_new_tokens", "max_tokens", "max_completion_tokens"}
        if unknown:
            raise ZayaError(f"the zaya model does not take generation argument(s) {sorted(unknown)}; "
                            f"it takes {sorted(SAMPLING_KEYS)}")
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = [u for u in handle_stop_sequences(kwargs.get("until"), eos=None) if u]
        steps = int(kwargs["max_gen_toks"])
        if steps >= self.max_length:
            raise ZayaError(f"generating {steps} new tokens needs a max_length above {steps} (it is {self.max_length}); "
                            "raise max_length or lower max_gen_toks")
        sampling = _sampling(kwargs, self.seed)
        keep = self.max_length - steps
        prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-keep:] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda n: -len(prompts[n]))
        texts = [""] * len(prompts)
        batch = self.scorer.batch_size
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            done = self.generator([prompts[n] for n in chunk], max_new_tokens=steps, stop=(self.eot_token_id,),
                                  stop_when=lambda row, tokens: any(u in self.tok_decode(tokens) for u in until),
                                  **sampling)
            for n, tokens in zip(chunk, done):
                texts[n] = postprocess_generated_text(self.tok_decode(tokens), until, None)
        return texts


def _sampling(kwargs: dict, seed: int) -> dict:
    temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
    if temperature == 0:
        return {}
    picked = {"temperature": temperature, "seed": int(kwargs.get("seed", seed))}
    if kwargs.get("top_k") is not None:
        picked["top_k"] = int(kwargs["top_k"])
    if kwargs.get("top_p") is not None and float(kwargs["top_p"]) < 1:
        picked["top_p"] = float(kwargs["top_p"])
    return picked


def _bound_generate(model) -> Generator:
    from zaya_jax.generation import generate

    return lambda prompts, **kwargs: generate(model, prompts, **kwargs)


def _batch_size(value) -> int:
    if value == "auto":
        return 8
    return _count("batch_size", value)


def _count(name: str, value) -> int | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number != int(number) or number < 1:
        raise ZayaError(f"{name} must be a positive integer, got {value!r}")
    return int(number)
