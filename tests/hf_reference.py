"""Helpers for parity tests: build a random HF ZayaForCausalLM and read it as numpy; its loss on a
packed batch and its gradients in our parameter names."""

from __future__ import annotations

import contextlib

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


# ---------------------------------------------------------------------------------------------
# Loss and gradients (tests/test_grad_parity.py; reusable for trajectory comparisons)

IGNORE = -100  # HF's ignore_index for labels


def hf_to_ours(cfg: ModelConfig, fetch, skip=()) -> dict[str, np.ndarray]:
    """Per-layer arrays in our names from HF tensors `fetch(name)`, through `hf_mapping`'s own
    rules and transforms (weights, or gradients: every transform is a reshape/transpose/split, a
    linear map, so a gradient converts like its weight). Rules naming an HF tensor in `skip` are
    left out."""
    from zaya_jax.checkpoint import hf_mapping
    from zaya_jax.model.state import expected_shapes

    shapes = expected_shapes(cfg)
    out = {}
    for group in hf_mapping.grouped_rules(cfg).values():
        kept = [rule for rule in group if not set(rule.hf) & set(skip)]
        out.update(hf_mapping.convert_group_to_ours(kept, fetch, shapes, "hf"))
    return out


def hf_document_pieces(batch: dict[str, np.ndarray]):
    """(tokens, labels) int64 per (row, segment) piece of a packed batch that has loss tokens.

    HF eager attention knows no segment ids, so each piece runs as its own sequence: its input
    tokens plus the piece's last target (HF shifts labels by one inside its loss, so position j's
    label is token j+1 of the sequence), with IGNORE wherever our loss mask is 0. A piece starts at
    position 0, as a continued document does in our packed rows (`data/packing.py`).
    """
    inputs, targets, segments, mask = (np.asarray(batch[k]) for k in ("inputs", "targets", "segment_ids", "loss_mask"))
    pieces = []
    for row in range(inputs.shape[0]):
        for seg in np.unique(segments[row]):
            cols = np.flatnonzero(segments[row] == seg)
            if seg == 0 or not mask[row, cols].any():
                continue
            assert np.array_equal(cols, np.arange(cols[0], cols[-1] + 1)), "segments must be contiguous"
            tokens = np.append(inputs[row, cols], targets[row, cols[-1]]).astype(np.int64)
            labels = tokens.copy()
            labels[0] = IGNORE
            labels[1:][mask[row, cols] == 0] = IGNORE
            pieces.append((tokens, labels))
    return pieces


def hf_packed_loss(model: ZayaForCausalLM, batch: dict[str, np.ndarray]) -> torch.Tensor:
    """HF's own loss (`labels=`) for a packed batch: Σ over pieces of (summed piece token loss /
    all loss tokens of the batch), i.e. the batch's mean token loss, as one autograd graph."""
    total = int(np.asarray(batch["loss_mask"]).sum())
    loss = torch.zeros((), dtype=torch.float32)
    for tokens, labels in hf_document_pieces(batch):
        out = model(torch.from_numpy(tokens[None]), labels=torch.from_numpy(labels[None]), num_items_in_batch=total)
        loss = loss + out.loss
    return loss


def hf_gradients_as_ours(model: ZayaForCausalLM, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """After `loss.backward()`: every parameter gradient in our per-layer names, and the HF names
    of the mapped tensors that are buffers (no gradient: the balancing biases).

    Raises if an HF parameter has no rule (a gradient would go unchecked) or a rule names a tensor
    that is neither a parameter nor a buffer. A parameter the loss did not reach gets zeros.
    """
    from zaya_jax.checkpoint import hf_mapping

    params = dict(model.named_parameters())  # the tied lm_head.weight appears once, as the embedding
    buffers = dict(model.named_buffers())
    named = {name for rule in hf_mapping.rules(cfg) for name in rule.hf}
    unmapped = sorted(set(params) - named)
    if unmapped:
        raise AssertionError(f"HF parameters without a conversion rule: {unmapped}")
    strangers = sorted(named - set(params) - set(buffers))
    if strangers:
        raise AssertionError(f"conversion rules name tensors HF does not have: {strangers}")
    skip = tuple(sorted(named & set(buffers)))

    def grad(name):
        p = params[name]
        return (torch.zeros_like(p) if p.grad is None else p.grad).detach().float().numpy().copy()

    return hf_to_ours(cfg, grad, skip), skip


def sharpen_routers(model: ZayaForCausalLM, factor: float) -> ZayaForCausalLM:
    """Scale every router's output projection (its logits) by `factor`, in place.

    `hf_model`'s random routers give near-uniform probabilities that its balancing biases
    (spread 0.15) then dominate, so a few classes take every token of a layer and most experts
    would get no gradient; sharper logits let the tokens spread over every class while the biases
    still change some choices."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.router_mlp.out_proj.weight.mul_(factor)
    return model


@contextlib.contextmanager
def hf_router_records(model: ZayaForCausalLM):
    """Within the block, every router call appends to `records[layer]` the biased probabilities
    fp32[T, E+1] it chose from (softmax of its logits + balancing biases), as numpy."""
    records = [[] for _ in model.model.layers]
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, output, i=i):
            probs = torch.softmax(output[0].detach().float(), dim=-1) + module.balancing_biases
            records[i].append(probs.numpy().copy())
        handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def one_torch_thread():
    """Torch on one thread within the block. The tiny models' ops are far too small to split, and
    on a shared 2-core machine torch's second thread waits for a busy core: a packed batch's
    forward and backward take ~0.1 s on one thread and 1–15 s on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
