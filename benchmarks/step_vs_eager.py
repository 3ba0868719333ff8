"""Our compiled train step against eager PyTorch (HF transformers' ZayaForCausalLM), side by side.

At the `tiny_cpu` shapes (16 x 128 tokens, the same model), in one process on this machine:

- **eager PyTorch**: `ZayaForCausalLM` built from our config (`config.to_hf_dict`), trained with
  `torch.optim.AdamW` (loss, backward, step); the same with our optimizer written in eager torch
  (`EagerMuon` on the weights our optimizer gives Muon, AdamW on the rest), the like-for-like
  row; and its forward + backward alone;
- **our step**: the jitted train step `zaya train` runs (Muon + AdamW, bias balancer, bad-step
  guard), and its forward + backward alone (`accumulate_gradients`), so the optimizers'
  share of each side shows;
- **`zaya train`**: the whole command in a child process (data pipeline, metrics, progress),
  its steady-state tokens/s read from `metrics.jsonl`.

Both frameworks use every core of the machine: PyTorch's intra-op pool, and our step as `zaya
train` runs `tiny_cpu` (`zaya_jax/cpu_host.py`: one XLA device per core, data-parallel, with
freed memory kept between steps; the process is set up so before either framework starts). The
timed rounds alternate between them so that drift in the machine's speed hits both alike; each
row is the median over rounds of the tokens/s of `--steps` steps.

    python benchmarks/step_vs_eager.py --out=benchmarks/step_vs_eager.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "tiny_cpu.py")


# Each of our rows against the eager row doing the same work (the same optimizer math, or none).
SAME_WORK = {"zaya-jax: train step (Muon + AdamW)": "eager PyTorch: Muon + AdamW step",
             "zaya-jax: forward + backward": "eager PyTorch: forward + backward",
             "zaya train (steady state)": "eager PyTorch: Muon + AdamW step"}


def _timed(run_steps, steps: int, tokens: int) -> float:
    start = time.perf_counter()
    run_steps(steps)
    return steps * tokens / (time.perf_counter() - start)


# HF names of the weights our optimizer (`train/optim.PARTITION`) gives Muon; the rest get AdamW.
MUON_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj_current.weight", "v_proj_delayed.weight",
                 "o_proj.weight", "gate.down_proj.weight", "fc1.weight", "fc2.weight", "out_proj.weight",
                 "experts.gate_up_proj", "experts.down_proj")


class EagerMuon:
    """Our Muon (`train/muon.py`) in eager PyTorch, for the like-for-like row: momentum with
    Nesterov, quintic Newton–Schulz on each matrix (gate and up apart, as ours), the update scaled
    to RMS `muon_rms`, decoupled weight decay, at the peak learning rate."""

    def __init__(self, named_params, c):
        import torch

        self.params = [(name, p) for name, p in named_params]
        self.momentum = [torch.zeros_like(p) for _, p in self.params]
        self.c = c

    def step(self):
        import torch

        c = self.c
        with torch.no_grad():
            for (name, p), buf in zip(self.params, self.momentum):
                buf.mul_(c.muon_momentum).add_(p.grad, alpha=1 - c.muon_momentum)
                d = p.grad * (1 - c.muon_momentum) + buf * c.muon_momentum if c.muon_nesterov else buf
                mats = d.unflatten(-2, (2, -1)) if name.endswith("gate_up_proj") else d  # [E, 2, I, H]
                scale = c.muon_rms * max(mats.shape[-2], mats.shape[-1]) ** 0.5
                update = _newton_schulz(mats, c.muon_ns_steps).reshape(p.shape) * scale
                p.add_(update + c.weight_decay * p, alpha=-c.lr)


def _newton_schulz(g, steps: int):
    """`train/muon.newton_schulz` in torch (same coefficients, same normalisation)."""
    import torch

    from zaya_jax.train.muon import NS_COEFFICIENTS

    a, b, c = NS_COEFFICIENTS
    wide = g.shape[-2] <= g.shape[-1]
    x = g if wide else g.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.mT


def torch_runners(exp, batch):
    """(AdamW step, Muon + AdamW step, forward + backward) closures over an HF model, and its
    attention implementation."""
    import torch
    from transformers import ZayaConfig, ZayaForCausalLM

    from zaya_jax.config import to_hf_dict

    torch.manual_seed(0)
    hf = {k: v for k, v in to_hf_dict(exp.model).items() if k not in ("architectures", "model_type")}
    model = ZayaForCausalLM(ZayaConfig(**hf)).train()
    c = exp.config.optim

    def adamw(params):
        return torch.optim.AdamW(params, lr=c.lr, betas=(c.b1, c.b2), eps=c.eps, weight_decay=c.weight_decay)

    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if n.endswith(MUON_SUFFIXES)]
    muon_names = {n for n, _ in muon}
    optimizers = {"adamw": [adamw(model.parameters())],
                  "muon": [EagerMuon(muon, c), adamw([p for n, p in named if n not in muon_names])]}
    ids = torch.from_numpy(batch["inputs"]).long()
    labels = torch.from_numpy(batch["targets"]).long()

    def grads():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        return loss

    def full(which):
        def run(steps):
            for _ in range(steps):
                loss = grads()
                torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip_norm)
                for opt in optimizers[which]:
                    opt.step()
            loss.item()
        return run

    def forward_backward(steps):
        for _ in range(steps):
            loss = grads()
        loss.item()

    return full("adamw"), full("muon"), forward_backward, model.config._attn_implementation


def jax_runners(exp, batch):
    """(full step, forward + backward) closures over the program `zaya train` builds."""
    import functools

    import jax
    import numpy as np

    from zaya_jax.train.program import build_program
    from zaya_jax.train.step import accumulate_gradients

    program = build_program(exp)
    state = {"s": program.init()}
    placed = program.place_batch({k: np.asarray(v) for k, v in batch.items()})
    step = program.jitted_train_step()
    accumulate = jax.jit(program._under_mesh(functools.partial(accumulate_gradients, program.modeldef,
                                                               cfg=program.step_cfg)))

    def full(steps):
        for _ in range(steps):
            state["s"], metrics = step(state["s"], placed)
        jax.block_until_ready(metrics)

    def forward_backward(steps):
        for _ in range(steps):
            out = accumulate(state["s"].params, state["s"].biases, placed)
        jax.block_until_ready(out)

    return full, forward_backward


def batch_for(exp):
    """One random [16, 128] batch of token ids (the loss and speed do not depend on the text)."""
    import numpy as np

    c = exp.config
    rng = np.random.default_rng(0)
    shape = (c.train.global_batch_size, c.train.seq_len + 1)
    tokens = rng.integers(3, c.model.vocab_size, size=shape)
    rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    rows["segment_ids"] = np.ones(rows["inputs"].shape, np.int32)
    rows["positions"] = np.broadcast_to(np.arange(c.train.seq_len), rows["inputs"].shape).copy()
    rows["loss_mask"] = np.ones(rows["inputs"].shape, np.float32)
    return {k: v.astype(np.float32 if k == "loss_mask" else np.int32) for k, v in rows.items()}


def zaya_train_tps(steps: int) -> float:
    """`zaya train`'s steady-state tokens/s: the median log window after the first, from metrics.jsonl."""
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "zaya_jax", "train", f"--config={CONFIG}", f"--workdir={work}/run",
                        f"--config.train.steps={steps}", "--config.eval.every_steps=0", "--config.eval.batches=1",
                        "--config.checkpoint.every_steps=0", "--config.train.progress=false"],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(os.path.join(work, "run", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    windows = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][1:]
    return statistics.median(windows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per row")
    parser.add_argument("--train-steps", type=int, default=150, help="steps of the `zaya train` run")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args(argv)

    from zaya_jax import cpu_host
    from zaya_jax.experiment.load import load_values

    # The host as `zaya train` sets it up before JAX starts: freed memory kept, the cores as devices.
    cpu_host.prepare(load_values(CONFIG, [])[0]["train.cpu_devices"])

    import jax
    import torch

    from zaya_jax.experiment import load_experiment

    exp = load_experiment(CONFIG, [])
    batch = batch_for(exp)
    tokens = batch["inputs"].size
    t_adamw, t_muon, t_fb, attn = torch_runners(exp, batch)
    j_full, j_fb = jax_runners(exp, batch)
    runners = {"eager PyTorch: AdamW step": t_adamw, "eager PyTorch: Muon + AdamW step": t_muon,
               "eager PyTorch: forward + backward": t_fb,
               "zaya-jax: train step (Muon + AdamW)": j_full, "zaya-jax: forward + backward": j_fb}
    for run in runners.values():  # compile / warm up
        run(3)
    rounds = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            rounds[name].append(_timed(run, args.steps, tokens))
    rows = {name: statistics.median(v) for name, v in rounds.items()}
    rows["zaya train (steady state)"] = zaya_train_tps(args.train_steps)

    base = rows["eager PyTorch: AdamW step"]
    same = {name: rows[twin] for name, twin in SAME_WORK.items()}
    print(f"tiny_cpu, {tokens} tokens per step; torch {torch.__version__} ({attn} attention, "
          f"{torch.get_num_threads()} threads), jax {jax.__version__} ({jax.device_count()} CPU device(s), "
          f"freed memory {'kept' if cpu_host.applied() else 'returned'}); {os.cpu_count()} cores")
    print(f"{'':40s} {'tokens/s':>10s} {'vs eager AdamW step':>20s} {'vs eager, same work':>20s}")
    for name, tps in rows.items():
        twin = f"{tps / same[name]:19.2f}x" if name in same else ""
        print(f"{name:40s} {tps:10.0f} {tps / base:19.2f}x {twin}")
    bare = rows["zaya-jax: train step (Muon + AdamW)"]
    print(f"zaya train / bare step: {rows['zaya train (steady state)'] / bare:.3f}")
    if args.out:
        record = {"config": "experiments/tiny_cpu.py", "tokens_per_step": tokens, "steps_per_round": args.steps,
                  "rounds": args.rounds, "torch": torch.__version__, "attention": attn, "jax": jax.__version__,
                  "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                  "jax_cpu_devices": jax.device_count(), "freed_memory_kept": cpu_host.applied(),
                  "tokens_per_sec": rows, "rounds_tokens_per_sec": rounds,
                  "vs_eager_same_work": {name: rows[name] / tps for name, tps in same.items()}}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
