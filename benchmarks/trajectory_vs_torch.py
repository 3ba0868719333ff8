"""`zaya train` against HF `ZayaForCausalLM` trained in eager PyTorch: the same start, the same
batches, the same recipe, compared step by step.

1. **Ours**: `zaya train` on an experiment (default `experiments/tiny_cpu.py`; fp32 unless
   `--config.model.compute_dtype=bfloat16`, torch staying fp32) for `--steps`
   steps, every step logged; its per-step `loss`, `grad_norm`, `lr` and `expert_load` are read from
   `WORKDIR/metrics.jsonl`.
2. **The same start**: the initial state `zaya train` builds (`Program.init()`: the params and
   balancing biases of `flat_model.init_arrays(cfg, train.seed)`, placed on the run's devices),
   exported to a `ZayaForCausalLM` through our HF mapping (`checkpoint/hf_mapping.py`, the
   tables `zaya convert to-hf` uses), balancing biases included.
3. **The same tokens**: the data pipeline is deterministic from the config (`train/loop.py::
   build_data`), so the rows of steps 1..N are rebuilt here. The torch side takes only their
   tokens: `stream_pieces`, written apart from our packer, cuts each row at every eos into
   sequences and labels them (−100 after an eos). Step 1's loss (no update yet) must agree to
   fp32 rounding: that checks weights, tokens and labels at once. `--short-documents=N` trains
   both sides on N documents of 2-19 characters (about five to a 64-token row) instead.
4. **Torch**: the HF model trained in eager PyTorch, fp32, with torch's optimizers and nothing of
   our optimizer code: `torch.optim.Muon(adjust_lr_fn="match_rms_adamw")` on the hidden 2-D
   matrices (every expert's gate, up and down as its own 2-D leaf), `torch.optim.AdamW` on the
   rest, the recipe's weight-decay mask (`HF_RECIPE`, the table `train/optim.py::PARTITION`
   restated for HF names), warmup and cosine from torch's `LinearLR` and `CosineAnnealingLR`, `clip_grad_norm_`, HF's own loss
   (on item 3's labels, `num_items_in_batch` = the labelled tokens of the step), and
   ZAYA1's bias balancer written from its equations (`TorchBalancer`). Torch's Muon differs
   from ours in its Newton–Schulz in one way: bfloat16 (ours fp32); a further torch run
   (`VARIANTS`, `--variants`) patches it to fp32, to measure what that costs. (Both normalise the
   input by max(‖x‖, eps); adding eps instead, Keller Jordan's form, shrinks the router's small
   updates by up to 4%.)
5. **Side by side**: relative loss and grad-norm differences per step, per-layer expert load on
   both sides; a table (every 5th step and the worst differences), all numbers as JSON, and a plot
   of the loss curves.

    python benchmarks/trajectory_vs_torch.py                 # tiny_cpu, 50 steps (~2-4 min on 2 cores)
    python benchmarks/trajectory_vs_torch.py --steps=20 --cpu-devices=2 --config.optim.weight_decay=0.1
    python benchmarks/trajectory_vs_torch.py --from-json=benchmarks/trajectory_vs_torch.json --notes=NOTES.md
    python benchmarks/trajectory_vs_torch.py --summary=A.json,B.json --out=benchmarks/trajectory_configs

Writes benchmarks/trajectory_vs_torch.{md,json,png} (`--out` changes the stem).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "experiments", "tiny_cpu.py")
# Every step logged, fp32, nothing but the steps (no held-out loss, no mid-run saves).
RUN_OVERRIDES = ("--config.train.log_every=1", "--config.train.progress=false", "--config.eval.batches=0",
                 "--config.checkpoint.every_steps=0", "--config.model.compute_dtype=float32")
TOLERANCE = 1e-3  # relative, per step: loss and grad norm
ROUTING_SPLIT = 0.25  # a layer's expert load this far from ours: the two sides route apart

# ---- the recipe, restated for HF names ------------------------------------------------------
# `zaya_jax/train/optim.py::PARTITION` written out for `ZayaForCausalLM` parameter names (after
# `split_experts`), on purpose not looked up through our table, so a wrong entry there shows as a
# trajectory difference. (`recipe_mismatches` below still reports where the two tables differ.)
# First match wins: (name suffix, optimizer, weight decay).
HF_RECIPE = (
    ("q_proj.weight", "muon", True), ("k_proj.weight", "muon", True),
    ("v_proj_current.weight", "muon", True), ("v_proj_delayed.weight", "muon", True),
    ("o_proj.weight", "muon", True),
    ("mlp.gate.down_proj.weight", "muon", True),  # the router's down projection
    ("router_mlp.fc1.weight", "muon", True), ("router_mlp.fc2.weight", "muon", True),
    ("router_mlp.out_proj.weight", "muon", True),
    ("experts.gate", "muon", True), ("experts.up", "muon", True), ("experts.down", "muon", True),  # per expert
    ("embed_tokens.weight", "adamw", True),  # = the tied LM head
    ("conv_qk_depthwise.weight", "adamw", True), ("conv_qk_grouped.weight", "adamw", True),
    # No decay: biases, norm weights, residual scales/biases, the input affine, EDA scales, temperatures.
    ("bias", "adamw", False), ("norm.weight", "adamw", False), ("layernorm.weight", "adamw", False),
    ("_scale", "adamw", False), ("qk_norm.temp", "adamw", False),
)


def hf_rule(name: str) -> tuple[str, bool]:
    """(optimizer, decay) of an HF parameter name (after `split_experts`)."""
    leaf = name.rsplit(".", 1)
    for suffix, optimizer, decay in HF_RECIPE:
        # Per-expert leaves are "...experts.gate.3": match them by their list's name.
        if name.endswith(suffix) or (leaf[-1].isdigit() and leaf[0].endswith(suffix)):
            return optimizer, decay
    raise KeyError(f"{name} has no rule in HF_RECIPE")


def recipe_mismatches(cfg) -> list[str]:
    """Where HF_RECIPE and our PARTITION (through hf_mapping's name pairs) disagree."""
    from zaya_jax.checkpoint import hf_mapping
    from zaya_jax.train.optim import rule_for

    out = []
    for rule in hf_mapping.rules(cfg):
        if rule.hf[0].endswith("balancing_biases"):
            continue
        for ours in rule.ours:
            hf = rule.hf[0]
            if hf.endswith("experts.gate_up_proj"):
                hf = hf.replace("gate_up_proj", "gate.0" if ours.endswith("/gate") else "up.0")
            elif hf.endswith("experts.down_proj"):
                hf = hf.replace("down_proj", "down.0")
            theirs, mine = hf_rule(hf), (rule_for(ours).optimizer, rule_for(ours).decay)
            if theirs != mine:
                out.append(f"{hf}: HF_RECIPE {theirs}, PARTITION ({ours}) {mine}")
    return out


# ---- the schedule, from torch's own schedulers ---------------------------------------------
def torch_schedule(optimizer, optim, total_steps: int):
    """Linear warmup from 0 to optim.lr, then cosine to optim.min_lr at the schedule's end
    (optim.decay_steps, or the run's steps), as torch's `LinearLR` then `CosineAnnealingLR` in a
    `SequentialLR`; a warmup as long as the schedule is cut to a tenth. `LinearLR` cannot start at
    0: it starts at 1e-12 of the rate."""
    import torch

    sched = torch.optim.lr_scheduler
    length = optim.decay_steps or total_steps
    warmup = optim.warmup_steps if optim.warmup_steps < length else length // 10
    cosine = sched.CosineAnnealingLR(optimizer, T_max=max(length - warmup, 1), eta_min=optim.min_lr)
    if warmup == 0:
        return cosine
    linear = sched.LinearLR(optimizer, start_factor=1e-12, end_factor=1.0, total_iters=warmup)
    return sched.SequentialLR(optimizer, [linear, cosine], milestones=[warmup])


# ---- ZAYA1's bias balancer, written from the equations ----------------------------------------
class TorchBalancer:
    """The controller of the balancing biases, `optim.balancer`, applied after the optimizer step
    from the step's choices and router probabilities (its valid tokens). Per layer, with
    load_e the share of tokens routed to class e and over_e = E·load_e − 1 (0 for the skip class):
    - "spread": bias_e −= balance_lr · min(σ_e, 1/(4(E+1))) · over_e + Δp̄_e, with p̄_e and σ_e the mean
      and standard deviation over the step's tokens of the router probability of e, and Δp̄_e the change of p̄_e
      since the previous step, minus its mean over the experts (none at the first step, none for
      the skip class); balance_lr 0: no balancing;
    - "adam": torch.optim.Adam fed over_e / (E + 1) as the gradient of the biases (the report's words);
    - "solve" (`solve`): on the probabilities of the step's first micro-batch routed again by the
      updated model, 8 times: each expert e with n_e tokens against the experts' mean n̄ moves by
      balance_lr × (down by the lead over the runner-up that its (n_e − n̄)-th nearest token has, or
      up by the gap to e of the (n̄ − n_e)-th nearest other token), the moves centred over the
      experts; a lead or gap read from the token counts at 32 log-spaced edges 1e-5 .. 1, linear
      between edges (from 0 below the first), 1 where too few tokens are that near.
    Written from the description in zaya_jax/train/balancing.py, not from its code."""


    def __init__(self, optim, routers):
        import torch

        from zaya_jax.experiment.schema import balance_lr

        self.kind, self.gain, self.routers, self.previous = optim.balancer, balance_lr(optim), routers, None
        self.reroutes = self.kind == "solve"
        if self.kind == "adam":
            self.adam = torch.optim.Adam([r.balancing_biases for r in routers], lr=self.gain,
                                         betas=(optim.balance_b1, optim.balance_b2))

    def solve(self, probs) -> None:
        """probs: per layer, the re-routed tokens' probabilities [T, E+1] (float64)."""
        import numpy as np
        import torch

        if self.gain == 0:
            return
        edges = np.geomspace(1e-5, 1.0, 32)

        def nearest(distances, wanted):  # the step that moves `wanted` of these tokens
            within = np.array([(distances <= edge).sum() for edge in edges], np.float64)
            k = int(np.searchsorted(within, wanted, side="left"))  # the first edge holding `wanted`
            if k == len(edges):
                return edges[-1]
            low_edge, low = (0.0, 0.0) if k == 0 else (edges[k - 1], within[k - 1])
            share = min(max((wanted - low) / max(within[k] - low, 1e-9), 0.0), 1.0)
            return low_edge + share * (edges[k] - low_edge)

        for router, p in zip(self.routers, probs):
            b = router.balancing_biases.detach().double().numpy().astype(np.float32).astype(np.float64)
            experts = p.shape[1] - 1
            for _ in range(8):
                score = (p.astype(np.float32) + b.astype(np.float32)).astype(np.float64)
                choice = score.argmax(1)
                counts = np.bincount(choice, minlength=experts + 1)[:experts].astype(np.float64)
                best = score.max(1)
                moves = np.zeros(experts)
                for e in range(experts):
                    excess = counts[e] - counts.mean()
                    mine = choice == e
                    if excess > 0:
                        runner_up = np.delete(score[mine], e, axis=1).max(1)
                        moves[e] = -nearest(best[mine] - runner_up, excess)
                    elif excess < 0:
                        moves[e] = nearest(best[~mine] - score[~mine, e], -excess)
                b[:experts] += self.gain * (moves - moves.mean())
            with torch.no_grad():
                router.balancing_biases.copy_(torch.as_tensor(b, dtype=torch.float32))

    def step(self, counts, probs) -> None:
        """counts [L, E+1] tokens per class; probs: per layer, the tokens' probabilities [T, E+1] (float64)."""
        import numpy as np
        import torch

        num_experts = counts.shape[1] - 1
        over = num_experts * counts / np.maximum(counts.sum(-1, keepdims=True), 1.0) - 1.0
        over[:, -1] = 0.0
        if self.kind == "adam":
            for router, layer_over in zip(self.routers, over):
                router.balancing_biases.grad = torch.as_tensor(layer_over / (num_experts + 1), dtype=torch.float32)
            self.adam.step()
            self.adam.zero_grad(set_to_none=True)
            return
        if self.gain == 0:
            return
        mean = np.stack([p.mean(0) for p in probs])
        sigma = np.minimum(np.stack([p.std(0) for p in probs]), 0.25 / (num_experts + 1))
        step = self.gain * sigma * over
        if self.previous is not None:
            drift = mean[:, :-1] - self.previous[:, :-1]
            step[:, :-1] += drift - drift.mean(-1, keepdims=True)
        self.previous = mean
        with torch.no_grad():
            for router, layer_step in zip(self.routers, step):
                router.balancing_biases -= torch.as_tensor(layer_step, dtype=torch.float32)


# ---- Newton–Schulz of torch.optim.Muon: as shipped, or patched for diagnosis -----------------
def zeropower(dtype: str, normalise: str):
    """torch.optim._muon._zeropower_via_newtonschulz with its two differences from ours made
    choices: the dtype of the iterations (torch: "bfloat16"; ours "float32") and how the input
    is normalised (torch and ours: x / max(‖x‖, eps), "clamp"; Keller Jordan's reference:
    x / (‖x‖ + eps), "add"). Everything else is torch's code."""
    import torch

    def ns(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.to(getattr(torch, dtype), copy=True)
        if grad.size(0) > grad.size(1):
            x = x.T
        x.div_(x.norm().clamp(min=eps) if normalise == "clamp" else x.norm() + eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    return ns


@contextlib.contextmanager
def muon_newton_schulz(dtype: str, normalise: str):
    """torch.optim.Muon as shipped (bfloat16, clamp) or with `zeropower(dtype, normalise)` patched in."""
    from torch.optim import _muon

    if (dtype, normalise) == ("bfloat16", "clamp"):
        yield
        return
    stock = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = zeropower(dtype, normalise)
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = stock


# ---- our side ------------------------------------------------------------------------------
def load_exp(config: str, steps: int, cpu_devices: int, overrides=()):
    from zaya_jax.experiment import load_experiment

    return load_experiment(config, [*RUN_OVERRIDES, f"--config.train.steps={steps}",
                                    f"--config.train.cpu_devices={cpu_devices}", *overrides])


def run_ours_subprocess(config: str, steps: int, cpu_devices: int, overrides, workdir: str) -> float:
    """`zaya train` in a child process; returns its wall seconds."""
    start = time.perf_counter()
    args = [sys.executable, "-m", "zaya_jax", "train", f"--config={config}", f"--workdir={workdir}",
            *RUN_OVERRIDES, f"--config.train.steps={steps}", f"--config.train.cpu_devices={cpu_devices}", *overrides]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"zaya train failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


def read_metrics(workdir: str) -> list[dict]:
    """The per-step training records of metrics.jsonl, by step."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = {r["step"]: r for r in records if "loss" in r}
    return [steps[s] for s in sorted(steps)]


def short_documents(path: str, count: int, seed: int = 0) -> str:
    """A JSONL corpus of `count` documents of 2-19 characters: about five to a 64-token row, so
    document boundaries, the eos rule and loss-token counts that differ between micro-batches count."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz     .,"))
    with open(path, "w", encoding="utf-8") as f:
        for n in rng.integers(2, 20, count):
            f.write(json.dumps({"text": "".join(rng.choice(letters, n))}) + "\n")
    return path


def initial_arrays(exp, devices=None) -> tuple[dict, dict]:
    """The params and balancing biases `zaya train` starts from (its program's `init()`), as numpy."""
    import jax
    import numpy as np

    from zaya_jax.train.program import build_program

    state = build_program(exp, devices).init()
    def host(tree):
        return {k: np.asarray(jax.device_get(v), np.float32) for k, v in tree.items()}

    return host(state.params), host(state.biases)


def step_batches(exp, steps: int) -> list[dict]:
    """The global batches of steps 1..steps, as `zaya train` reads them (all lanes: every row)."""
    from zaya_jax.train.loop import build_data

    iterator = build_data(exp).train_iterator()
    try:
        return [next(iterator) for _ in range(steps)]
    finally:
        iterator.close()


# ---- the HF model from our arrays ------------------------------------------------------------
def hf_model_from(cfg, params: dict, biases: dict):
    """A ZayaForCausalLM (fp32, eager attention) holding our arrays, through hf_mapping."""
    import numpy as np
    import torch
    from transformers import ZayaConfig, ZayaForCausalLM

    from zaya_jax.checkpoint import hf_mapping
    from zaya_jax.config import to_hf_dict
    from zaya_jax.model import layer_stack

    per_layer = layer_stack.per_layer({**params, **biases}, cfg.layer_kinds)
    tensors = {}
    for group in hf_mapping.grouped_rules(cfg).values():
        tensors.update(hf_mapping.convert_group_to_hf(group, per_layer.__getitem__))
    hf_cfg = ZayaConfig(**{k: v for k, v in to_hf_dict(cfg).items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = ZayaForCausalLM(hf_cfg).float().train()
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in hf_mapping.TIED_ALIASES]
    if missing or unexpected:
        raise RuntimeError(f"HF state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("the HF model's LM head is not tied to its embedding")
    return model


def split_experts(experts) -> None:
    """Replace a ZayaExperts' 3-D weights by per-expert 2-D leaves (`gate.e` [I, H], `up.e` [I, H],
    `down.e` [H, I]) that torch.optim.Muon accepts; the HF tensors (`gate_up_proj` [E, 2I, H], gate
    rows first, and `down_proj` [E, H, I]) are rebuilt from them before every forward, so
    gradients reach the leaves."""
    import torch
    from torch import nn

    gate_up, down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    inter = gate_up.shape[1] // 2
    del experts.gate_up_proj, experts.down_proj
    experts.gate = nn.ParameterList([nn.Parameter(w[:inter].clone()) for w in gate_up])
    experts.up = nn.ParameterList([nn.Parameter(w[inter:].clone()) for w in gate_up])
    experts.down = nn.ParameterList([nn.Parameter(w.clone()) for w in down])

    def rebuild(module, args):
        module.gate_up_proj = torch.cat([torch.stack(list(module.gate)), torch.stack(list(module.up))], dim=1)
        module.down_proj = torch.stack(list(module.down))

    experts.register_forward_pre_hook(rebuild)


def stream_pieces(batch: dict, eos_id: int, pad_id: int) -> dict[int, tuple]:
    """The torch side's sequences of one global batch, from its tokens alone (written apart from
    `zaya_jax/data/packing.py`: no segment ids, positions or loss mask of ours): each row's stream
    is its inputs and the token after them (the row's last target); a document ends with its eos,
    so the stream is cut after every eos, each piece its own sequence from position 0 (HF's eager
    attention has no segment ids). Labels are the next stream token, −100 after an eos (nothing
    in a document predicts the next one's first token). Grouped by length: {length: (input ids
    [n, length], labels [n, length])}."""
    import numpy as np

    groups: dict[int, list] = {}
    for row, last in zip(batch["inputs"], batch["targets"][:, -1]):
        stream = np.append(row, last)
        if pad_id != eos_id and (stream == pad_id).any():
            raise RuntimeError("a row holds padding: the stream packer reads whole rows of documents only")
        ids, ends = stream[:-1], stream[:-1] == eos_id
        labels = np.where(ends, -100, stream[1:])
        cuts = np.flatnonzero(ends) + 1
        for piece, piece_labels in zip(np.split(ids, cuts), np.split(labels, cuts)):
            if piece.size:
                groups.setdefault(piece.size, []).append((piece, piece_labels))
    return {n: (np.stack([p[0] for p in pieces]), np.stack([p[1] for p in pieces])) for n, pieces in groups.items()}


class TorchTrainer:
    """The HF model trained in eager PyTorch with torch's optimizers (module docstring, item 4)."""

    def __init__(self, model, optim, total_steps: int, tokens: tuple[int, int],
                 newton_schulz: tuple[str, str] = ("bfloat16", "clamp"), micro_batches: int = 1):
        import torch

        if abs(optim.muon_rms - 0.2) > 1e-12:
            raise ValueError(f"torch's match_rms_adamw scales Muon to RMS 0.2; optim.muon_rms is {optim.muon_rms}")
        self.model, self.newton_schulz, self.micro_batches = model, newton_schulz, micro_batches
        self.eos_id, self.pad_id = tokens
        self.layers = list(model.model.layers)
        for layer in self.layers:
            split_experts(layer.mlp.experts)
        self.routers = [layer.mlp.gate for layer in self.layers]
        named = list(model.named_parameters())  # the tied LM head once, as the embedding
        self.params = [p for _, p in named]
        parts = {("muon", True): [], ("adamw", True): [], ("adamw", False): []}
        self.partition = {}
        for name, p in named:
            rule = hf_rule(name)
            parts[rule].append(p)
            self.partition[name] = rule
        for (opt, _), ps in parts.items():
            if opt == "muon" and any(p.ndim != 2 for p in ps):
                raise ValueError("a Muon parameter is not 2-D")
        self.muon = torch.optim.Muon(parts[("muon", True)], lr=optim.lr, weight_decay=optim.weight_decay,
                                     momentum=optim.muon_momentum, nesterov=optim.muon_nesterov,
                                     ns_steps=optim.muon_ns_steps, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([{"params": parts[("adamw", True)], "weight_decay": optim.weight_decay},
                                        {"params": parts[("adamw", False)], "weight_decay": 0.0}],
                                       lr=optim.lr, betas=(optim.b1, optim.b2), eps=optim.eps)
        self.schedules = [torch_schedule(o, optim, total_steps) for o in (self.muon, self.adamw)]
        self.balance = TorchBalancer(optim, self.routers)
        self.clip_norm = optim.clip_norm
        self.num_classes = model.config.num_experts + 1
        self._counts = None
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._count_choices(i))

    def _count_choices(self, layer: int):
        """A hook recording each token's class, as ZayaRouter picks it (before it hides the skip class)."""
        import torch

        def hook(router, args, output):
            if self._counts is None:  # a forward outside `step`
                return
            logits = output[0].detach()
            biased = torch.softmax(logits, dim=-1).float() + router.balancing_biases
            choice = torch.topk(biased, 1, dim=-1).indices[:, 0]  # as ZayaRouter chooses
            top = torch.topk(biased, 2, dim=-1)
            self._counts[layer] += torch.bincount(choice, minlength=self.num_classes).double()
            self._margins[layer].append(top.values[:, 0] - top.values[:, 1])  # how near a tie each choice is
            self._probs[layer].append(biased - router.balancing_biases)

        return hook

    def _reroute(self, batch: dict) -> list:
        """The router probabilities of the step's first micro-batch (its first rows) through the
        updated model, per layer [T, E+1] (float64)."""
        import torch

        rows = batch["inputs"].shape[0] // self.micro_batches
        first = {k: v[:rows] for k, v in batch.items()}
        kept = self._counts, self._margins
        self._counts, self._margins = torch.zeros_like(self._counts), [[] for _ in self.routers]
        self._probs = [[] for _ in self.routers]
        with torch.no_grad():
            for _, (ids, _) in sorted(stream_pieces(first, self.eos_id, self.pad_id).items()):
                self.model(input_ids=torch.from_numpy(ids.astype("int64")))
        self._counts, self._margins = kept
        return [torch.cat(p).double().numpy() for p in self._probs]

    def step(self, batch: dict) -> dict:
        import torch

        # Subnormal floats flushed to zero, on one thread (the flush is per thread): the backward
        # and Newton–Schulz make many (tiny router gradients), which x86 handles ~50x slower
        # (20 s a tiny_cpu step instead of 0.35 s). No value above ~1e-38 changes.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        try:
            return self._step(batch)
        finally:
            torch.set_flush_denormal(False)  # torch's defaults again
            torch.set_num_threads(threads)

    def _step(self, batch: dict) -> dict:
        import numpy as np
        import torch

        groups = stream_pieces(batch, self.eos_id, self.pad_id)
        items = sum(int((labels != -100).sum()) for _, labels in groups.values())
        self._counts = torch.zeros(len(self.routers), self.num_classes, dtype=torch.float64)
        self._margins, self._probs = [[] for _ in self.routers], [[] for _ in self.routers]
        lr = self.adamw.param_groups[0]["lr"]
        loss = 0.0
        for length in sorted(groups):
            ids, labels = (torch.from_numpy(a.astype(np.int64)) for a in groups[length])
            # shift_labels: our targets are already next tokens, one per input (labels is what turns
            # HF's loss on; shift_labels wins over it).
            out = self.model(input_ids=ids, labels=labels, shift_labels=labels, num_items_in_batch=items)
            out.loss.backward()
            loss += float(out.loss.detach())
        if self.clip_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.params]))
        with muon_newton_schulz(*self.newton_schulz):
            self.muon.step()
        self.adamw.step()
        for schedule in self.schedules:
            schedule.step()
        counts = self._counts.numpy().copy()
        probs = [torch.cat(p).double().numpy() for p in self._probs]
        if self.balance.reroutes:
            self.balance.solve(self._reroute(batch))
        else:
            self.balance.step(counts, probs)
        self.model.zero_grad(set_to_none=True)
        load = counts / np.maximum(counts.sum(-1, keepdims=True), 1.0)
        margins = [torch.cat(m).double().numpy() for m in self._margins]
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": items, "expert_load": load.tolist(),
                # Per layer: the median over tokens of (best − second best) biased router score; how much
                # the router probabilities vary between tokens (std over tokens, mean over classes); and
                # the biases after this step's balancing.
                "choice_margin": [float(np.median(m)) for m in margins],
                "prob_spread": [float(p.std(axis=0).mean()) for p in probs],
                "balancing_biases": [r.balancing_biases.tolist() for r in self.routers]}


def train_torch(exp, params, biases, batches, newton_schulz=("bfloat16", "clamp"),
                total_steps: int | None = None) -> list[dict]:
    """The torch side's per-step records, trained from `params`/`biases` on `batches` with the
    experiment's recipe (its tokenizer's eos and pad ids are all it takes of the data config)."""
    from zaya_jax.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(exp.config.data.tokenizer)
    trainer = TorchTrainer(hf_model_from(exp.model, params, biases), exp.config.optim, total_steps or len(batches),
                           (tokenizer.eos_id, tokenizer.pad_id), newton_schulz, exp.config.train.grad_accum_steps)
    return [trainer.step(b) for b in batches]


# ---- comparison -----------------------------------------------------------------------------
def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def compare(ours: list[dict], theirs: list[dict]) -> dict:
    """Per-step relative loss / grad-norm differences (relative to ours), lr differences and the
    largest per-layer expert-load difference, with the worst of each."""
    import numpy as np

    out = {"loss_rel": [], "grad_norm_rel": [], "lr_abs": [], "load_abs": []}
    for o, t in zip(ours, theirs):
        out["loss_rel"].append(rel(t["loss"], o["loss"]))
        out["grad_norm_rel"].append(rel(t["grad_norm"], o["grad_norm"]))
        out["lr_abs"].append(abs(t["lr"] - o["lr"]))
        out["load_abs"].append(float(np.abs(np.asarray(t["expert_load"]) - np.asarray(o["expert_load"])).max()))
    for key in list(out):
        values = out[key]
        worst = int(np.argmax(values))
        out[f"worst_{key}"] = {"value": values[worst], "step": worst + 1}
    out["first_divergent_step"] = next((i + 1 for i, (a, b) in enumerate(zip(out["loss_rel"], out["grad_norm_rel"]))
                                        if a > TOLERANCE or b > TOLERANCE), None)
    # The first step a layer sends a quarter of the tokens elsewhere than ours (with collapsed
    # routing: the whole layer at once), and the worst differences before it.
    split = next((i for i, v in enumerate(out["load_abs"]) if v > ROUTING_SPLIT), len(out["load_abs"]))
    out["routing_split_step"] = split + 1 if split < len(out["load_abs"]) else None
    out["before_split"] = {k: max(out[k][:split], default=0.0) for k in ("loss_rel", "grad_norm_rel")}
    return out


def load_stats(load) -> dict:
    """Busiest expert's share × E (1 = even) and the skip share, averaged over layers like ours."""
    import numpy as np

    load = np.asarray(load, np.float64)
    experts = load[:, :-1] / np.maximum(load[:, :-1].sum(-1, keepdims=True), 1e-12)
    return {"load_max": float(experts.max() * experts.shape[1]), "skip_fraction": float(load[:, -1].mean()),
            "per_layer_max": (experts.max(-1) * experts.shape[1]).round(3).tolist()}


# ---- report ---------------------------------------------------------------------------------
def table_rows(ours, runs: dict, comparisons: dict, every: int = 5) -> list[str]:
    names = list(runs)
    head = "| step | ours loss | " + " | ".join(f"{n} loss | Δrel" for n in names) + " | ours grad norm | " + \
        " | ".join(f"{n} grad norm | Δrel" for n in names) + " | load max ours / " + " / ".join(names) + " |"
    cols = head.count("|") - 1
    lines = [head, "|" + "---:|" * cols]
    steps = sorted({1, *range(every, len(ours) + 1, every), len(ours)})
    for s in steps:
        o = ours[s - 1]
        cells = [str(s), f"{o['loss']:.6f}"]
        cells += [f"{runs[n][s - 1]['loss']:.6f} | {comparisons[n]['loss_rel'][s - 1]:.1e}" for n in names]
        cells.append(f"{o['grad_norm']:.5f}")
        cells += [f"{runs[n][s - 1]['grad_norm']:.5f} | {comparisons[n]['grad_norm_rel'][s - 1]:.1e}" for n in names]
        loads = [load_stats(o["expert_load"])["load_max"]] + \
            [load_stats(runs[n][s - 1]["expert_load"])["load_max"] for n in names]
        cells.append(" / ".join(f"{v:.2f}" for v in loads))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def worst_lines(comparisons: dict) -> list[str]:
    lines = [("| torch run | worst loss Δrel (step) | worst grad norm Δrel (step) | first step over 1e-3 | "
              "first step routed apart | worst loss / grad norm Δrel before it | worst \\|Δlr\\| |"),
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in comparisons.items():
        w = {k: c[f"worst_{k}"] for k in ("loss_rel", "grad_norm_rel", "lr_abs")}
        b = c["before_split"]
        lines.append(f"| {name} | {w['loss_rel']['value']:.2e} ({w['loss_rel']['step']}) | "
                     f"{w['grad_norm_rel']['value']:.2e} ({w['grad_norm_rel']['step']}) | "
                     f"{c['first_divergent_step'] or 'none'} | {c['routing_split_step'] or 'none'} | "
                     f"{b['loss_rel']:.1e} / {b['grad_norm_rel']:.1e} | {w['lr_abs']['value']:.1e} |")
    return lines


def load_lines(ours, runs: dict, headline: str) -> list[str]:
    """Per-layer expert load (fractions over E experts + skip) at a few steps, both sides, with the
    headline torch run's router-probability spread between tokens and its bias range."""
    n = len(ours)
    lines = ["| step | layer | ours | " + " | ".join(runs) + f" | {headline}: prob spread / bias range / median margin |",
             "|---:|---:|---|" + "---|" * len(runs) + "---:|"]
    for s in sorted({1, 2, 3, max(n // 2, 1), n}):
        for layer, load in enumerate(ours[s - 1]["expert_load"]):
            cells = [" ".join(f"{x:.3f}" for x in load)]
            cells += [" ".join(f"{x:.3f}" for x in runs[name][s - 1]["expert_load"][layer]) for name in runs]
            h = runs[headline][s - 1]
            experts = h["balancing_biases"][layer][:-1]
            cells.append(f"{h['prob_spread'][layer]:.1e} / {max(experts) - min(experts):.1e} / "
                         f"{h['choice_margin'][layer]:.1e}")
            lines.append(f"| {s} | {layer} | " + " | ".join(cells) + " |")
    return lines


def plot(path: str, ours, runs: dict, comparisons: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(ours) + 1))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    axes[0].plot(steps, [r["loss"] for r in ours], label="zaya train (JAX)", lw=2.4, color="k", alpha=0.5)
    for name, run in runs.items():
        axes[0].plot(steps, [r["loss"] for r in run], "--", label=f"HF eager PyTorch: {name}")
    axes[0].set(xlabel="step", ylabel="train loss", title="loss")
    axes[0].legend(fontsize=8)
    for name, c in comparisons.items():
        line, = axes[1].semilogy(steps, [max(v, 1e-9) for v in c["grad_norm_rel"]], label=f"grad norm, {name}")
        axes[1].semilogy(steps, [max(v, 1e-9) for v in c["loss_rel"]], ":", color=line.get_color(),
                         label=f"loss, {name}")
        if c["routing_split_step"]:
            axes[1].axvline(c["routing_split_step"], color=line.get_color(), lw=0.8, alpha=0.6)
    axes[1].axhline(TOLERANCE, color="k", lw=0.8)
    split = any(c["routing_split_step"] for c in comparisons.values())
    axes[1].set(xlabel="step" + (" (vertical lines: first step a layer routes apart)" if split else ""),
                ylabel="|torch − ours| / ours", title="relative difference per step (black: 1e-3)")
    axes[1].legend(fontsize=7)
    axes[2].plot(steps, [load_stats(r["expert_load"])["load_max"] for r in ours], label="ours", lw=2.4, color="k",
                 alpha=0.5)
    for name, run in runs.items():
        axes[2].plot(steps, [load_stats(r["expert_load"])["load_max"] for r in run], "--", label=name)
    axes[2].set(xlabel="step", ylabel="busiest expert's share × E (1 = even)", title="expert load, max over layers")
    axes[2].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(record: dict) -> str:
    c, ours, runs, comparisons = record, record["ours"], record["torch_runs"], record["comparisons"]
    head = c["headline"]
    hc = comparisons[head]
    lines = [
        f"# `zaya train` against HF `ZayaForCausalLM` in eager PyTorch: {c['steps']}-step trajectories",
        "",
        f"`{c['command']}` ({c['runtime_sec']['total']:.0f} s on this {c['cpu_count']}-core host: `zaya train` "
        f"{c['runtime_sec']['ours']:.0f} s, " + ", ".join(f"torch run {n} {c['runtime_sec'][n]:.0f} s" for n in runs)
        + "). The tests' small version: `tests/test_trajectory.py`.",
        "",
        (f"Experiment `{os.path.relpath(c['config'], ROOT)}` with {' '.join(c['overrides']) or 'no overrides'}: "
         f"{c['model']}; {c['tokens_per_step']} tokens per step ({c['global_batch_size']} × {c['seq_len']}), "
         f"{c.get('compute_dtype', 'float32')} compute (torch: float32), "
         f"{c['steps']} steps, `train.cpu_devices={c['cpu_devices']}`. Optimizer: {c['optim']}."),
        "",
        "Both sides start from the same weights (our `Program.init()`, exported through `hf_mapping`) and see "
        "the same batches (our data pipeline, rebuilt from the config). Torch: `torch.optim.Muon` "
        "(`match_rms_adamw`, Nesterov) on the 2-D hidden matrices (each expert's gate, up and down apart), "
        "`torch.optim.AdamW` on the rest, the decay mask of `HF_RECIPE` (our `PARTITION` restated for HF names"
        + (", which agrees with ours" if not c["recipe_mismatches"] else ", which DISAGREES with ours: see below")
        + "), `LinearLR` warmup then `CosineAnnealingLR`, `clip_grad_norm_`, HF's loss on labels cut from each row's tokens at every eos (`stream_pieces`), and the bias balancer "
        "(`TorchBalancer`, `optim.balancer` written from its equations, on the router probabilities HF computed). Torch runs: "
        + "; ".join(f"**{n}** = {d}" for n, d in c["variants"].items()) + ".",
        "",
        (f"**Step 1** (before any update): loss {ours[0]['loss']:.7f} ours vs {runs[head][0]['loss']:.7f} torch "
         f"(Δrel {hc['loss_rel'][0]:.1e}), grad norm Δrel {hc['grad_norm_rel'][0]:.1e}: the same weights and batches."),
        "",
        "## Worst differences",
        "",
        *worst_lines(comparisons),
        "",
        f"Goal: loss and grad norm within {TOLERANCE:g} (relative) at every step. "
        + " ".join(f"{n}: {'met' if cmp['first_divergent_step'] is None else 'not met (first over at step ' + str(cmp['first_divergent_step']) + ')'}."
                   for n, cmp in comparisons.items())
        + " \"Routed apart\": the first step some layer sends more than a quarter of the tokens to other experts "
        "than ours does.",
        "",
    ]
    if c.get("notes"):
        lines += ["## Findings", "", *c["notes"], ""]
    lines += [
        "## Every 5th step",
        "",
        *table_rows(ours, runs, comparisons),
        "",
        ("Δrel = |torch − ours| / ours. Load max = the busiest expert's share × E, the largest over layers "
         "(1 = even, E = every token to one expert)."),
        "",
        "## Expert load per layer",
        "",
        ("Fractions of the step's tokens per class (experts 0..E−1, then skip). Last column, for the torch run "
         f"{head}: how much the router probabilities vary between tokens (std over tokens, mean over classes), the "
         "range of the experts' balancing biases after the step, and the median over tokens of the gap between the "
         "best and second-best biased score."),
        "",
        *load_lines(ours, runs, head),
        "",
    ]
    if c["recipe_mismatches"]:
        lines += ["## HF_RECIPE vs PARTITION", "", "These HF names have another rule than ours:", "",
                  *[f"- {m}" for m in c["recipe_mismatches"]], ""]
    lines += [f"Software: torch {c['torch']}, transformers {c['transformers']}, jax {c['jax']}; {c['machine']}.", ""]
    return "\n".join(lines)


def render(record: dict, stem: str) -> str:
    """The markdown (returned), and with a stem STEM.{md,json,png}."""
    text = markdown(record)
    if stem:
        with open(stem + ".json", "w") as f:
            json.dump(record, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(text)
        plot(stem + ".png", record["ours"], record["torch_runs"], record["comparisons"],
             f"{os.path.basename(record['config'])}, {record.get('compute_dtype', 'float32')}, {record['steps']} steps: zaya train vs HF ZayaForCausalLM "
             "in eager PyTorch")
    return text


def write_summary(paths: list[str], stem: str) -> str:
    """One row per configuration (an earlier run's JSON): its worst loss and grad-norm differences
    per torch run. Written to STEM.md where a stem is given; returned."""
    lines = ["# `zaya train` against torch, per configuration", "",
             "The worst relative difference over every step of each run (`python benchmarks/trajectory_vs_torch.py "
             "--summary=...` over the runs' JSONs; each run's own table is beside its JSON). The test's tolerances "
             "(`tests/test_trajectory.py`, 8 steps) are set from these with margin.", "",
             "| run | configuration | compute | documents per row | steps | torch run | worst loss Δrel | worst grad-norm Δrel |",
             "|---|---|---|---:|---:|---|---:|---:|"]
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        setting = " ".join(o.replace("--config.", "") for o in r["overrides"]) or "as shipped"
        setting += f", {r['cpu_devices']} device(s)" + (f", {r['short_documents']} short documents" if r.get("short_documents") else "")
        for name, cmp in r["comparisons"].items():
            lines.append(f"| [{os.path.basename(path)}]({os.path.basename(path)[:-5]}.md) | "
                         f"`{os.path.basename(r['config'])}` {setting} | {r.get('compute_dtype', 'float32')} | "
                         f"{r.get('documents_per_row', float('nan')):.2f} | {r['steps']} | {name} | "
                         f"{cmp['worst_loss_rel']['value']:.1e} (step {cmp['worst_loss_rel']['step']}) | "
                         f"{cmp['worst_grad_norm_rel']['value']:.1e} (step {cmp['worst_grad_norm_rel']['step']}) |")
    text = "\n".join(lines + [""])
    if stem:
        with open(stem + ".md", "w") as f:
            f.write(text)
    return text


# torch runs: name → ((Newton–Schulz dtype, normalisation), what it is).
VARIANTS = {
    "torch": (("bfloat16", "clamp"), "torch.optim.Muon as shipped: Newton–Schulz in bfloat16, input / max(‖x‖, eps)"),
    "fp32-NS": (("float32", "clamp"), "its Newton–Schulz patched to fp32 (as ours): no known difference left"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cpu-devices", type=int, default=1, help="train.cpu_devices of our run")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"torch runs, of {list(VARIANTS)}")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "trajectory_vs_torch"),
                        help="output stem: writes STEM.md, STEM.json, STEM.png ('' = print only)")
    parser.add_argument("--notes", default="", help="a markdown file whose lines go under 'Findings'")
    parser.add_argument("--from-json", default="", help="re-render this JSON (e.g. with new --notes); run nothing")
    parser.add_argument("--short-documents", type=int, default=0,
                        help="train on this many short documents (2-19 characters, JSONL) instead of data.source")
    parser.add_argument("--summary", default="", help="comma-separated JSONs of earlier runs: write their agreement "
                        "per configuration to --out.md; run nothing")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        parser.error(f"unknown arguments {bad}")
    notes = None
    if args.notes:
        with open(args.notes) as f:
            notes = f.read().rstrip("\n").splitlines()
    if args.summary:
        print(write_summary(args.summary.split(","), args.out))
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            record = json.load(f)
        if notes is not None:
            record["notes"] = notes
        print(render(record, args.out))
        return 0

    variants = [v for v in args.variants.split(",") if v]
    started = time.perf_counter()
    from zaya_jax import cpu_host

    cpu_host.prepare(args.cpu_devices)  # the same devices as the `zaya train` child: the same init

    import jax
    import numpy as np
    import torch
    import transformers

    from zaya_jax.data.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as work:
        asked = overrides  # what the record shows: not the temporary corpus's path
        if args.short_documents:
            corpus = short_documents(os.path.join(work, "short_documents.jsonl"), args.short_documents)
            overrides = [*overrides, f"--config.data.source={corpus}"]
        exp = load_exp(args.config, args.steps, args.cpu_devices, overrides)
        cfg, optim = exp.model, exp.config.optim
        ours_sec = run_ours_subprocess(args.config, args.steps, args.cpu_devices, overrides, os.path.join(work, "run"))
        ours = read_metrics(os.path.join(work, "run"))
        if len(ours) != args.steps:
            raise RuntimeError(f"metrics.jsonl holds {len(ours)} steps, expected {args.steps}")
        params, biases = initial_arrays(exp, jax.devices()[:args.cpu_devices])
        batches = step_batches(exp, args.steps)  # the corpus is read here too
        overrides = asked
    runs, seconds = {}, {"ours": ours_sec}
    for name in variants:
        t0 = time.perf_counter()
        runs[name] = train_torch(exp, params, biases, batches, VARIANTS[name][0], args.steps)
        seconds[name] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - started

    c = exp.config
    eos = load_tokenizer(c.data.tokenizer).eos_id
    record = {
        "command": " ".join(["python benchmarks/trajectory_vs_torch.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": args.config, "overrides": overrides, "steps": args.steps, "cpu_devices": args.cpu_devices,
        "short_documents": args.short_documents, "compute_dtype": cfg.compute_dtype,
        "documents_per_row": float(np.mean([(b["inputs"] == eos).sum() / b["inputs"].shape[0] for b in batches])),
        "model": f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts + skip, "
                 f"vocab {cfg.vocab_size}",
        "global_batch_size": c.train.global_batch_size, "seq_len": c.train.seq_len,
        "tokens_per_step": c.train.global_batch_size * c.train.seq_len,
        "optim": ", ".join(f"{k}={getattr(optim, k)}" for k in ("lr", "min_lr", "warmup_steps", "weight_decay", "clip_norm",
                                                                  "muon_momentum", "muon_ns_steps", "balancer", "balance_lr")
                         if hasattr(optim, k)),
        "variants": {n: VARIANTS[n][1] for n in variants}, "headline": variants[0],
        "recipe_mismatches": recipe_mismatches(cfg),
        "runtime_sec": seconds, "torch": torch.__version__, "transformers": transformers.__version__,
        "jax": jax.__version__, "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "ours": [{k: r[k] for k in ("step", "loss", "grad_norm", "lr", "expert_load")} for r in ours],
        "torch_runs": runs, "comparisons": {name: compare(ours, run) for name, run in runs.items()},
    }
    if notes is not None:
        record["notes"] = notes
    print(render(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
