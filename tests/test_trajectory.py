"""`zaya train` and HF `ZayaForCausalLM` trained in eager PyTorch follow the same trajectory.

A small run of `benchmarks/trajectory_vs_torch.py` (which has the whole story): the same initial
weights (our `Program.init()` exported through `hf_mapping`), the same batches (our pipeline),
torch's own Muon / AdamW / LinearLR and CosineAnnealingLR / clip_grad_norm_ and the bias balancer written from its
equations (`TorchBalancer`). Torch's Muon runs with its Newton–Schulz in fp32, as ours (its input / max(‖x‖, eps) is ours too),
so no known difference is left and every step's loss and grad norm must agree to 1e-3; weight
decay is on (the tiny_cpu recipe has none) so the decay mask counts too. A wider case adds
non-square expert and router matrices, two micro-batches a step, two data-parallel devices and
the `solve` balancer.
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


# Non-square expert and router matrices, two micro-batches a step, two data-parallel devices, and
# the balancer that routes the first micro-batch again after the update.
WIDER = SMALL + ["--config.model.moe_intermediate_size=96", "--config.model.router_hidden_size=24",
                 "--config.train.grad_accum_steps=2", "--config.mesh.data=2", "--config.optim.balancer=solve"]


@pytest.mark.parametrize("overrides, devices", [(SMALL, 1), (WIDER, 2)], ids=["one-device", "wider"])
def test_torch_trains_like_zaya_train(tmp_path, overrides, devices):
    from zaya_jax.train.loop import train

    exp = trajectory.load_exp(trajectory.DEFAULT_CONFIG, STEPS, devices, overrides)
    devices = jax.devices()[:devices]
    with open(os.devnull, "w") as out:
        train(exp, str(tmp_path / "run"), devices=devices, out=out)
    ours = trajectory.read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))

    params, biases = trajectory.initial_arrays(exp, devices)
    batches = trajectory.step_batches(exp, STEPS)
    theirs = trajectory.train_torch(exp.model, params, biases, exp.config.optim, batches, ("float32", "clamp"),
                                    micro_batches=exp.config.train.grad_accum_steps)
    c = trajectory.compare(ours, theirs)

    assert not trajectory.recipe_mismatches(exp.model)
    # Step 1 runs the initial weights on the first batch: the same to fp32 rounding.
    assert c["loss_rel"][0] < 1e-5 and c["grad_norm_rel"][0] < 1e-5, (c["loss_rel"][0], c["grad_norm_rel"][0])
    assert max(c["lr_abs"]) < 1e-8
    table = "\n".join(f"step {s + 1}: loss {o['loss']:.6f} / {t['loss']:.6f} ({c['loss_rel'][s]:.1e}), grad norm "
                      f"{o['grad_norm']:.5f} / {t['grad_norm']:.5f} ({c['grad_norm_rel'][s]:.1e})"
                      for s, (o, t) in enumerate(zip(ours, theirs)))
    assert c["first_divergent_step"] is None, "ours / torch differ by more than 1e-3:\n" + table
    # Both sides route alike: per-layer expert loads within a token or two of each other.
    tokens = batches[0]["inputs"].size
    assert max(c["load_abs"]) <= 2.0 / tokens + 1e-9, (max(c["load_abs"]), table)
    assert np.isfinite([r["loss"] for r in theirs]).all()
