"""Up-front checks of an experiment's values and of combinations that cannot work.

Runs before anything is compiled or allocated. Each failure is one `ZayaError` sentence that
names the key, the value and what would work. Checks that need the device count (the mesh
against the machine, the batch against the data axes) live in `zaya_jax.parallel.mesh`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

from zaya_jax.config import ModelConfig
from zaya_jax.data.mixture import parse_mixture
from zaya_jax.errors import ZayaError
from zaya_jax.kernels import xla_flags
from zaya_jax.kernels.registry import KERNEL_FIELDS, resolve as resolve_kernel
from zaya_jax.experiment.schema import BALANCE_LR, BALANCERS, NS_DTYPES, REMAT_POLICIES, balance_lr
from zaya_jax.parallel.axes import MESH_AXES

BYTE_VOCAB = 259


@dataclasses.dataclass(frozen=True)
class Experiment:
    config: ml_collections.ConfigDict  # locked: every key validated
    model: ModelConfig
    source: str


def validate(values: dict[str, Any], source: str) -> Experiment:
    infinite = next(_infinite_numbers(values), None)
    if infinite:
        raise ZayaError(f"{source}: {infinite[0]} must be a finite number, got {infinite[1]}")
    try:
        model = ModelConfig(**values["model"])
    except ZayaError as e:
        raise ZayaError(f"{source}: {e}") from None
    config = ml_collections.ConfigDict(values)
    for check in (_train, _eval, _checkpoint, _optim, _fault, _data, _mesh, _kernels):
        message = check(config, model)
        if message:
            raise ZayaError(f"{source}: {message}")
    config.lock()
    return Experiment(config=config, model=model, source=source)


def _infinite_numbers(values: dict, prefix: str = ""):
    """(key, value) of every NaN or infinite number in the config, nested keys dotted."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _infinite_numbers(value, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            yield f"{prefix}{key}", value


def _at_least(config, key: str, low: int) -> str | None:
    group, name = key.split(".")
    value = config[group][name]
    return None if value >= low else f"{key} must be >= {low}, got {value}"


def _first(*messages):
    return next((m for m in messages if m), None)


def _train(c, model: ModelConfig) -> str | None:
    t = c.train
    return _first(
        *(_at_least(c, f"train.{k}", 1) for k in ("steps", "global_batch_size", "seq_len", "grad_accum_steps",
                                                   "log_every", "loss_vocab_chunk", "scan_unroll")),
        _at_least(c, "train.seed", 0),
        _at_least(c, "train.cpu_devices", 0),
        None if t.remat in REMAT_POLICIES else f"train.remat must be one of {REMAT_POLICIES}, got {t.remat!r}",
        None if t.global_batch_size % t.grad_accum_steps == 0 else
        f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.grad_accum_steps "
        f"({t.grad_accum_steps}): each micro-batch holds global_batch_size / grad_accum_steps sequences",
        None if t.seq_len <= model.max_position_embeddings else
        f"train.seq_len ({t.seq_len}) exceeds model.max_position_embeddings ({model.max_position_embeddings})",
        _hardware(t.hardware),
        None if t.compile_cache.strip() else
        "train.compile_cache must be 'workdir', 'off' or a directory, got an empty string",
        _profile_window(t),
    )


def profile_window(text: str) -> tuple[int, int] | None:
    """'START:STOP' → (START, STOP); '' → None. Raises ZayaError naming the fix."""
    text = text.strip()
    if not text:
        return None
    start, sep, stop = text.partition(":")
    try:
        window = int(start), int(stop)
    except ValueError:
        window = None
    if not sep or window is None or not 1 <= window[0] < window[1]:
        raise ZayaError(f"train.profile_steps must be START:STOP with 1 <= START < STOP (steps START to STOP-1 "
                        f"are traced, e.g. 10:13), got {text!r}")
    return window


def _profile_window(t) -> str | None:
    try:
        window = profile_window(t.profile_steps)
    except ZayaError as e:
        return str(e)
    if window and window[0] > t.steps:
        return f"train.profile_steps={t.profile_steps} starts after the run's last step ({t.steps}); trace earlier steps"
    return None


def _hardware(name: str) -> str | None:
    from zaya_jax.hardware import PROFILES

    if name == "auto" or name in PROFILES:
        return None
    return f"train.hardware must be 'auto' or one of {sorted(PROFILES)}, got {name!r}"


def _eval(c, model) -> str | None:
    e = c.eval
    prompts = list(e.prompts)
    return _first(
        *(_at_least(c, f"eval.{k}", 0) for k in ("every_steps", "batches", "batch_size", "task_limit")),
        _at_least(c, "eval.prompt_tokens", 1),
        None if all(isinstance(p, str) and p for p in prompts) else
        f"eval.prompts must be a list of non-empty texts, got {prompts!r}",
        None if not prompts or e.prompt_tokens < c.train.seq_len else
        f"eval.prompt_tokens ({e.prompt_tokens}) must be below train.seq_len ({c.train.seq_len})")


def _checkpoint(c, model) -> str | None:
    return _first(_at_least(c, "checkpoint.every_steps", 0), _at_least(c, "checkpoint.keep", 1))


def _optim(c, model) -> str | None:
    o = c.optim
    checks = [
        (o.lr > 0, f"optim.lr must be positive, got {o.lr}"),
        (0 <= o.min_lr <= o.lr, f"optim.min_lr ({o.min_lr}) must be between 0 and optim.lr ({o.lr})"),
        (o.warmup_steps >= 0 and o.decay_steps >= 0, "optim.warmup_steps and optim.decay_steps must be >= 0"),
        (o.weight_decay >= 0 and o.clip_norm >= 0, "optim.weight_decay and optim.clip_norm must be >= 0"),
        (all(0 <= b < 1 for b in (o.b1, o.b2, o.balance_b1, o.balance_b2, o.muon_momentum)),
         "optim.b1, b2, balance_b1, balance_b2 and muon_momentum must be in [0, 1)"),
        (o.eps > 0 and o.muon_rms > 0, "optim.eps and optim.muon_rms must be positive"),
        (o.muon_ns_steps >= 1, f"optim.muon_ns_steps must be >= 1, got {o.muon_ns_steps}"),
        (o.muon_ns_dtype in NS_DTYPES,
         f"optim.muon_ns_dtype must be one of {', '.join(NS_DTYPES)}, got {o.muon_ns_dtype!r}"),
        (o.balancer in BALANCERS, f"optim.balancer must be one of {', '.join(BALANCERS)}, got {o.balancer!r}"),
    ]
    return next((msg for ok, msg in checks if not ok), None) or _balance_lr(o)


def _balance_lr(o) -> str | None:
    """optim.balance_lr against its balancer: 0 (off) up to the most that balancer takes."""
    (default, most), lr = BALANCE_LR[o.balancer], balance_lr(o)
    if 0 <= lr <= most:
        return None
    if lr < 0:
        return f"optim.balance_lr must be >= 0 (0 turns balancing off), got {lr}"
    reasons = {"solve": "it is the share of each solved bias step taken, and above 1 the step overshoots",
               "adam": "Adam moves every bias by about its lr each step whatever the load, and that herds a "
                       "layer's tokens onto one expert"}
    return (f"optim.balance_lr={lr:g} is too large for optim.balancer={o.balancer}: {reasons[o.balancer]}; use at "
            f"most {most:g} (its default is {default:g}: leave optim.balance_lr unset)")


def _fault(c, model) -> str | None:
    f = c.fault
    checks = [
        (f.hang_timeout_sec >= 0 and f.io_timeout_sec >= 0,
         "fault.hang_timeout_sec and fault.io_timeout_sec must be >= 0 (0 = no watchdog)"),
        (f.spike_sigmas >= 0, f"fault.spike_sigmas must be >= 0 (0 = only NaN/inf are bad), got {f.spike_sigmas}"),
        (f.spike_window >= 1, f"fault.spike_window must be >= 1, got {f.spike_window}"),
        (f.max_consecutive_bad_steps >= 0 and f.max_rollbacks >= 0,
         "fault.max_consecutive_bad_steps and fault.max_rollbacks must be >= 0"),
        (f.on_bad_steps in ("rollback", "stop"), f"fault.on_bad_steps must be 'rollback' or 'stop', got {f.on_bad_steps!r}"),
    ]
    message = next((msg for ok, msg in checks if not ok), None)
    if message:
        return message
    from zaya_jax.drills import parse

    try:
        parse(f.drill)
    except ZayaError as e:
        return str(e)
    return None


def _data(c, model: ModelConfig) -> str | None:
    d = c.data
    if not 0 <= d.heldout_fraction < 1:
        return f"data.heldout_fraction must be in [0, 1), got {d.heldout_fraction}"
    if d.read_threads < 1:
        return f"data.read_threads must be at least 1, got {d.read_threads}"
    try:
        parse_mixture(d.source, d.weights)
    except ZayaError as e:
        return str(e)
    if d.tokenizer == "bytes" and model.vocab_size < BYTE_VOCAB:
        return (f"model.vocab_size ({model.vocab_size}) is too small for the byte tokenizer "
                f"(needs {BYTE_VOCAB}); raise it or set data.tokenizer to a tokenizer.json")
    return None


def _kernels(c, model: ModelConfig) -> str | None:
    """Each kernel backend must train and exist on the target (cudnn needs NVIDIA, hipblaslt ROCm,
    pallas is not for TPU). The names are already checked (ModelConfig); the XLA flags a backend
    needs are set here, before `resolve` starts JAX (it asks for the devices)."""
    try:
        xla_flags.require(model)
    except ZayaError as e:
        return str(e)
    for field, kernel in KERNEL_FIELDS.items():
        try:
            resolve_kernel(kernel, getattr(model, field))
        except ZayaError as e:
            return f"model.{field}: {e}"
    return None


def _mesh(c, model) -> str | None:
    sizes = {axis: c.mesh[axis] for axis in MESH_AXES}
    bad = [a for a, s in sizes.items() if not (s >= 1 or s == -1)]
    if bad:
        return f"mesh.{bad[0]} must be a positive size or -1 (take the remaining devices), got {sizes[bad[0]]}"
    if sum(s == -1 for s in sizes.values()) > 1:
        return "only one mesh axis may be -1; give the others explicit sizes"
    return None
