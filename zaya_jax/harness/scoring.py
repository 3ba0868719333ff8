"""Log-likelihoods of continuations: the batched, compiled forward behind downstream evaluation.

A request is (context tokens, continuation tokens). `Scorer.score` cuts each row to the last
`max_length + 1` tokens (left truncation, as lm-eval's models do), feeds all but the last, and
returns the summed log-probability of the continuation and whether greedy decoding would have
produced it. Rows are sorted longest first, right-padded to a length bucket (a power of two, so a
task compiles a handful of programs, not one per length) and batched; the reduction to two numbers
per row happens on the devices, so no [rows, length, vocab] logits cross to the host.

With `fixed_width` every batch is `max_length` wide instead (the trainer's program, compiled for
its sequence length). `model_scorer` runs a loaded model data-parallel over the local devices: the weights replicated,
each device scoring its share of the rows (`jax.shard_map`).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.errors import ZayaError

Request = tuple[Sequence[int], Sequence[int]]  # (context, continuation)
RowScores = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
SHORTEST_BUCKET = 16


class Scorer:
    """Scores requests in batches of `batch_size` rows through `row_scores(ids, targets, weights)`,
    which returns each row's Σ weights·log p(target) and whether every weighted target is the argmax."""

    def __init__(self, row_scores: RowScores, *, batch_size: int, max_length: int, fixed_width: bool = False):
        if batch_size < 1 or max_length < 2:
            raise ZayaError(f"batch size ({batch_size}) and max length ({max_length}) must be ≥ 1 and ≥ 2")
        self.row_scores, self.batch_size, self.max_length = row_scores, batch_size, max_length
        self.fixed_width = fixed_width  # every batch max_length wide (a program compiled for one shape)

    def score(self, requests: Sequence[Request], on_batch: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
        rows = [self._row(context, continuation) for context, continuation in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            ids, targets, weights = self._batch([rows[i] for i in chunk])
            total, greedy = self.row_scores(ids, targets, weights)
            for n, i in enumerate(chunk):
                out[i] = (float(total[n]), bool(greedy[n]))
            if on_batch is not None:
                on_batch(len(chunk))
        return out

    def _row(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], int]:
        if not context or not continuation:
            raise ZayaError("a scored request needs at least one context and one continuation token")
        if len(continuation) > self.max_length:
            raise ZayaError(f"a continuation of {len(continuation)} tokens is longer than the model's "
                            f"max length {self.max_length}; raise max_length or shorten the task's targets")
        whole = (list(context) + list(continuation))[-(self.max_length + 1):]
        return whole, len(continuation)

    def _batch(self, rows: list[tuple[list[int], int]]):
        longest = max(len(whole) - 1 for whole, _ in rows)
        width = self.max_length if self.fixed_width else length_bucket(longest, self.max_length)
        ids = np.zeros((self.batch_size, width), np.int32)
        targets = np.zeros_like(ids)
        weights = np.zeros(ids.shape, np.float32)
        for n, (whole, scored) in enumerate(rows):
            length = len(whole) - 1
            ids[n, :length] = whole[:-1]
            targets[n, :length] = whole[1:]
            weights[n, length - scored:length] = 1.0
        return ids, targets, weights


def length_bucket(length: int, max_length: int) -> int:
    """The padded length of a batch whose longest row is `length`: the next power of two from
    `SHORTEST_BUCKET`, at most `max_length`."""
    return min(max(SHORTEST_BUCKET, 1 << math.ceil(math.log2(max(length, 1)))), max(max_length, length))


def model_scorer(model, *, batch_size: int, max_length: int | None = None, devices=None) -> Scorer:
    """A `Scorer` for a loaded model, data-parallel over `devices` (default: the local devices);
    `batch_size` is rounded up to a multiple of their number."""
    devices = list(devices or jax.local_devices())
    mesh = Mesh(np.array(devices), ("rows",))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    spread = jax.jit(jax.shard_map(functools.partial(_row_scores, graphdef), mesh=mesh,
                                   in_specs=(P(), P("rows"), P("rows"), P("rows")), out_specs=(P("rows"), P("rows")),
                                   check_vma=False))
    rows_sharding = NamedSharding(mesh, P("rows"))

    def row_scores(ids, targets, weights):
        placed = (jax.device_put(a, rows_sharding) for a in (ids, targets, weights))
        return jax.device_get(spread(state, *placed))

    batch = -(-batch_size // len(devices)) * len(devices)
    return Scorer(row_scores, batch_size=batch, max_length=max_length or model.cfg.max_position_embeddings)


def _row_scores(graphdef, state, ids, targets, weights):
    return target_scores(nnx.merge(graphdef, state)(ids), targets, weights)


def target_scores(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row: Σ weights·log softmax(logits)[target] (fp32), and whether the argmax is the target
    wherever the weight is nonzero."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
    hits = (jnp.argmax(logits, axis=-1) == targets) | (weights == 0)
    return (picked * weights).sum(-1), hits.all(-1)
