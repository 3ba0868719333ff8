"""The ZAYA1 optimizer: Muon on hidden weight matrices, AdamW on everything else.

`PARTITION` is the one table saying, for every parameter (matched by the end of its path),
which optimizer updates it, whether weight decay applies, and for Muon how the tensor reads as
a batch of matrices. Following the ZAYA1 recipe: Muon on the attention projections (CCA's and
linear attention's), router
linears and expert matrices (per expert); AdamW on the embedding (= tied LM head), convs,
norms, residual scales/biases, EDA scales, temperatures and biases. Weight decay applies to
weight matrices, conv kernels and the embedding, never to norms, scales, biases or temperatures.
Schedule: linear warmup from 0, then cosine to `optim.min_lr`; global-norm clipping first. A
warmup that does not fit in the schedule (a smoke run of a few steps under a recipe's warmup)
is shortened to a tenth of the schedule (`warmup_steps`; the training banner says so).
"""

from __future__ import annotations

import dataclasses

import optax

from zaya_jax.errors import ZayaError
from zaya_jax.model.layer_stack import LAYER_AXIS
from zaya_jax.train.muon import MatrixView, ns_dtype, scale_by_muon


@dataclasses.dataclass(frozen=True)
class Rule:
    suffix: str  # matches every parameter path ending in this text
    optimizer: str  # "muon" | "adamw"
    decay: bool
    view: MatrixView | None = None


_IN1 = MatrixView(batch_axes=0, in_axes=1)
_EXPERT = MatrixView(batch_axes=1, in_axes=1)  # [E, fan_in, fan_out]: orthogonalise per expert

PARTITION: tuple[Rule, ...] = (
    # Hybrid models' linear-attention layers (before CCA's, whose suffixes they share).
    Rule("linear_attn/wq", "muon", True, _IN1),  # [H, nq, d]
    Rule("linear_attn/wk", "muon", True, _IN1),  # [H, nk, d]
    Rule("linear_attn/wv", "muon", True, _IN1),  # [H, nk, d]
    Rule("linear_attn/wg", "muon", True, _IN1),  # [H, nq, d]
    Rule("linear_attn/wo", "muon", True, MatrixView(batch_axes=0, in_axes=2)),  # [nq, d, H]
    Rule("linear_attn/out_norm", "adamw", False),
    Rule("attn/wq", "muon", True, _IN1),  # [H, nq, d]
    Rule("attn/wk", "muon", True, _IN1),  # [H, nk, d]
    Rule("attn/wv_current", "muon", True, _IN1),
    Rule("attn/wv_delayed", "muon", True, _IN1),
    Rule("attn/wo", "muon", True, MatrixView(batch_axes=0, in_axes=2)),  # [nq, d, H]
    Rule("router/down", "muon", True, _IN1),
    Rule("router/fc1", "muon", True, _IN1),
    Rule("router/fc2", "muon", True, _IN1),
    Rule("router/out", "muon", True, _IN1),
    Rule("experts/gate", "muon", True, _EXPERT),
    Rule("experts/up", "muon", True, _EXPERT),
    Rule("experts/down", "muon", True, _EXPERT),
    Rule("embedding", "adamw", True),
    Rule("attn/conv_depthwise", "adamw", True),
    Rule("attn/conv_grouped", "adamw", True),
    # No decay: biases, norm weights, residual affines, EDA scales, key temperatures.
    Rule("_bias", "adamw", False),
    Rule("norm/weight", "adamw", False),
    Rule("/scale", "adamw", False),
    Rule("/bias", "adamw", False),
    Rule("router/eda_scale", "adamw", False),
    Rule("attn/temperature", "adamw", False),
)


def rule_for(path: str) -> Rule:
    for rule in PARTITION:
        if path.endswith(rule.suffix):
            return rule
    raise ZayaError(f"parameter {path} has no optimizer rule; add it to zaya_jax.train.optim.PARTITION")


def schedule_steps(optim, total_steps: int) -> int:
    """Length of warmup + cosine: `optim.decay_steps`, or the run's steps."""
    return optim.decay_steps or total_steps


def warmup_steps(optim, total_steps: int) -> int:
    """The warmup the schedule uses: `optim.warmup_steps`, or a tenth of the schedule when it is not shorter."""
    length = schedule_steps(optim, total_steps)
    return optim.warmup_steps if optim.warmup_steps < length else length // 10


def learning_rate_schedule(optim, total_steps: int) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=warmup_steps(optim, total_steps),
        decay_steps=schedule_steps(optim, total_steps), end_value=optim.min_lr)


def stacked_view(view: MatrixView, axes: tuple[str, ...] | None) -> MatrixView:
    """The view of a parameter, one batch axis more when it leads with `layers` (stacked blocks),
    so each layer's matrices are orthogonalised on their own."""
    stacked = bool(axes) and axes[0] == LAYER_AXIS
    return dataclasses.replace(view, batch_axes=view.batch_axes + int(stacked))


def build_optimizer(optim, total_steps: int, param_axes, spread=None,
                    target: str | None = None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """optax transform for a flat `{path: array}` param dict, given `{path: logical axes}`, and
    its learning-rate schedule. `spread` runs Muon's Newton–Schulz over its batches of matrices (see
    `muon.orthogonal_update`); `target` (the program's kernel target) resolves `optim.muon_ns_dtype`."""
    rules = {path: rule_for(path) for path in param_axes}
    labels = {path: rule.optimizer for path, rule in rules.items()}
    decay_mask = {path: rule.decay for path, rule in rules.items()}
    views = {path: stacked_view(rule.view, param_axes[path]) for path, rule in rules.items() if rule.optimizer == "muon"}
    schedule = learning_rate_schedule(optim, total_steps)
    muon = optax.chain(
        scale_by_muon(views, optim.muon_momentum, optim.muon_nesterov, optim.muon_ns_steps, optim.muon_rms, spread,
                      ns_dtype(optim.muon_ns_dtype, target)),
        optax.add_decayed_weights(optim.weight_decay, mask=decay_mask),
        optax.scale_by_learning_rate(schedule),
    )
    adamw = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                        weight_decay=optim.weight_decay, mask=decay_mask)
    parts = [optax.multi_transform({"muon": muon, "adamw": adamw}, labels)]
    if optim.clip_norm > 0:
        parts.insert(0, optax.clip_by_global_norm(optim.clip_norm))
    return optax.chain(*parts), schedule
