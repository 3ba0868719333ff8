"""The model configuration: ZAYA1 hyper-parameters under Hugging Face `ZayaConfig` names.

Owns the `ModelConfig` dataclass, its validation, the named presets, and the translation to
and from a Hugging Face `config.json`. Field names follow `transformers.ZayaConfig` so that a
user who knows the HF model recognises every knob.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from zaya_jax.errors import ZayaError
from zaya_jax.kernels.registry import KERNEL_FIELDS, check_name as check_kernel_name

COMPUTE_DTYPES = ("float32", "bfloat16")
# Fields that choose how the model is computed, not what it is: they are not in HF's config,
# and a checkpoint may be resumed with different values.
COMPUTE_FIELDS = ("compute_dtype", "attention_kernel", "moe_kernel", "norm_kernel", "linear_kernel")
# Not in HF either, but what the model is: hybrid layers (HF's ZAYA has CCA layers only).
HYBRID_FIELDS = ("layer_pattern", "linear_feature_map", "linear_decay")
LAYER_KINDS = {"C": "CCA", "L": "linear attention"}
LINEAR_FEATURE_MAPS = ("elu1", "silu", "identity")
LINEAR_DECAYS = ("none", "retention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """ZAYA1 hyper-parameters. Defaults are exactly HF `ZayaConfig()` (the `zaya1_base` preset)."""

    vocab_size: int = 262272
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    num_experts: int = 16
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 2048
    router_hidden_size: int = 256
    cca_time0: int = 2
    cca_time1: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 5_000_000.0
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 106
    # Not in HF: how we compute. "float32" is the parity policy; "bfloat16" keeps fp32 islands
    # (residual stream, norm statistics, QK norm, router, LM head) and runs matmuls in bf16.
    compute_dtype: str = "float32"
    # Not in HF: which implementation runs each hot-path kernel (zaya_jax.kernels.registry):
    # "auto" (the platform default) | "reference" | "xla" | "pallas"; also "cudnn" for attention
    # (inference only: no segment ids) and "cudnn" / "hipblaslt" for the experts (registry.VENDOR_BACKENDS).
    attention_kernel: str = "auto"
    moe_kernel: str = "auto"  # the experts' grouped matmul
    norm_kernel: str = "auto"  # RMSNorm
    linear_kernel: str = "auto"  # hybrid models' linear attention
    # Not in HF: hybrid models (model/linear_attn.py). The layer kinds, a pattern repeated over the
    # depth: "C" = CCA, "L" = linear attention ("LLLC": three linear layers, then one CCA).
    layer_pattern: str = "C"
    linear_feature_map: str = "elu1"  # φ on the linear layers' q and k: elu(x)+1, silu, or none
    linear_decay: str = "none"  # "none": basic linear attention; "retention": RetNet's fixed per-head decay

    def __post_init__(self):
        validate(self)

    # Derived sizes used throughout the model and the converters.
    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qk_channels(self) -> int:
        return (self.num_attention_heads + self.num_key_value_heads) * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_kinds(self) -> str:
        """Each layer's kind ("C" or "L"), layer 0 first: the pattern repeated over the depth."""
        return self.layer_pattern * (self.num_hidden_layers // len(self.layer_pattern))

    @property
    def is_hybrid(self) -> bool:
        return "L" in self.layer_pattern

    @property
    def value_half(self) -> int:
        return self.num_key_value_heads * self.head_dim // 2

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size",
    "router_hidden_size", "cca_time0", "cca_time1", "max_position_embeddings",
)


def validate(cfg: ModelConfig) -> None:
    """Raise ZayaError naming the first impossible or unsupported value."""
    for name in _POSITIVE_INTS:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ZayaError(f"model.{name} must be a positive integer, got {value!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ZayaError(
            f"model.num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"model.num_key_value_heads ({cfg.num_key_value_heads})"
        )
    if (cfg.num_key_value_heads * cfg.head_dim) % 2:
        raise ZayaError(
            "model.num_key_value_heads * model.head_dim must be even: CCA splits the value "
            "channels into a current half and a delayed half"
        )
    if cfg.num_experts_per_tok != 1:
        raise ZayaError(f"model.num_experts_per_tok must be 1 (ZAYA1 routes top-1), got {cfg.num_experts_per_tok}")
    if not 0.0 < cfg.partial_rotary_factor <= 1.0 or cfg.rotary_dim % 2:
        raise ZayaError(
            f"model.partial_rotary_factor={cfg.partial_rotary_factor} must be in (0, 1] and give an even "
            f"rotary width (head_dim * factor = {cfg.head_dim * cfg.partial_rotary_factor})"
        )
    for name, value in dataclasses.asdict(cfg).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ZayaError(f"model.{name} must be a finite number, got {value}")
    if not cfg.rope_theta > 0 or not cfg.rms_norm_eps > 0:
        raise ZayaError("model.rope_theta and model.rms_norm_eps must be positive")
    if not cfg.initializer_range >= 0:
        raise ZayaError(f"model.initializer_range must be >= 0, got {cfg.initializer_range}")
    _validate_token_ids(cfg)
    if cfg.hidden_act != "silu":
        raise ZayaError(f"model.hidden_act must be 'silu' (ZAYA1 experts are SwiGLU), got {cfg.hidden_act!r}")
    if not cfg.tie_word_embeddings:
        raise ZayaError("model.tie_word_embeddings must be true: ZAYA1's LM head is the embedding")
    if cfg.compute_dtype not in COMPUTE_DTYPES:
        raise ZayaError(f"model.compute_dtype must be one of {COMPUTE_DTYPES}, got {cfg.compute_dtype!r}")
    for field, kernel in KERNEL_FIELDS.items():
        check_kernel_name(kernel, getattr(cfg, field), where=f"model.{field}")
    _validate_hybrid(cfg)


def _validate_token_ids(cfg: ModelConfig) -> None:
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, name)
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and (isinstance(token, bool) or not isinstance(token, int)
                                      or not 0 <= token < cfg.vocab_size):
                raise ZayaError(f"model.{name} must be a token id in 0..{cfg.vocab_size - 1} (model.vocab_size) "
                                f"or None, got {value!r}")


def _validate_hybrid(cfg: ModelConfig) -> None:
    pattern = cfg.layer_pattern
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(LAYER_KINDS):
        raise ZayaError(f"model.layer_pattern must be a non-empty string of {sorted(LAYER_KINDS)} "
                        f"(C = CCA, L = linear attention), got {pattern!r}")
    if cfg.num_hidden_layers % len(pattern):
        raise ZayaError(f"model.num_hidden_layers ({cfg.num_hidden_layers}) must be a multiple of the length of "
                        f"model.layer_pattern {pattern!r} ({len(pattern)}): the pattern repeats over the depth")
    if cfg.linear_feature_map not in LINEAR_FEATURE_MAPS:
        raise ZayaError(f"model.linear_feature_map must be one of {LINEAR_FEATURE_MAPS}, got {cfg.linear_feature_map!r}")
    if cfg.linear_decay not in LINEAR_DECAYS:
        raise ZayaError(f"model.linear_decay must be one of {LINEAR_DECAYS}, got {cfg.linear_decay!r}")


# ---------------------------------------------------------------------------------------------
# Presets

PRESETS: dict[str, ModelConfig] = {
    # Exactly HF ZayaConfig() defaults: ZAYA1-base / ZAYA1-8B architecture.
    "zaya1_base": ModelConfig(),
    # Tiny shapes for unit tests: every code path, seconds on a CPU.
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32,
        router_hidden_size=16, max_position_embeddings=1024, rope_theta=10_000.0,
    ),
    # A small ZAYA1 that trains on 2 CPU cores in minutes (byte-level vocabulary).
    "tiny_cpu": ModelConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=4, moe_intermediate_size=128,
        router_hidden_size=32, max_position_embeddings=4096, rope_theta=10_000.0,
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ZayaError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json

_HF_PLAIN_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelConfig)
    if f.name not in ("rope_theta", "partial_rotary_factor") + COMPUTE_FIELDS + HYBRID_FIELDS
)


def from_hf_dict(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the contents of an HF `config.json`; reject what we do not model."""
    model_type = hf.get("model_type")
    if model_type != "zaya":
        raise ZayaError(f"{source} describes model_type {model_type!r}, not 'zaya'; point at a ZAYA checkpoint")
    unsupported = {
        "attention_bias": False, "lm_head_bias": False,
    }
    for key, wanted in unsupported.items():
        if hf.get(key, wanted) != wanted:
            raise ZayaError(f"{source}: {key}={hf[key]!r} is not supported (ZAYA1 uses {wanted})")
    layer_types = hf.get("layer_types") or ["hybrid"] * hf.get("num_hidden_layers", 40)
    if any(t != "hybrid" for t in layer_types):
        raise ZayaError(
            f"{source}: layer_types contains {sorted(set(layer_types) - {'hybrid'})}; only full-attention "
            "'hybrid' layers (ZAYA1-base / ZAYA1-8B) are supported, not sliding-window layers"
        )
    theta, factor = _rope_from_hf(hf, source)
    kwargs = {k: hf[k] for k in _HF_PLAIN_FIELDS if k in hf}
    try:
        return ModelConfig(**kwargs, rope_theta=float(theta), partial_rotary_factor=float(factor))
    except ZayaError as e:
        raise ZayaError(f"{source}: {e}") from None


def _rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, float]:
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and "hybrid" in rope:
        rope = rope["hybrid"]
    if not isinstance(rope, dict):
        rope = {"rope_theta": hf.get("rope_theta", 5_000_000.0),
                "partial_rotary_factor": hf.get("partial_rotary_factor", 0.5)}
    if rope.get("rope_type", "default") != "default":
        raise ZayaError(f"{source}: rope_type {rope['rope_type']!r} is not supported; only 'default' RoPE")
    return rope.get("rope_theta", 5_000_000.0), rope.get("partial_rotary_factor", 1.0)


def to_hf_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` that `transformers.AutoConfig` loads back into an equal ZayaConfig."""
    if cfg.is_hybrid:
        raise ZayaError(f"model.layer_pattern={cfg.layer_pattern!r} has linear-attention layers, which Hugging "
                        "Face's ZAYA does not have: a hybrid model stays in our format (read it with zaya_jax.load)")
    out: dict[str, Any] = {"architectures": ["ZayaForCausalLM"], "model_type": "zaya"}
    out.update({k: getattr(cfg, k) for k in _HF_PLAIN_FIELDS})
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor}
    out.update(
        attention_bias=False, lm_head_bias=False, sliding_window=None, attention_dropout=0.0,
        layer_types=["hybrid"] * cfg.num_hidden_layers,
        rope_parameters={"hybrid": rope, "hybrid_sliding": dict(rope, rope_theta=10_000.0)},
        dtype=dtype,
    )
    return out


def read_hf_config(directory: str) -> ModelConfig:
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise ZayaError(f"{directory} does not exist or is not a directory")
    if not os.path.isfile(path):
        raise ZayaError(f"{directory} has no config.json; it is not a Hugging Face model directory")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ZayaError(f"{path} is not valid JSON ({e}); re-export the checkpoint") from None
    if not isinstance(hf, dict):
        raise ZayaError(f"{path} does not hold a JSON object")
    return from_hf_dict(hf, source=path)


def write_hf_config(cfg: ModelConfig, directory: str, dtype: str = "float32") -> str:
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump(to_hf_dict(cfg, dtype), f, indent=2, sort_keys=True)
        f.write("\n")
    return path
