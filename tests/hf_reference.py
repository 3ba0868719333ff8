"""Helpers for parity tests: build a random HF ZayaForCausalLM and read it as numpy."""

from __future__ import annotations

import numpy as np
import torch
from transformers import ZayaConfig, ZayaForCausalLM

from zaya_jax.config import ModelConfig, to_hf_dict


def hf_model(cfg: ModelConfig, seed: int = 0) -> ZayaForCausalLM:
    """An HF model with EVERY tensor randomised (scales, biases, temperatures, balancing biases)."""
    torch.manual_seed(seed)
    hf_cfg = ZayaConfig(**{k: v for k, v in to_hf_dict(cfg).items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "eager"
    model = ZayaForCausalLM(hf_cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            tensor.copy_(_random_like(name, tensor, gen))
    return model


def _random_like(name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
    if name.endswith("balancing_biases"):
        # Spread comparable to the probabilities, so the biased choice differs from the plain
        # argmax and the skip class (last entry) wins for some tokens.
        return 0.15 * noise + torch.tensor([0.0] * (t.shape[0] - 1) + [0.05])
    if name.endswith(("scale", ".temp")) or "norm" in name:
        return 1.0 + 0.2 * noise
    if name.endswith("bias"):
        return 0.1 * noise
    if "embed_tokens" in name:
        return noise
    fan_in = t.shape[-1] if t.ndim >= 2 else 1
    if "conv_qk" in name:
        fan_in = t.shape[1] * t.shape[2]
    return noise / np.sqrt(fan_in)


def hf_state(model: ZayaForCausalLM) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def hf_logits(model: ZayaForCausalLM, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids, np.int64))).logits.float().numpy()
