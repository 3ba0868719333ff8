"""Loss and every parameter gradient of the training path against PyTorch autograd through HF's
`ZayaForCausalLM` (fp32), on packed rows.

This file owns the claim that what training differentiates is HF's model: for the same weights
(an HF model with every tensor randomised, converted to ours) and the same packed batch (several
documents per row, a document continued across rows, padding, the loss mask of `pack_documents`),
our loss and the gradient of every parameter, computed by the train step's own
`accumulate_gradients` → `batch_sums` (chunked cross-entropy, micro-batch accumulation, division
by the loss-token count), equal HF's loss and `loss.backward()`. The HF gradients come back into
our names through `hf_mapping`'s rules (`hf_reference.hf_gradients_as_ours`). Logit parity alone
lives in test_parity.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")  # the reference side; absent where no CPU torch wheel exists (Python 3.12 CI)
from hf_reference import (hf_gradients_as_ours, hf_model, hf_packed_loss, hf_router_records, hf_state, hf_to_ours,
                          one_torch_thread, sharpen_routers)
from zaya_jax.config import preset
from zaya_jax.data.packing import pack_documents
from zaya_jax.model.layer_stack import INERT_IN_LAYER_0, per_layer
from zaya_jax.model.state import build_model
from zaya_jax.train import balancing
from zaya_jax.train.flat_model import split
from zaya_jax.train.step import BATCH_KEYS, StepConfig, accumulate_gradients

# Two shapes apart in every axis the gradient crosses: GQA ratio, experts, router width, depth
# (≥ 2 layers so EDA carries router state, and its gradient, between layers), conv kernels, RoPE
# width, and a vocabulary chunk that leaves a padded last chunk in the loss's custom backward.
CONFIGS = {
    "g2_e4": dict(model=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                             router_hidden_size=16, num_hidden_layers=2, cca_time0=2, cca_time1=2),
                  vocab_chunk=16384, micro_batches=1, seed=0),
    "g4_e3": dict(model=dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=3,
                             router_hidden_size=24, num_hidden_layers=3, moe_intermediate_size=48,
                             cca_time0=3, cca_time1=4, partial_rotary_factor=1.0),
                  vocab_chunk=96, micro_batches=2, seed=3),
}
SEQ_LEN = 24
DOC_LENGTHS = (5, 17, 3, 30, 9, 11, 2)  # 30 > SEQ_LEN: a document continues into the next row
# fp32 on both sides, but different summation orders (grouped vs per-expert matmuls, chunked vs
# full softmax, scans, torch's per-piece sums): per tensor, max|Δ| measures ≤ 2e-6 of the tensor's
# largest entry. 1e-4 is 50× that, and still 10× below a gradient scaled by 1.001 (the test fails
# if one is planted), let alone a wrong mask or routing detail (percents). Relative to the largest entry,
# not elementwise: entries near zero carry only absolute rounding.
GRAD_TOL = 1e-4
LOSS_TOL = 1e-5  # the mean token loss agrees to ~2e-7 relative
ROUTER_SHARPNESS = 3.0  # see hf_reference.sharpen_routers: every expert of every layer gets tokens
# Top-1 routing is discontinuous: a token whose two best biased probabilities lie within rounding
# of each other could pick different experts on the two sides and fail the test for no bug. fp32
# probabilities differ by ~1e-7 between the sides; demand a margin far above that.
MIN_ROUTING_MARGIN = 1e-4


def packed_batch(cfg, seed: int) -> dict[str, np.ndarray]:
    """Random documents packed as training packs them; eos the last id, padding `pad_token_id`.

    Documents never hold the pad id: HF's `nn.Embedding(padding_idx=pad_token_id)` drops the
    lookup gradient of that row (ours keeps it), so a document token equal to the pad id would
    move the embedding gradient's row 0 by the token's whole lookup gradient. Real data holds no
    pad tokens inside documents, and padding (segment 0) reaches no loss on either side.
    """
    rng = np.random.RandomState(100 + seed)
    eos, pad = cfg.vocab_size - 1, cfg.pad_token_id
    ids = np.setdiff1d(np.arange(cfg.vocab_size), [eos, pad])
    docs = [rng.choice(ids, n) for n in DOC_LENGTHS]
    rows = pack_documents(docs, SEQ_LEN, eos_id=eos, pad_id=pad).as_dict()
    if rows["inputs"].shape[0] % 2:  # an even row count, so two micro-batches split it
        rows = {k: np.concatenate([v, np.zeros_like(v[:1])]) for k, v in rows.items()}
    return rows


def our_loss_and_grads(cfg, arrays, batch, vocab_chunk: int, micro_batches: int):
    """The train step's gradient path: summed over micro-batches, then divided by the loss tokens."""
    modeldef, params, biases = split(build_model(cfg, arrays))
    step_cfg = StepConfig(vocab_chunk=vocab_chunk)
    batches = {k: jnp.asarray(batch[k]).reshape(micro_batches, -1, batch[k].shape[-1]) for k in BATCH_KEYS}
    accumulate = jax.jit(functools.partial(accumulate_gradients, modeldef, cfg=step_cfg))
    grads, loss_sum, ntok, routes = accumulate(params, biases, batches)
    denom = jnp.maximum(ntok, 1.0)  # as train_step
    grads = {k: np.asarray(g / denom) for k, g in grads.items()}
    return float(loss_sum / denom), grads, np.asarray(routes), modeldef, biases


def assert_grads_close(ours: dict, ref: dict, tol: float = GRAD_TOL) -> dict[str, float]:
    """Every tensor within tol × its reference's largest entry; returns each one's relative error."""
    rel, bad = {}, []
    for key in sorted(ref):
        assert ours[key].shape == ref[key].shape, f"{key}: shape {ours[key].shape} vs {ref[key].shape}"
        scale = float(np.abs(ref[key]).max())
        assert scale > 0, f"{key}: HF gradient is all zeros (the test would not see it)"
        rel[key] = float(np.abs(ours[key] - ref[key]).max()) / scale
        if rel[key] > tol:
            bad.append(f"{key}: max|Δ|/max|g_ref| = {rel[key]:.3g}")
    assert not bad, f"{len(bad)} of {len(ref)} gradients differ from HF (tol {tol}):\n" + "\n".join(bad)
    return rel


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_and_gradients_match_hf(name):
    """Same weights, same packed batch: our training loss and all its parameter gradients are HF's."""
    spec = CONFIGS[name]
    cfg = preset("tiny", compute_dtype="float32", **spec["model"])
    hf = sharpen_routers(hf_model(cfg, spec["seed"]), ROUTER_SHARPNESS)
    arrays = hf_to_ours(cfg, hf_state(hf).__getitem__)
    batch = packed_batch(cfg, spec["seed"])
    segments, mask = batch["segment_ids"], batch["loss_mask"]
    # The batch must hold what the conventions are about: several documents in a row, padding,
    # masked targets (eos → next document, padding), and a row whose last target continues its
    # document into the next row (restarting there at position 0).
    assert (segments.max(axis=1) >= 2).any() and (segments == 0).any() and (mask == 0).any()
    assert (mask[:-1, -1] == 1).any()

    loss, ours, routes, modeldef, biases = our_loss_and_grads(cfg, arrays, batch, spec["vocab_chunk"],
                                                             spec["micro_batches"])
    # Every class, the skip class (a zero router weight on the token) included, in every layer:
    # otherwise an expert's gradient, or the skip path's, would be zero on both sides and untested.
    counts = routes[:, balancing.TOKENS]
    assert (counts > 0).all(), f"a class is never chosen (layers × classes):\n{counts}"

    hf.zero_grad()
    with one_torch_thread(), hf_router_records(hf) as routed:
        ref_loss = hf_packed_loss(hf, batch)
        ref_loss.backward()
    for layer, calls in enumerate(routed):
        biased = np.concatenate(calls)
        top2 = np.sort(biased, axis=-1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
        assert margin > MIN_ROUTING_MARGIN, f"layer {layer}: a routing choice is {margin:.2g} from a tie"
        # HF routes with the skip class and with choices the biases changed, in every layer.
        chosen = biased.argmax(-1)
        unbiased = (biased - hf.model.layers[layer].mlp.gate.balancing_biases.numpy()).argmax(-1)
        assert (chosen == cfg.num_experts).any() and (chosen != unbiased).any(), f"layer {layer}"
        # What the balancer reads (`balancing.route_sums`): HF's choices counted, its probabilities
        # summed, over the batch's tokens (each HF piece also runs its last target: dropped here).
        biased = np.concatenate([call[:-1] for call in calls])
        chosen, probs = biased.argmax(-1), biased - hf.model.layers[layer].mlp.gate.balancing_biases.numpy()
        np.testing.assert_array_equal(counts[layer], np.bincount(chosen, minlength=cfg.num_experts + 1))
        np.testing.assert_allclose(routes[layer, balancing.PROB], probs.sum(0), rtol=1e-5)
        np.testing.assert_allclose(routes[layer, balancing.PROB_SQ], (probs ** 2).sum(0), rtol=1e-5)
    ref, skipped = hf_gradients_as_ours(hf, cfg)
    ref_loss = ref_loss.item()
    assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss), f"loss {loss} vs HF {ref_loss}"

    # Balancing biases: HF buffers, our non-trained dict; no gradient on either side.
    buffers, params = dict(hf.named_buffers()), dict(hf.named_parameters())
    assert skipped == tuple(sorted(f"model.layers.{i}.mlp.gate.balancing_biases"
                                   for i in range(cfg.num_hidden_layers)))
    assert all(n in buffers and n not in params and not buffers[n].requires_grad and buffers[n].grad is None
               for n in skipped)
    assert set(biases) == {modeldef.bias_key} and modeldef.bias_key not in ours

    # Layer 0's EDA scale exists only in our stack (inert, no HF tensor): its gradient is exactly 0.
    for rest in INERT_IN_LAYER_0:
        assert not np.any(ours[f"layers/{rest}"][0]), f"layers/{rest}[0] has a gradient"
    ours = per_layer(ours, cfg.layer_kinds)
    assert set(ours) == set(ref), (sorted(set(ours) - set(ref)), sorted(set(ref) - set(ours)))
    rel = assert_grads_close(ours, ref)
    worst = max(rel, key=rel.get)
    print(f"{name}: loss {loss:.6f} vs HF {ref_loss:.6f}; {len(rel)} gradients, "
          f"worst {worst} at {rel[worst]:.2e}")
