"""`zaya train` and HF `ZayaForCausalLM` trained in eager PyTorch follow the same trajectory.

A small run of `benchmarks/trajectory_vs_torch.py` (which has the whole story): the same initial
weights (our `Program.init()` exported through `hf_mapping`), the same token rows, torch's own
Muon / AdamW / LinearLR and CosineAnnealingLR / clip_grad_norm_, the decay table restated for HF
names, the bias balancer written from its equations (`TorchBalancer`) and the labels cut from each
row's tokens at every eos (`stream_pieces`), none of them taken from our code. Torch's Muon runs
its Newton–Schulz in fp32, as ours. The data is many short documents (a few per 64-token row), so
document boundaries, loss-token counts that differ between micro-batches and the eos rule count;
weight decay is on (the tiny_cpu recipe has none) so the decay table counts too.

Cases: one device; a wider one (non-square expert and router matrices, two micro-batches a step,
two data-parallel devices); and our bf16 compute against torch's fp32. Each tolerance is the
agreement reached with margin (8 steps here; 50 in `benchmarks/trajectory_configs.md`); planted bugs each fail it:
eos trained across documents, weight decay on norms, warmup one step off, micro-batches averaged
instead of summed by tokens.
"""

import os
import sys

import jax
import numpy as np
import pytest

from paths import ROOT
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytest.importorskip("torch")  # the torch trainer; absent where no CPU torch wheel exists (Python 3.12 CI)
import trajectory_vs_torch as trajectory

STEPS = 8
SMALL = ["--config.train.global_batch_size=4", "--config.train.seq_len=64", "--config.model.num_hidden_layers=2",
         "--config.train.scan_unroll=1",
         "--config.optim.warmup_steps=2", "--config.optim.weight_decay=0.1", "--config.optim.lr=1e-2"]
# Non-square expert and router matrices, two micro-batches a step, two data-parallel devices.
WIDER = SMALL + ["--config.model.moe_intermediate_size=96", "--config.model.router_hidden_size=24",
                 "--config.train.grad_accum_steps=2", "--config.mesh.data=2"]
BF16 = SMALL + ["--config.model.compute_dtype=bfloat16"]
# (overrides, devices, relative tolerance per step on loss and grad norm)
CASES = {"one-device": (SMALL, 1, 2e-5), "wider": (WIDER, 2, 2e-5), "bf16-vs-fp32": (BF16, 1, 1e-2)}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_trains_like_zaya_train(tmp_path, case):
    from zaya_jax.data.tokenizer import load_tokenizer
    from zaya_jax.train.loop import train

    overrides, devices, tolerance = CASES[case]
    corpus = trajectory.short_documents(str(tmp_path / "docs.jsonl"), 400)
    exp = trajectory.load_exp(trajectory.DEFAULT_CONFIG, STEPS, devices,
                              overrides + [f"--config.data.source={corpus}"])
    # load_exp makes every run fp32; the bf16 case asks for bf16 after it.
    assert exp.model.compute_dtype == ("bfloat16" if case == "bf16-vs-fp32" else "float32")
    devices = jax.devices()[:devices]
    with open(os.devnull, "w") as out:
        train(exp, str(tmp_path / "run"), devices=devices, out=out)
    ours = trajectory.read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))

    params, biases = trajectory.initial_arrays(exp, devices)
    batches = trajectory.step_batches(exp, STEPS)
    eos = load_tokenizer(exp.config.data.tokenizer).eos_id
    boundaries = sum(int((b["inputs"] == eos).sum()) for b in batches) / STEPS
    assert boundaries >= 4 * exp.config.train.global_batch_size  # many documents per row
    theirs = trajectory.train_torch(exp, params, biases, batches, ("float32", "clamp"))
    c = trajectory.compare(ours, theirs)

    assert max(c["lr_abs"]) < 1e-8
    table = "\n".join(f"step {s + 1}: loss {o['loss']:.6f} / {t['loss']:.6f} ({c['loss_rel'][s]:.1e}), grad norm "
                      f"{o['grad_norm']:.5f} / {t['grad_norm']:.5f} ({c['grad_norm_rel'][s]:.1e})"
                      for s, (o, t) in enumerate(zip(ours, theirs)))
    worst = max(c["loss_rel"] + c["grad_norm_rel"])
    assert worst < tolerance, f"ours / torch differ by {worst:.1e} (tolerance {tolerance:g}):\n" + table
    # Both sides route alike: per-layer expert loads within a token or two of each other (bf16
    # moves near-ties).
    tokens = batches[0]["inputs"].size
    assert max(c["load_abs"]) <= (2.0 if tolerance < 1e-3 else 0.25 * tokens) / tokens + 1e-9, table
    assert np.isfinite([r["loss"] for r in theirs]).all()
    # Last, so a wrong row of our decay table fails on the trajectory first.
    assert not trajectory.recipe_mismatches(exp.model)
