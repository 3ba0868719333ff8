"""Analytic model FLOPs per token and MFU, MaxText style.

Owns the FLOP count that MFU is measured against. It is a model count, not a hardware count:
it ignores recomputation, padding, the router's wasted capacity and elementwise work, so MFU
compares runs and implementations, not kernels.

The formula, for ModelConfig fields H=hidden_size, L=num_hidden_layers, nq, nk, d=head_dim,
E=num_experts, I=moe_intermediate_size, R=router_hidden_size, V=vocab_size:

    matmul weights touched per token (each is one multiply-accumulate, MAC):
      per layer  attention projections  H·nq·d + H·nk·d + 2·H·(nk·d/2) + nq·d·H
                 CCA grouped conv        cca_time1·(nq+nk)·d·d    (a matmul per tap and head)
                 CCA depthwise conv      cca_time0·(nq+nk)·d
                 router MLP              H·R + 2·R·R + R·(E+1)    (E experts + the skip class)
                 one routed expert       3·H·I                    (top-1 SwiGLU: gate, up, down)
      P = L · (sum of the above) + V·H                           (tied LM head)

    dense     = 6 · P                                  (2 FLOPs per MAC; backward = 2 × forward)
    attention = 3 · L · (4 · seq_len · nq · d) / 2     (QKᵀ and AV, fwd+bwd, causal halved)

    A hybrid model's linear-attention layers (`model.layer_pattern` L) count their projections
    H·nq·d + 2·H·nk·d + H·nq·d + nq·d·H (q, k, v, gate, out) in place of CCA's projections and
    convs, and 3 · 4·nq·d² attention FLOPs per token (q·M and kᵀv of the recurrence; no seq_len).
    total     = dense + attention

    MFU = total · tokens_per_sec / (num_devices · peak_tflops · 1e12)

The expert is counted for every token even though tokens routed to the skip class run no
expert: MFU measures against the model's nominal top-1 compute. Not counted: the embedding
lookup (a gather, not a matmul), norms, biases, residual scales, RoPE, softmax, SwiGLU's
activation and the EDA mixing. For ZAYA1-base this gives 1.290 G MACs, 7.74 GFLOP dense and
1.01 GFLOP attention per token at seq_len 4096 (8.05 GFLOP at 32768).
"""

from __future__ import annotations

import dataclasses

from zaya_jax.config import ModelConfig
from zaya_jax.errors import ZayaError


@dataclasses.dataclass(frozen=True)
class TrainingFlops:
    """Training FLOPs per token (forward + backward), split into parts."""

    dense: float  # 6 · matmul weights per token
    attention: float  # the causal attention core, which grows with seq_len
    total: float


def attention_projection_params(cfg: ModelConfig) -> int:
    h, nq, nk, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # q, k, the two value halves (current and delayed token), and the output projection.
    return h * nq * d + h * nk * d + 2 * h * cfg.value_half + nq * d * h


def cca_conv_params(cfg: ModelConfig) -> int:
    nq, nk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    grouped = cfg.cca_time1 * (nq + nk) * d * d  # a [d, d] matmul per tap and per head group
    depthwise = cfg.cca_time0 * cfg.qk_channels  # one MAC per tap and channel
    return grouped + depthwise


def router_params(cfg: ModelConfig) -> int:
    r = cfg.router_hidden_size
    # Down-projection, two hidden layers, and a head over E experts plus the skip class.
    return cfg.hidden_size * r + 2 * r * r + r * (cfg.num_experts + 1)


def expert_params(cfg: ModelConfig) -> int:
    # One SwiGLU expert (top-1): gate and up [H, I], down [I, H].
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def linear_projection_params(cfg: ModelConfig) -> int:
    h, nq, nk, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # A linear-attention layer's q, k, v, output gate and output projection.
    return h * nq * d + 2 * h * nk * d + h * nq * d + nq * d * h


def layer_mixer_params(cfg: ModelConfig, kind: str) -> int:
    """One layer's token-mixer matmul weights per token, by layer kind (C: CCA, L: linear attention)."""
    if kind == "L":
        return linear_projection_params(cfg)
    return attention_projection_params(cfg) + cca_conv_params(cfg)


def mixer_params(cfg: ModelConfig) -> int:
    """Token-mixer matmul weights per token summed over the layers (CCA's or linear attention's)."""
    kinds = cfg.layer_kinds
    return sum(kinds.count(kind) * layer_mixer_params(cfg, kind) for kind in ("C", "L"))


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Matmul weights touched per token (= MACs per token, forward), LM head included."""
    per_layer = router_params(cfg) + expert_params(cfg)
    return cfg.num_hidden_layers * per_layer + mixer_params(cfg) + cfg.vocab_size * cfg.hidden_size


def layer_core_flops(cfg: ModelConfig, kind: str, seq_len: int) -> float:
    """One layer's attention-core training FLOPs per token, by kind: 3 · 4·S·nq·d / 2 for CCA
    (QKᵀ + AV, causal: half masked), 3 · 4·nq·d² for linear attention (q·M and kᵀv: no S)."""
    if kind == "L":
        return 3.0 * 4 * cfg.num_attention_heads * cfg.head_dim ** 2
    return 3.0 * 4 * seq_len * cfg.num_attention_heads * cfg.head_dim / 2


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Attention-core training FLOPs per token summed over the layers (`layer_core_flops`)."""
    kinds = cfg.layer_kinds
    return sum(kinds.count(kind) * layer_core_flops(cfg, kind, seq_len) for kind in ("C", "L"))


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> TrainingFlops:
    """Model training FLOPs per token at sequence length `seq_len` (see the module docstring)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ZayaError(f"seq_len must be a positive integer, got {seq_len!r}")
    dense = 6.0 * matmul_params_per_token(cfg)
    attention = attention_flops_per_token(cfg, seq_len)
    return TrainingFlops(dense=dense, attention=attention, total=dense + attention)


def mfu(flops_per_token: float, tokens_per_sec: float, num_devices: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation: flops_per_token · tokens_per_sec / (num_devices · peak_tflops · 1e12).

    `tokens_per_sec` is the whole job's throughput; `peak_tflops` is per device.
    """
    if num_devices < 1 or not peak_tflops > 0:
        # A caller bug, not user input: the peak comes from a validated HardwareProfile.
        raise ValueError(f"mfu needs num_devices >= 1 and peak_tflops > 0, got {num_devices} and {peak_tflops}")
    return flops_per_token * tokens_per_sec / (num_devices * peak_tflops * 1e12)
