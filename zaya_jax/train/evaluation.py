"""Held-out evaluation during training: the eval batch size a layout allows, and the mean token loss
over the held-out batches."""

from __future__ import annotations

import jax
import numpy as np

from zaya_jax.errors import ZayaError
from zaya_jax.parallel.mesh import BATCH_AXES
from zaya_jax.train.program import Program


def eval_batch_size(program: Program) -> int:
    size = program.exp.config.eval.batch_size or program.micro_batch
    width = int(np.prod([program.mesh.shape[a] for a in BATCH_AXES]))
    if size % width:
        raise ZayaError(f"eval.batch_size ({size}) must be a multiple of the {width} data-parallel devices")
    return size


def evaluate(program: Program, eval_step, state, batches: list[dict], size: int) -> dict | None:
    if not batches:
        return None
    loss, tokens = 0.0, 0.0
    for batch in batches:
        l, n = jax.device_get(eval_step(state.params, state.biases, program.place_eval_batch(batch, size)))
        loss, tokens = loss + float(l), tokens + float(n)
    return {"eval_loss": loss / max(tokens, 1.0), "eval_tokens": tokens}
