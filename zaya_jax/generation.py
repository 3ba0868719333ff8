"""`generate(model, prompts, ...)`: text continuation with a per-layer cache (`model/decode.py`).

The prompts, of any lengths, are left-padded into one batch and run in one pass (prefill); then
each new token is one call of the compiled decode step, compiled once per batch shape and cache
size, not per token. Greedy (`temperature=0`) takes the most likely token; otherwise tokens are
drawn from the softmax at `temperature`, cut to the `top_k` most likely and/or the smallest set
whose probability reaches `top_p`, from a key derived from `seed` and the step alone (the same
seed gives the same tokens).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.errors import ZayaError
from zaya_jax.model import decode


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop: Iterable[int] = (), seed: int = 0,
             on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
             stop_when: Callable[[int, list[int]], bool] | None = None) -> list[list[int]]:
    """The new tokens of each prompt (a list of token ids), up to `max_new_tokens`; a row ends after
    its first token in `stop` (which it keeps, as Hugging Face's `generate` does).

    `on_tokens(tokens, active)` is called after every step with the step's token per row and
    which rows were still generating (for streaming). `stop_when(row, tokens)` is asked after every
    step about each row still generating, with its new tokens so far; True ends the row (a stop
    string, for example).
    """
    cfg = model.cfg
    rows = _check(cfg, prompts, max_new_tokens, temperature, top_k, top_p)
    stop = frozenset(int(t) for t in stop)
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
    start = jnp.asarray([width - len(r) for r in rows], jnp.int32)
    graphdef, state = nnx.split(model)
    cache = decode.empty_cache(cfg, start, width + max_new_tokens)
    logits, cache = _step(graphdef, state, jnp.asarray(ids), cache)
    key = jax.random.key(seed)
    out: list[list[int]] = [[] for _ in rows]
    active = np.ones(len(rows), bool)
    for i in range(max_new_tokens):
        tokens = np.asarray(_choose(logits, jax.random.fold_in(key, i), float(temperature), top_k, top_p))
        for row in np.flatnonzero(active):
            out[row].append(int(tokens[row]))
        if on_tokens is not None:
            on_tokens(tokens, active.copy())
        active &= ~np.isin(tokens, list(stop))
        if stop_when is not None:
            for row in np.flatnonzero(active):
                active[row] = not stop_when(int(row), out[row])
        if not active.any() or i == max_new_tokens - 1:
            break
        logits, cache = _step(graphdef, state, jnp.asarray(tokens[:, None]), cache)
    return out


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, ids, cache):
    return decode.step(nnx.merge(graphdef, state), ids, cache)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _choose(logits, key, temperature: float, top_k: int | None, top_p: float | None) -> jax.Array:
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    ranked = jnp.sort(logits, axis=-1)[:, ::-1]
    if top_k is not None:
        logits = jnp.where(logits < ranked[:, top_k - 1:top_k], -jnp.inf, logits)
        ranked = jnp.where(jnp.arange(ranked.shape[-1]) < top_k, ranked, -jnp.inf)
    if top_p is not None:
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
        kept = jnp.where(before < top_p, ranked, jnp.inf)  # the most likely token is always kept
        logits = jnp.where(logits < kept.min(axis=-1, keepdims=True), -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _check(cfg, prompts, max_new_tokens, temperature, top_k, top_p) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not len(prompts):
        raise ZayaError("prompts must be a non-empty list of token-id lists")
    rows = [[int(t) for t in p] for p in prompts]
    if any(not r for r in rows):
        raise ZayaError(f"prompt {[len(r) for r in rows].index(0)} is empty; every prompt needs at least one token")
    bad = [t for r in rows for t in r if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ZayaError(f"token id {bad[0]} is outside the model's vocabulary of {cfg.vocab_size}")
    check_sampling(max_new_tokens, temperature, top_k, top_p, cfg.vocab_size)
    return rows


def check_sampling(max_new_tokens, temperature, top_k, top_p, vocab_size: int | None = None, flags: bool = False) -> None:
    """The generation settings' ranges; `flags` names them as `zaya generate`'s flags (--top-k)."""
    def name(arg: str) -> str:
        return "--" + arg.replace("_", "-") if flags else arg

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ZayaError(f"{name('max_new_tokens')} must be a positive integer, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ZayaError(f"{name('temperature')} must be a finite number ≥ 0 (0 = greedy), got {temperature!r}")
    top = vocab_size or math.inf
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= top):
        raise ZayaError(f"{name('top_k')} must be an integer in 1..{vocab_size or 'the vocabulary size'}, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ZayaError(f"{name('top_p')} must be in (0, 1], got {top_p!r}")
    if (top_k is not None or top_p is not None) and temperature == 0:
        raise ZayaError(f"{name('top_k')} and {name('top_p')} choose among sampled tokens; set "
                        f"{name('temperature')} > 0 (0 is greedy)")
