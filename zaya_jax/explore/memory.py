"""Predicted per-device memory of a layout's train step: state (exact) plus activations (modelled).

Parameters, gradients and optimizer state come from `inventory` (exact sizes). Activations are
counted tensor by tensor for one block of each layer kind — CCA + MoE, or in a hybrid model
linear attention + MoE (Korthikanti-style, as docs/mesh_explorer.md describes, with ZAYA1's own
widths) — summed over the layers of each kind, then scaled by the remat policy:

* none: every block keeps all its activations for the backward, the inputs of its matmuls
  included: TSP's gathered attention buckets and, along the sequence, a CCA layer's gathered K/V
  or a linear layer's gathered LASP-2 states (FSDP's gathered weights XLA gathers again in the
  backward: not kept; nor, under TSP, the experts' gate and up outputs, which the ring recomputes:
  `ring_recomputed_per_token`);
* full: every block keeps its fp32 input and router state; one block at a time is recomputed
  (on XLA:CPU the pattern's whole unit at once: `working_set_per_token`);
* dots: every block keeps its input and its plain matmuls' outputs (projections, the router's
  MLP); the rest of one block is recomputed at a time, the experts too (their grouped matmul is
  no `dot_general`);
* moe: every block keeps its input and the MoE's sorted tokens and grouped-matmul outputs.

The backward of the block being differentiated holds about as much again under a remat policy
(on a GPU the block recomputed and its gradients; on XLA:CPU every layer of the pattern's unit
recomputed at once, and their gradients as they are made; without remat only the gradients, of one
block, or on XLA:CPU of every layer of the unit, half that where the layer scan is one iteration
and, where it loops, the attention probabilities copied out of the loop's stack:
`working_set_per_token`), and for its experts one layer's weights twice in the compute dtype (as its
input-gradient matmuls read them, gathered over fsdp, and their gradients before the reduction).
With one micro-batch the gradients it fills are ZeRO-1's shards (XLA reduce-scatters each layer's
inside the layer scan); with several, each replica's running sum is whole until the step's one
reduction, this micro-batch's beside it. Unrolled layers without remat keep the `xla` attention's
probabilities in a second layout (`unrolled_probabilities`). Added on top: the schedules' buffers
(FSDP's gathered dense layer, TSP's gathered attention bucket and ring slices, of
every layer of the pattern's unit at once on XLA:CPU (`ring_layers`), the K/V or the linear
layers' memory states gathered along the sequence), copies of every layer's
expert weights where an iteration of the layer scan runs several layers (a hybrid unit without
remat, unrolled units under any policy: `stored_weight_bytes`), XLA:CPU's masked operands of `ragged_dot` on a CPU
device (`cpu_kernel_bytes`, no GPU has them; made from the peaking layer's kept expert
activations, which then die where the layer scan is no loop: `consumed_by_cpu_kernel_per_token`)
and the step's input arrays. The loss is a second
candidate peak, between the last block's forward and the first block's backward: what the blocks
keep, the chunked loss ([tokens, chunk] fp32 logits, probabilities and their gradient, plus the fp32
final hidden states), the gathered embedding and the head's gradient, but no block's working set and
none of the blocks' gradients yet (on a GPU at ZAYA1-like widths XLA's peak is often here). The
update is a third: one set of gradients (reduced by then: ZeRO-1's shard), Muon's Newton–Schulz
temporaries and, on a CPU device, the clipped copy and the new values beside the old (shards too);
the prediction is the largest.
`HEADROOM` of the HBM is kept free for the framework, collective scratch and fragmentation; a
layout whose prediction fits but would not at its compiler's `UNDERESTIMATE` times it is *tight*
(`tight`).
"""

from __future__ import annotations

import dataclasses

from zaya_jax.explore import inventory
from zaya_jax.explore.workload import Workload, Share, lasp2_state_bytes, pattern_units, share
from zaya_jax.kernels.ops import XLA_CHUNK
from zaya_jax.model.layer_stack import MIXERS, repeating_unit

HEADROOM = 0.10
# The largest XLA / predicted total over the drawn shapes, per compiler, each repredicted by this
# model (`benchmarks/explorer_drawn_shapes*.json`; `tests/test_held_out.py` keeps them true): XLA:CPU
# on 8 fake CPUs, XLA's GPU compiler for 8 deviceless H100s (scheduling for a nearly full HBM, or
# ZAYA1-scale steps for its own; ROCm's shares its scheduler). XLA has needed this much more than the prediction; a layout predicted
# within it of the limit may not fit.
UNDERESTIMATE = {"cpu": 1.33, "gpu": 1.23}
# The jax whose XLA:CPU the CPU-fitted terms (the unit's rings, the backward's working set, the
# `cpu` underestimate) were read on; another version's XLA:CPU schedules the step differently
# (docs/mesh_explorer.md, "The XLA these numbers were read on").
CPU_TERMS_JAX = (0, 10)
CPU_RECOMPUTED_UNITS = 1.15  # XLA:CPU's backward under remat: the unit recomputed, and its gradients as made
BACKWARD_SCORES = 1.5  # XLA:CPU's `xla` attention backward: probability sets beyond the block's one
F32 = 4
BATCH_FIELDS = 5  # the step's inputs: inputs, targets, segment_ids, positions, loss_mask (4 bytes a token)


@dataclasses.dataclass(frozen=True)
class Memory:
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # everything else: activations, loss, schedule buffers, inputs
    parts: dict  # activation_bytes broken down, for the report

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


# Each predicted part's term in XLA's attribution (`xla_terms.TERMS`): the gathered K/V a backward
# without remat keeps are a collective's results there, as every schedule buffer is.
PART_TERMS = {"stored_activations": "stored_activations", "stored_gathered": "schedule",
              "stored_weights": "stored_activations", "block_working_set": "block_working_set",
              "block_weights": "block_working_set", "cpu_kernel": "kernel", "loss": "loss", "gathered_weights": "schedule",
              "ring_slices": "schedule", "gathered_kv": "schedule", "gathered_states": "schedule",
              "optimizer_temporaries": "update", "update_copies": "update", "inputs": "inputs"}


def by_term(m: Memory) -> dict[str, float]:
    """The prediction in `xla_terms.TERMS`' terms (0 for the terms the model has no part for)."""
    from zaya_jax.explore.xla_terms import TERMS

    out = dict.fromkeys(TERMS, 0.0) | {"parameters": m.param_bytes, "gradients": m.grad_bytes,
                                        "optimizer": m.optimizer_bytes}
    for part, value in m.parts.items():
        out[PART_TERMS[part]] += value
    return out


def usable_bytes(run: Workload) -> float:
    return run.hw.hbm_gb * 1e9 * (1 - HEADROOM)


def underestimate(run: Workload) -> float:
    """The largest factor XLA's peak has exceeded this model's prediction by on the run's compiler."""
    return UNDERESTIMATE["cpu" if run.hw.target == "cpu" else "gpu"]


def fits(run: Workload, total_bytes: float) -> bool:
    """A prediction within the device's memory, less the headroom (`HEADROOM`)."""
    return total_bytes <= usable_bytes(run)


def tight(run: Workload, total_bytes: float) -> bool:
    """A prediction that fits, but would not at the largest underestimate measured (`underestimate`)."""
    return fits(run, total_bytes) and not fits(run, total_bytes * underestimate(run))


def attention_bytes(run: Workload, s: Share) -> dict[str, float]:
    """Per token, the attention half of a CCA block: what it keeps for the backward."""
    cfg, b = run.cfg, run.compute_bytes
    d, qk = cfg.head_dim, (s.heads + s.kv_heads) * cfg.head_dim
    parts = {
        "input": cfg.hidden_size * F32 + cfg.hidden_size * b,  # residual in, normed copy
        "projections": qk * b + s.kv_heads * d * b,  # q, k and the two value halves
        "conv": 3 * qk * b,  # conv input with its look-back rows, depthwise and grouped outputs
        "qk_norm_rope": 2 * qk * b + s.kv_heads * d * b,  # normed and rotated q, k; merged values
        "attention_out": s.heads * d * b + s.heads * F32 + cfg.hidden_size * b,  # o, logsumexp, o·Wo
        "merge": cfg.hidden_size * F32,
    }
    if not run.flash_attention:  # the xla/reference backends keep the fp32 probabilities, every key
        parts["scores"] = s.heads * s.keys * F32
    if s.chunks > 1 and run.hw.target == "cpu":
        # Split along the sequence, the layer runs on its input with the previous chunk's look-back
        # rows in front (`parallel/attention_schedule.py`) and keeps that [look-back ‖ chunk, H] in
        # three copies where the unsplit layer keeps its normed input (seed 57 under `tensor 4 x
        # sequence 2`, no remat: three per layer in the forward's stack). XLA:CPU's only: a GPU's
        # compiler does not keep them (the deviceless H100 sets).
        parts["look_back_input"] = 2 * cfg.hidden_size * b
    return parts


def linear_bytes(run: Workload, s: Share) -> dict[str, float]:
    """Per token, the linear-attention half of a hybrid block (`model/linear_attn.py`): what it
    keeps for the backward. No convs, no K/V gathered; the kernel keeps nothing under Pallas (its
    backward rebuilds the states), the chunked `xla` form its [C, C] scores and per-chunk states."""
    cfg, b, h = run.cfg, run.compute_bytes, run.cfg.hidden_size
    q, kv = s.heads * cfg.head_dim, s.kv_heads * cfg.head_dim
    parts = {
        "input": h * F32 + h * b,  # residual in, normed copy
        "projections": (q + 2 * kv) * b,  # x·Wq, x·Wk, x·Wv
        "feature_map": (q + kv) * b,  # φ(q)·d^-½, φ(k)
        "attention_out": q * b + 2 * q * F32 + h * F32,  # o, fp32 o and its head norm, y·Wo (fp32)
        "gate": 2 * q * F32 + q * b,  # x·Wg (fp32), its silu, the gated product
        "merge": h * F32,
    }
    backend = run.backend("linear_attention", cfg.linear_kernel)
    if backend == "xla":  # scores and weights per chunk; each chunk's own and entering state
        parts["chunks"] = 2 * s.heads * XLA_CHUNK * F32 + 2 * s.heads * cfg.head_dim ** 2 * F32 / XLA_CHUNK
    elif backend == "reference":  # the quadratic form: [S, S] weights, like unfused attention
        parts["scores"] = 2 * s.heads * s.keys * F32 / 2
    return parts


MIXER_BYTES = {"C": attention_bytes, "L": linear_bytes}  # per layer kind (`ModelConfig.layer_kinds`)


def over_layers(run: Workload, per_kind) -> float:
    """Σ over the layer kinds of (that kind's layer count) · per_kind(kind)."""
    kinds = run.cfg.layer_kinds
    return sum(kinds.count(kind) * per_kind(kind) for kind in MIXERS if kind in kinds)


def moe_bytes(run: Workload, s: Share) -> dict[str, float]:
    """Per token, the MoE half of a block (EP keeps `dispatch`× rows: the gathered tokens)."""
    cfg, b = run.cfg, run.compute_bytes
    h = cfg.hidden_size
    return {
        "input": h * b,
        "router": router_bytes(run),
        "experts": s.dispatch * (h * b + expert_outputs_per_row(run, s) + h * F32),  # sorted rows, gate/up/act, out
        "merge": 2 * h * F32,
    }


def router_bytes(run: Workload) -> float:
    """Per token, the router's fp32 island (`model/router.py`): its MLP's rows and the class
    probabilities. On a GPU as the layer scan saves them for the backward
    (`tests/test_layer_stack.py`, `print_saved_residuals` with the GPU's kernels): the fp32 copy
    of the normed input its down projection reads; twelve [R] rows (the state before and after
    depth averaging, the norm's input and output, each exact GELU's four pieces); the probabilities
    once. On XLA:CPU six rows and two probability sets, which its drawn shapes' buffers fit better
    (349 of 408 within 10%; 346 with the GPU's form)."""
    cfg, r, classes = run.cfg, run.cfg.router_hidden_size, run.cfg.num_experts + 1
    if run.hw.target == "cpu":
        return 6 * r * F32 + 2 * classes * F32
    return cfg.hidden_size * F32 + 12 * r * F32 + classes * F32


def expert_outputs_per_row(run: Workload, s: Share) -> float:
    """Per row an expert sees, its gate, up and activation outputs. On a GPU as the layer scan saves
    them: the fused gate/up in fp32 (the grouped matmul's accumulator dtype, which `moe.swiglu`
    keeps for its backward) and the activation in the compute dtype. On XLA:CPU all three in the
    compute dtype, which its buffers fit better (with `router_bytes`' CPU form)."""
    if run.hw.target == "cpu":
        return 3 * s.expert_width * run.compute_bytes
    return 2 * s.expert_width * F32 + s.expert_width * run.compute_bytes


def matmul_outputs_bytes(run: Workload, s: Share, kind: str = "C") -> float:
    """Per token, what the `dots` policy keeps of a block of this kind: the outputs of its plain
    matmuls (`dot_general`s without batch dimensions): the projections, and the router's three [R]
    projections and class logits. Not the experts': their grouped matmul is `ragged_dot` or a kernel,
    which the policy does not save (`model/remat.py`), so the backward makes them again. Beside them
    the policy keeps each block's input (`stored_per_token`). To the byte what JAX saves for a `C`
    layer scan (`tests/test_layer_stack.py`)."""
    cfg, b = run.cfg, run.compute_bytes
    qk = (s.heads + s.kv_heads) * cfg.head_dim
    if kind == "L":  # q, k, v in the compute dtype; the gate and Wo accumulate in fp32
        attention = (qk + s.kv_heads * cfg.head_dim) * b + s.heads * cfg.head_dim * F32 + cfg.hidden_size * F32
    else:
        attention = qk * b + s.kv_heads * cfg.head_dim * b + cfg.hidden_size * b
    router = (3 * cfg.router_hidden_size + cfg.num_experts + 1) * F32  # down, fc1, fc2; the class logits
    return attention + router


def block_bytes_per_token(run: Workload, s: Share, kind: str = "C") -> float:
    return sum(MIXER_BYTES[kind](run, s).values()) + sum(moe_bytes(run, s).values())


def largest_block_per_token(run: Workload, s: Share) -> float:
    """Per token, the largest block of the model's layer kinds (the backward holds one at a time)."""
    return max(block_bytes_per_token(run, s, kind) for kind in MIXERS if kind in run.cfg.layer_kinds)


def stored_per_token(run: Workload, s: Share) -> float:
    """Per token, what all blocks keep until the backward under the remat policy."""
    # Each layer's input: JAX saves the scan's carry, one a unit, but the unit's backward on both
    # compilers holds the inputs of every layer it recomputes (seed 80's `CL` unit under `full`).
    inputs = run.cfg.num_hidden_layers * block_input_bytes(run)
    if run.remat == "full":
        return inputs
    if run.remat == "dots":
        return inputs + over_layers(run, lambda kind: matmul_outputs_bytes(run, s, kind))
    if run.remat == "moe":
        return inputs + run.cfg.num_hidden_layers * moe_saved_bytes(run, s)
    return (over_layers(run, lambda kind: block_bytes_per_token(run, s, kind)) + unrolled_probabilities(run, s)
            - run.cfg.num_hidden_layers * ring_recomputed_per_token(run, s))


def ring_recomputed_per_token(run: Workload, s: Share) -> float:
    """Per token, what a block's experts do not keep under TSP: their gate, up and activation
    outputs (`dispatch`× rows of 3W). The ring's `custom_vjp` saves only the tokens and the rank's
    own slices and recomputes the rest slice by slice in the backward (`parallel/tsp_experts.py`;
    seed 64 under `expert 2 x tsp 2 x sequence 2`, no remat: no [layers, rows, 2·W] stack); the
    backward holds them as it remakes them (`working_set_per_token` keeps the whole block).
    XLA:CPU's only: where an iteration unrolls several layers (`train.scan_unroll`) XLA:CPU remakes
    every unrolled layer's ring activations before the first backward (`tiny_cpu`), and a GPU's
    compiler holds them in the backward beyond the one block its working set prices, which the kept
    ones stand in for (seed 25 on 8 deviceless H100s)."""
    if s.ring == 1 or run.hw.target != "cpu" or run.scan_unroll > 1:
        return 0.0
    return s.dispatch * expert_outputs_per_row(run, s)


def unrolled_probabilities(run: Workload, s: Share) -> float:
    """Per token, the second layout of the `xla` attention's fp32 probabilities that unrolled layers
    without remat keep: with several layers in one scan iteration XLA lays each CCA layer's
    probabilities out for the backward's dV matmul in the forward already, beside the form the
    softmax gradient reads ([b, nk, g, S, S] and [b, nk, S, g·S], every key, masked or not; read
    off XLA:CPU's buffers, `tiny_cpu`). A scanned layer makes that copy in its own backward."""
    if run.scan_unroll == 1 or run.flash_attention:
        return 0.0
    return run.cfg.layer_kinds.count("C") * s.heads * s.keys * F32


def working_set_per_token(run: Workload, s: Share) -> float:
    """Per token, what the backward of one scan iteration holds beside what the blocks keep.

    Without remat nothing is recomputed: the backward holds the gradients of the kept activations,
    one block's on a GPU; on XLA:CPU the pattern unit's (the checkpoint wraps the scan's body,
    `model/layer_stack.run_blocks`), half that where the layer scan is one iteration of one unit
    (XLA inlines it, reads the kept activations in place and reuses their buffers as they die), and
    where the scan loops the attention probabilities copied out of its stack
    (`backward_scores_per_token`).

    Under a remat policy a GPU holds two blocks, the block recomputed and its gradients, whatever
    the unit. XLA:CPU recomputes every layer of the unit (of every unit an unrolled iteration runs)
    before the unit's backward and holds them with their gradients as they are made:
    `CPU_RECOMPUTED_UNITS` of the unit's blocks (1.14 as `C`, 1.18–1.21 as `LC`: one CPU device, 4
    layers of hidden 512), and the recomputed attention's probabilities and their gradient. Under
    `moe` the MoE's named tensors are kept (`stored_per_token`), not recomputed. Layout by layout:
    docs/mesh_explorer_log.md."""
    largest = largest_block_per_token(run, s)
    unit = sum(block_bytes_per_token(run, s, kind) for kind in repeating_unit(run.cfg.layer_kinds))
    cpu = run.hw.target == "cpu"
    if run.remat == "none":
        if not cpu:
            return largest
        if scan_iterations(run) == 1 and run.scan_unroll == 1:
            return unit / 2
        return unit + backward_scores_per_token(run, s)
    if not cpu:
        return 2 * largest
    if run.remat == "moe":  # the MoE's named tensors are kept (`stored_per_token`), not recomputed
        unit -= len(repeating_unit(run.cfg.layer_kinds)) * moe_saved_bytes(run, s)
    return CPU_RECOMPUTED_UNITS * unit * run.scan_unroll + backward_scores_per_token(run, s)


def backward_scores_per_token(run: Workload, s: Share) -> float:
    """Per token, the [heads, keys] fp32 probability sets XLA:CPU's backward of an `xla` attention
    layer holds beyond the one its block counts: `BACKWARD_SCORES` more, 2.5 at the peak in all:
    the probabilities (recomputed under a remat policy; without one, copied out of a looping scan's
    stack), their gradient and half a set more, of the zigzag's two query halves (a drawn `C` shape
    under `full`, `data 2 x tsp 4`: five half-sets of 2 MiB at the peak). Of every CCA layer an
    iteration of the layer scan runs: XLA:CPU recomputes them all before the first one's backward
    (seed 178). None where a scan of one iteration runs without remat: no loop, so the backward reads
    the kept buffers in place. It decides the peak where the keys outnumber the device's tokens:
    under TSP and sequence splits."""
    if run.flash_attention or "C" not in run.cfg.layer_kinds:
        return 0.0
    if run.remat == "none" and scan_iterations(run) == 1:
        return 0.0
    layers = repeating_unit(run.cfg.layer_kinds).count("C") * run.scan_unroll
    return layers * BACKWARD_SCORES * s.heads * s.keys * F32


def scan_iterations(run: Workload) -> int:
    """Iterations of the layer scan's loop: pattern units over the units one iteration runs (a
    remainder runs unrolled beside it)."""
    return max(pattern_units(run.cfg) // run.scan_unroll, 1)


def block_input_bytes(run: Workload) -> float:
    """Per token, a block's input the layer scan carries: the fp32 residual row and router state."""
    return (run.cfg.hidden_size + run.cfg.router_hidden_size) * F32


def moe_saved_bytes(run: Workload, s: Share) -> float:
    """Per token, what the `moe` policy names: the sorted rows, the fp32 gate, up and down outputs.
    Under TSP only the rows: the ring's `custom_vjp` names its outputs inside its own forward, out of
    the policy's sight, and its backward remakes them (`parallel/tsp_experts.py`)."""
    cfg = run.cfg
    outputs = 0.0 if s.ring > 1 else (2 * s.expert_width + cfg.hidden_size) * F32
    return s.dispatch * (cfg.hidden_size * run.compute_bytes + outputs)


def loss_bytes(run: Workload, tokens: float, vocab_split: int = 1) -> float:
    """The chunked loss's working set: fp32 hidden states, [tokens, chunk] logit buffers (a chunk of
    this device's slice of the vocabulary) and the per-token statistics. XLA:CPU keeps three fp32
    ones (logits, probabilities, their gradient); a GPU's XLA fuses the softmax into its neighbours
    and keeps two: the fp32 logits and their gradient in the compute dtype (8 H100s scheduling for a
    nearly full HBM, ZAYA1-like widths: every loss-phase peak of seeds 24–35; with memory to spare
    XLA also keeps the forward's logits under tsp)."""
    chunk = min(run.vocab_chunk, run.cfg.vocab_size // vocab_split)
    per_entry = 3 * F32 if run.hw.target == "cpu" else F32 + run.compute_bytes
    return tokens * (run.cfg.hidden_size * F32 + chunk * per_entry + 2 * F32)


def gathered_per_layer(run: Workload, sizes: dict[str, int], s: Share, kind: str = "C") -> float:
    """What one block of this kind gathers inside the layer schedules and a backward without remat
    reads again: TSP's buckets of its mixer's weights (its experts' ring saves nothing,
    `parallel/tsp_experts.py`) and, along the sequence, CCA's K/V or a linear layer's LASP-2 states."""
    weights = sum(inventory.local_bytes(g, sizes, ("tsp",)) for g in inventory.mixer_groups(run.cfg, kind)
                  if "tsp" in inventory.sharded_axes(g, sizes))
    along = lasp2_state_bytes(run, sizes, s) if kind == "L" else gathered_kv_bytes(run, sizes, s)
    return weights + along


def gathered_kv_bytes(run: Workload, sizes: dict[str, int], s: Share) -> float:
    """One layer's K and V gathered along the sequence (tsp and sequence chunks); 0 unsplit."""
    return s.tokens * s.chunks * 2 * s.kv_heads * run.cfg.head_dim * run.compute_bytes if s.chunks > 1 else 0.0


def embedding_bytes(run: Workload, sizes: dict[str, int], gathered_over: tuple[str, ...] = ()) -> float:
    """The embedding table (the tied LM head) on a device: as stored, or gathered over `gathered_over`."""
    return sum(inventory.local_bytes(g, sizes, gathered_over) for g in inventory.param_groups(run.cfg)
               if g.part == "embedding")


def gathered_embedding_bytes(run: Workload, sizes: dict[str, int]) -> float:
    """The embedding gathered for the loss over the axes that split its hidden dimension (0 unsplit)."""
    return embedding_bytes(run, sizes, ("fsdp", "tsp")) if sizes["fsdp"] > 1 or sizes["tsp"] > 1 else 0.0


def schedule_bytes(run: Workload, sizes: dict[str, int], s: Share) -> dict[str, float]:
    """The buffers each parallel schedule adds (fp32 weights are gathered as stored; TSP's ring
    passes the experts' slices on in the compute dtype)."""
    cfg, kinds = run.cfg, run.cfg.layer_kinds
    out: dict[str, float] = {}
    if sizes["fsdp"] > 1 or sizes["tsp"] > 1:
        # One block's dense weights (the next one's prefetched: ×2; the larger kind's), gathered over
        # the axes that split their hidden dimension. The embedding gathered for the loss is the
        # loss phase's, gone by the blocks' backward (8 H100s scheduling for a nearly full HBM). The
        # experts' gathered weights are the backward's `block_weights`; TSP's circulate instead.
        dense = max(sum(inventory.local_bytes(g, sizes, ("fsdp", "tsp")) for g in inventory.block_groups(cfg, kind)
                        if g.part != "experts") for kind in MIXERS if kind in kinds)
        out["gathered_weights"] = 2 * dense
    if sizes["tsp"] > 1:  # the slice in use and the one arriving, cast to the compute dtype first
        out["ring_slices"] = 2 * ring_layers(run, sizes) * expert_weights(run, sizes, parts=("experts",)) * run.compute_bytes / F32
    if s.chunks > 1:
        if "C" in kinds:
            out["gathered_kv"] = 2 * gathered_kv_bytes(run, sizes, s)  # the gathered K/V and their gradient
        if "L" in kinds:
            out["gathered_states"] = 2 * lasp2_state_bytes(run, sizes, s)  # LASP-2's states and their gradient
    return out


def expert_weights(run: Workload, sizes: dict[str, int], parts=("experts", "router"), gathered=("fsdp",)) -> float:
    """One layer's expert and router weights (or those of `parts`) as its matmuls read them on a
    device (gathered over fsdp; split over expert, TSP and tensor as stored), or with `gathered=()`
    as the device stores them."""
    return sum(inventory.local_bytes(g, sizes, gathered) for g in inventory.block_groups(run.cfg)
               if g.part in parts)


def ring_layers(run: Workload, sizes: dict[str, int]) -> int:
    """Layers whose TSP expert rings the backward holds at once: one, but on XLA:CPU the pattern's
    unit. Every layer's slices (in use and arriving, and the backward ring's gradient accumulators)
    stay from the start of the unit's backward until that layer's: under a remat policy the unit's
    layers are recomputed together, each with its forward ring (a drawn `LC` shape under
    `data 4 x tsp 2`, `dots`: 8 slices at the peak, 4 a layer); without remat, in a layer scan that
    loops, XLA makes each layer's first slices, which read only the weights, before the unit's
    backward (with one unit, no loop: one layer's)."""
    if sizes["tsp"] == 1 or run.hw.target != "cpu" or (run.remat == "none" and scan_iterations(run) == 1):
        return 1
    return len(repeating_unit(run.cfg.layer_kinds))


def stored_weight_bytes(run: Workload, sizes: dict[str, int]) -> float:
    """Copies of every layer's expert and router weights kept for the backward where one iteration
    of the layer scan runs several layers. A hybrid unit without remat, in a scan that loops (on a
    GPU's compiler, loop or not): the body takes each layer's weights out of their stack and the
    slice is saved, of the rows the device stores, not gathered over fsdp (seed 21, a `CL` unit
    under `fsdp 4 x tsp 2`: [iterations, 4 of 16 experts, H, W] stacks); a remat policy recomputes
    the slice. Units unrolled (`train.scan_unroll`): XLA:CPU keeps the forward's gathered copies of
    every layer's expert weights under every policy (seeds 125 and 129–130)."""
    slices_saved = run.remat == "none" and (scan_iterations(run) > 1 or run.hw.target != "cpu")
    if _layers_an_iteration(run) == 1 or not (run.scan_unroll > 1 or slices_saved):
        return 0.0
    return run.cfg.num_hidden_layers * expert_weights(run, sizes, gathered=("fsdp",) if run.scan_unroll > 1 else ())


def held_rows(run: Workload, sizes: dict[str, int], s: Share) -> tuple[float, float]:
    """(every row the device's experts see: its own and, under expert parallelism, those gathered
    from the other owners; its local experts)."""
    return s.tokens * s.dispatch, run.cfg.num_experts / sizes["expert"]


def cpu_kernel_bytes(run: Workload, sizes: dict[str, int], s: Share) -> float:
    """XLA:CPU's form of `ragged_dot` (the `xla` grouped matmul compiled for a CPU device) multiplies
    every row by every local expert through masked operands, [local experts, rows, K] and flattened
    [rows, experts·K]. At the experts' backward, per (local expert, row), in fp32 values (W the width
    one pass computes: a TSP ring step's slice), the larger of two forms:

    * the down product's backward: its masked cotangent twice (2H) beside the masked inputs the
      forward kept for the weight gradients (H for gate/up, W for down) and their mask (a byte per
      H), of one layer, or of every layer an unrolled iteration runs (`train.scan_unroll`: made
      before the first layer's backward);
    * the gate/up backward: its masked cotangent twice (2·2W), the down's masked input, its own
      twice (2H) and the mask. Without a ring, with one layer a scan step, the down's masked input,
      the mask and one copy of its own are dead by then (4W + H); with several, another layer's
      masked inputs are live beside it (4H + 2W).

    Read off XLA:CPU's buffers (`tiny_cpu`'s sweep, the drawn `C` and hybrid layouts). No GPU
    kernel has them."""
    if not _cpu_ragged_dot(run):
        return 0.0
    rows, local_experts = held_rows(run, sizes, s)
    h, w = run.cfg.hidden_size, s.expert_width / sizes["tsp"]
    mask = h / F32
    gate_up = 5 * w + 2 * h + mask
    if sizes["tsp"] == 1:
        gate_up = 4 * w + h if _one_layer_a_step(run) else max(gate_up, 4 * h + 2 * w)
    kept = _layers_an_iteration(run) if run.scan_unroll > 1 else 1
    per_row = max(kept * (h + w + mask) + 2 * h, gate_up)
    return local_experts * rows * per_row * F32


def consumed_by_cpu_kernel_per_token(run: Workload, s: Share) -> float:
    """Per token, what the layer whose backward peaks no longer keeps of its experts' activations
    on XLA:CPU without remat: in a layer scan that is no loop (one iteration, which XLA inlines) the
    masked operands `cpu_kernel_bytes` counts are made from the kept sorted rows and gate/up/down
    outputs, which then die (seed 97 under `expert 8`). In a scan that loops they are slices of the
    stacked buffer the loop carries to its end, and stay. `dots` and `full` keep none of them;
    under `moe` XLA keeps the named ones."""
    if not _cpu_ragged_dot(run) or scan_iterations(run) > 1 or run.remat != "none":
        return 0.0
    return moe_bytes(run, s)["experts"] - ring_recomputed_per_token(run, s)  # what the layer kept


def _cpu_ragged_dot(run: Workload) -> bool:
    """Whether the experts run XLA:CPU's form of `ragged_dot` (the `xla` grouped matmul on a CPU device)."""
    return run.hw.target == "cpu" and run.backend("grouped_matmul", run.cfg.moe_kernel) == "xla"


def _layers_an_iteration(run: Workload) -> int:
    """Layers one iteration of the layer scan runs: the pattern's unit, `train.scan_unroll` times."""
    return len(repeating_unit(run.cfg.layer_kinds)) * run.scan_unroll


def _one_layer_a_step(run: Workload) -> bool:
    """Whether the layer scan's body runs a single layer (a one-kind pattern, not unrolled)."""
    return len(repeating_unit(run.cfg.layer_kinds)) == 1 and run.scan_unroll == 1


def ns_matrix_bytes(group: inventory.ParamGroup, sizes: dict[str, int]) -> float:
    """fp32 bytes of the whole matrices of a Muon weight one device orthogonalises (`inventory.ns_share`)."""
    return inventory.ns_share(group, sizes) * inventory.matrix_bytes(group)


def muon_temporaries(run: Workload, sizes: dict[str, int]) -> float:
    """Newton–Schulz works on one weight at a time, its matrices spread whole over the devices:
    about three fp32 copies of the largest device share (`ns_matrix_bytes`)."""
    share = [ns_matrix_bytes(g, sizes) for g in inventory.param_groups(run.cfg) if g.optimizer == "muon"]
    return 3 * max(share) if share else 0.0


def predict(run: Workload, sizes: dict[str, int]) -> Memory:
    """The step's peak: the largest of its phases' (`phases`)."""
    return max(phases(run, sizes).values(), key=lambda m: m.total_bytes)


def phases(run: Workload, sizes: dict[str, int]) -> dict[str, Memory]:
    """The peak of each phase of the step the model prices (`xla_terms.PHASES`' names): the
    backward's (activations, schedules' buffers, the last block's working set), the loss's
    (activations, its chunks) and the update's (the clipped gradients and the new values beside
    the old)."""
    state = inventory.state_bytes(run.cfg, sizes, run.zero1)
    s = share(run, sizes)
    # One micro-batch: XLA reduce-scatters each layer's gradients inside the backward's layer scan,
    # so the stack it fills is ZeRO-1's split. Several: each replica's running sum is whole until
    # the one reduction after the loop (`parallel/grad_reduction.py`), beside this micro-batch's.
    grads = state.scattered_grads if run.grad_accum == 1 else 2 * state.grads
    inputs = BATCH_FIELDS * 4 * run.grad_accum * s.tokens  # [A, b, S], split like the tokens
    backward = {
        "stored_activations": s.tokens * (stored_per_token(run, s) - consumed_by_cpu_kernel_per_token(run, s)),
        "stored_gathered": (over_layers(run, lambda kind: gathered_per_layer(run, sizes, s, kind))
                            if run.remat == "none" else 0.0),
        "block_working_set": s.tokens * working_set_per_token(run, s),
        # The backward of one block's experts: its weights in the layout the input gradients read
        # and their gradients before the reduction over the replicas, each about one layer's weights
        # in the compute dtype (bf16 both on an H100's XLA: the grouped matmul's operands and result).
        # Under TSP, the ring's slices and their gradient accumulators (`ring_layers` of them).
        "block_weights": 2 * ring_layers(run, sizes) * expert_weights(run, sizes) * run.compute_bytes / F32,
        "stored_weights": stored_weight_bytes(run, sizes),
        "cpu_kernel": cpu_kernel_bytes(run, sizes, s),
        **schedule_bytes(run, sizes, s),
        "inputs": inputs,
    }
    # The loss runs between the last block's forward and the first block's backward: beside what the
    # forward kept, its chunked working set and the gathered embedding; of the gradients only the
    # head's (and earlier micro-batches' running sum) exist yet.
    loss = {**{k: backward[k] for k in ("stored_activations", "stored_gathered", "stored_weights", "inputs")},
            "loss": loss_bytes(run, s.tokens, inventory.vocab_split(run.cfg, sizes)),
            "gathered_weights": gathered_embedding_bytes(run, sizes)}
    loss_grads = embedding_bytes(run, sizes) + (state.grads if run.grad_accum > 1 else 0.0)
    update = {
        # XLA:CPU materialises the global-norm clip's scaled gradients and the new values beside the
        # old: two more gradient-sized sets, of the shard a device updates under ZeRO-1 (the update
        # reads the reduce-scattered gradients and gathers the new values). An H200's XLA does not
        # (ZAYA1 width, 31 layers: at its update, beside the state and one gradient set, the
        # Newton–Schulz temporaries and 5 GiB more, a fifth of a gradient set;
        # benchmarks/gpu_memory_vs_explorer_h200.md).
        "update_copies": 2 * state.scattered_grads if run.hw.target == "cpu" else 0.0,
        "optimizer_temporaries": muon_temporaries(run, sizes),
        "inputs": inputs,
    }
    # By the update the running sum is reduced (reduce-scattered under ZeRO-1): one set is left.
    held = {"backward": (grads, backward), "loss": (loss_grads, loss), "update": (state.scattered_grads, update)}
    return {phase: Memory(state.params, g, state.optimizer, sum(parts.values()), parts)
            for phase, (g, parts) in held.items()}
