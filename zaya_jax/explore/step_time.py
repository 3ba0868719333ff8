"""Predicted step time of a layout: compute (matmuls and elementwise work), plus each axis's collectives.

Compute: the device's hardware FLOPs by kernel kind (the model's training FLOPs for its tokens, layer by layer
of each kind: `flops.layer_mixer_params`, `flops.layer_core_flops`; the part a
`tensor` group repeats on every member — the router — counted on each, the LM head split over
its vocabulary (`vocab` rule), plus the
recomputation the remat policy adds: a block forward under `full`, the attention core under
`dots`, a block forward but its experts' matmuls under `moe`, and the chunked loss's logits always) over `peak × efficiency`:
the hardware profile's `compute_efficiency` for every kind, or each kind's measured share of the
peak and a measured residual from a calibration file (`explore/calibration.py`); on a host measured
by `zaya bench host`, the rate of a matmul of the kind's size (`call_flops`) times the share the
blocks' matmuls reach inside a step. Kernels of static shape count the rows they run
(`padded_share`). The blocks' elementwise work is `ELEMENTWISE_PASSES` over their activations at
the host's elementwise rate or the HBM bandwidth (`elementwise_seconds`).
The causal attention core of a CCA layer is the busiest sequence device's: the average under
`mesh.zigzag` (every device the same work, `parallel/zigzag.py`), (2D−1)/D times it with D
contiguous chunks. A linear layer's core is the same per token on every device (no S in it).

Communication: per axis, the bytes each collective of our schedules moves (`transfers`),
priced on the links the axis crosses (`collectives.Network`). FSDP's weight gathers, the
gradient reductions inside the micro-batch loop and TSP's expert ring can overlap compute (XLA's
scheduler / the ring's design), so together they cost only what exceeds the compute time (on a GPU:
XLA:CPU runs them in line); tensor,
sequence (CCA's K/V, linear layers' LASP-2 states), expert and TSP's attention collectives sit
between dependent matmuls, and with several
micro-batches the data axis's one reduction comes after the loop (ZeRO-1's weight gather after
the update, always): those count in full.
The optimizer adds Muon's Newton–Schulz matmuls (each device its share of whole matrices), the
exchanges that bring the matrices there and back (after the backward: counted in full), the
iterations' elementwise passes over the matrices and one pass over the state in HBM. A gradient
reduction is one collective per stacked weight. MFU = model FLOPs (6N + attention, `train/flops.py`) / (step time × peak × devices).
"""

from __future__ import annotations

import dataclasses
import math

from zaya_jax.explore import inventory, memory
from zaya_jax.explore.collectives import Network
from zaya_jax.explore.placement import Span, spans
from zaya_jax.explore.workload import Workload, Share, lasp2_ends_bytes, lasp2_state_bytes, share
from zaya_jax.kernels import pallas_linear_attention, tiled_grouped_matmul, tuning
from zaya_jax.kernels.registry import GPU_TARGETS
from zaya_jax.model.layer_stack import MIXERS
from zaya_jax.parallel import muon_spread, tsp_experts, zigzag
from zaya_jax.parallel.axes import BATCH_AXES, SEQUENCE_AXES
from zaya_jax.parallel.rules import spread_axes
from zaya_jax.train import flops

F32 = 4
LINEAR_CHUNK = memory.XLA_CHUNK
# Elementwise traffic per byte of activation a block makes, forward and backward (norms, rotary,
# convs, softmax, routing, the experts' dispatch, each read and written, and their gradients):
# measured on XLA:CPU (tiny_cpu under data 2, profiled: the elementwise ops' time at the host's
# elementwise rate over the blocks' activations), not derived.
ELEMENTWISE_PASSES = 26.0
# The share of the host's matmul rate (`zaya bench host`: square matmuls in a loop) the blocks'
# matmuls reach inside a step: measured on XLA:CPU (tiny_cpu under data 2, profiled: the blocks'
# dots' FLOPs at the host's rate over their time, 0.43), not derived. Their operands' layout copies, small
# contractions (router, convs) and the tiled kernel's batched tiles; Newton–Schulz's large batched
# products reach the full rate.
IN_STEP_MATMUL_SHARE = 0.45
# A Newton–Schulz iteration's elementwise work on X (`train/muon.newton_schulz`: a·X + (b·A + c·A²)·X
# reads X and the product and writes X): passes over the matrices per iteration.
NS_PASSES = 3
TOKEN_AXES = BATCH_AXES + SEQUENCE_AXES  # axes that split the tokens: gradients sum over them


@dataclasses.dataclass(frozen=True)
class Transfer:
    axis: str  # mesh axis, or "a+b" for a reduction over several
    op: str
    nbytes: float  # per call: the gathered / reduced array (permute: bytes sent)
    calls: float  # per optimizer step
    overlappable: bool
    what: str
    span: Span


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute_s: float  # matmuls and elementwise work together
    elementwise_s: float  # of which the memory-bound elementwise work
    exposed_comm_s: dict  # axis → seconds not hidden behind compute
    optimizer_s: float
    step_time_s: float
    mfu: float
    model_flops: float  # per step, all devices
    hardware_flops: float  # per device per step


def hardware_flops(run: Workload, sizes: dict[str, int], s: Share) -> float:
    """FLOPs one device runs per optimizer step (forward, backward, recomputation)."""
    return sum(flops_by_kernel(run, sizes, s).values())


def flops_by_kernel(run: Workload, sizes: dict[str, int], s: Share) -> dict[str, float]:
    """`hardware_flops` by the kind of kernel that runs them (`KERNEL_CLASSES`): the dense
    matmuls (projections, router, LM head), the experts' grouped matmul, CCA's attention core and
    the linear layers' core (their chunks' products too, `intra_chunk_flops`, and LASP-2's state
    work on a split sequence). Forward, backward (twice the forward) and the remat policy's
    recomputation; the loss backward recomputes each chunk's logits."""
    cfg, t, kinds = run.cfg, sizes["tensor"], run.cfg.layer_kinds
    repeated = flops.router_params(cfg)
    head = cfg.vocab_size * cfg.hidden_size / inventory.vocab_split(cfg, sizes)
    present = [kind for kind in MIXERS if kind in kinds]
    # Causal imbalance is CCA's: a linear layer's core is the same per token on every device.
    imbalance = {"C": _busiest_causal_share(run, sizes), "L": 1.0}
    core = {k: kinds.count(k) * flops.layer_core_flops(cfg, k, run.seq_len) / 3 / t * imbalance[k] for k in present}
    if "L" in core:
        core["L"] += kinds.count("L") * intra_chunk_flops(run) / t
        if math.prod(sizes[a] for a in SEQUENCE_AXES) > 1:
            core["L"] += kinds.count("L") * lasp2_state_flops(cfg) / t
    dense = sum(kinds.count(k) * 2 * (flops.layer_mixer_params(cfg, k) / t + repeated) for k in present)
    experts = cfg.num_hidden_layers * 2 * flops.expert_params(cfg) / t
    recompute = {"full": (1, 1, 1), "dots": (0, 0, 1), "moe": (1, 0, 1)}.get(run.remat, (0, 0, 0))
    per_token = {"matmul": (3 + recompute[0]) * dense + 8 * head,
                 "grouped_matmul": (3 + recompute[1] + ring_recompute(sizes)) * experts,
                 "attention": (3 + recompute[2]) * core.get("C", 0.0),
                 "linear_attention": (3 + recompute[2]) * core.get("L", 0.0)}
    per_token["grouped_matmul"] *= padded_share(run, sizes, s)
    return {kind: value * s.tokens * run.grad_accum for kind, value in per_token.items()}


def linear_chunk(run: Workload) -> int:
    """Tokens per chunk of the linear layers' kernel: the `xla` form's `XLA_CHUNK`, Pallas's block
    for the device and dtype (`kernels.tuning`, fitted to the sequence as the kernel fits it),
    neither longer than the sequence (Pallas's rounded up to a power of two)."""
    if run.backend("linear_attention", run.cfg.linear_kernel) == "pallas":
        blocks = tuning.TABLE[tuning.row_name(run.hw.target, run.cfg.compute_dtype)]["linear_attention"]
        return pallas_linear_attention.fit_blocks(blocks, run.seq_len, run.cfg.head_dim).block
    return min(LINEAR_CHUNK, run.seq_len)


def intra_chunk_flops(run: Workload) -> float:
    """Forward FLOPs per token a linear layer's chunked kernel runs beside the recurrent form's
    (`flops.layer_core_flops`, which the model's FLOPs count): each query head's scores against
    its chunk's C keys and their product with the C values, the causal mask applied to whole
    [C, C] tiles, 2·C·d each."""
    cfg = run.cfg
    return 4.0 * linear_chunk(run) * cfg.num_attention_heads * cfg.head_dim


def lasp2_state_flops(cfg) -> float:
    """Forward FLOPs per token LASP-2 adds on a split sequence (`parallel/lasp2.py`), beside the
    linear-attention kernel's own: each query head's kᵀv over the device's chunks into the state it
    shares (`linear_attention.chunk_state`) and every token's read of the state entering its chunk
    (`initial_term`, q·M), 2·d² per query head each."""
    return 2 * 2.0 * cfg.num_attention_heads * cfg.head_dim ** 2


def ring_recompute(sizes: dict[str, int]) -> int:
    """Forwards of the experts the TSP ring's backward runs again: it recomputes each slice's
    products from the tokens (`parallel/tsp_experts.py` saves nothing else), whatever the remat
    policy already recomputed."""
    return 1 if sizes["tsp"] > 1 else 0


def compute_seconds(run: Workload, work: dict[str, float], per_call: dict[str, float] | None = None,
                    in_step: float = IN_STEP_MATMUL_SHARE, peak_tflops: float = 0.0) -> float:
    """Each kind's FLOPs over the rate it runs at, times the calibration's residual. The rate: a
    calibration's measured share of the peak (`peak_tflops`, else the BF16 one) for the kind; else,
    on a host whose matmuls were measured by size (`HardwareProfile.matmul_curve`), `in_step` times
    the rate of a matmul of the kind's FLOPs per call (`call_flops`); else the peak times the
    profile's efficiency."""
    peak = (peak_tflops or run.hw.peak_bf16_tflops) * 1e12

    def rate(kind: str) -> float:
        if kind in dict(run.efficiencies) or not run.hw.matmul_curve or per_call is None:
            return peak * run.efficiency(kind)
        return in_step * curve_rate(run.hw.matmul_curve, per_call[kind]) * 1e12

    return run.residual * sum(value / rate(kind) for kind, value in work.items() if value)


def curve_rate(curve: tuple[tuple[float, float], ...], flops: float) -> float:
    """TFLOP/s of a matmul of `flops` FLOPs: interpolated log-log between the measured sizes; below
    the smallest, its time per call (a call costs at least that); above the largest, its rate."""
    (f0, r0), (fn, rn) = curve[0], curve[-1]
    if flops <= f0:
        return r0 * flops / f0
    if flops >= fn:
        return rn
    for (fa, ra), (fb, rb) in zip(curve, curve[1:]):
        if fa <= flops <= fb:
            w = math.log(flops / fa) / math.log(fb / fa)
            return math.exp((1 - w) * math.log(ra) + w * math.log(rb))
    return rn


def call_flops(run: Workload, sizes: dict[str, int], s: Share) -> dict[str, float]:
    """FLOPs of one matmul of each kind (`flops_by_kernel`), what sets its rate on a host measured
    by size: a projection of the hidden width over the device's tokens; one expert's rows against
    its slice of the width (the tiled kernel's tiles are one batched product: the rate of the
    expert's rows, not a tile's); the attention core's queries against their keys for every
    (sequence, head) pair at once, as one batched product; a linear layer's chunks likewise."""
    cfg, h, t = run.cfg, run.cfg.hidden_size, sizes["tensor"]
    q_len = s.tokens / max(s.rows, 1e-9)
    heads = s.rows * s.heads  # (sequence, head) pairs: one batched product over all of them
    return {"matmul": 2 * s.tokens * h * h / t, "grouped_matmul": 2 * expert_call_rows(run, sizes, s) * h
            * s.expert_width / sizes["tsp"], "attention": 2 * heads * q_len * s.keys * cfg.head_dim,
            "linear_attention": 2 * heads * q_len * min(LINEAR_CHUNK, q_len) * cfg.head_dim}


def tile(rows: float, experts: float) -> int:
    """The `tiled` grouped matmul's rows per tile for these rows and experts."""
    return tiled_grouped_matmul.tile_rows(int(rows), int(experts))


def expert_call_rows(run: Workload, sizes: dict[str, int], s: Share) -> float:
    """Rows one local expert's matmul multiplies: its share of every row the device holds."""
    rows, experts = memory.held_rows(run, sizes, s)
    return rows / experts


def padded_share(run: Workload, sizes: dict[str, int], s: Share) -> float:
    """The experts' work on a device over its routed rows' own (`flops_by_kernel` counts those).
    Kernels of static shape do more: the `tiled` grouped matmul runs every row the device holds
    (the gathered rows of other owners' experts too, as empty tiles) plus up to a tile per expert;
    XLA:CPU's `ragged_dot` runs every row against every local expert. A ragged GPU kernel (Pallas)
    skips what is not its own."""
    backend = run.backend("grouped_matmul", run.cfg.moe_kernel)
    rows, groups = memory.held_rows(run, sizes, s)
    if backend == "tiled":
        return (rows + groups * tile(rows, groups)) / s.tokens
    if backend == "xla" and run.hw.target == "cpu":
        return groups * rows / s.tokens
    return 1.0


def elementwise_seconds(run: Workload, sizes: dict[str, int], s: Share) -> float:
    """The blocks' memory-bound work: `ELEMENTWISE_PASSES` times the activations they make (as the
    memory model counts them, `memory.block_bytes_per_token`), a forward more under remat (and the
    experts' forward again in the TSP ring's backward, `ring_recompute`), at the
    host's measured elementwise rate (else the memory bandwidth), and the tiled grouped matmul's
    weight copies; a calibration's profiled factor (`Workload.elementwise_scale`) and its residual
    scale it."""
    made = memory.over_layers(run, lambda kind: memory.block_bytes_per_token(run, s, kind))
    recompute = 0 if run.remat == "none" else 1
    traffic = ELEMENTWISE_PASSES * (3 + recompute) / 3 * made * s.tokens * run.grad_accum
    ring = run.cfg.num_hidden_layers * memory.moe_bytes(run, s)["experts"] * ring_recompute(sizes)
    traffic += ELEMENTWISE_PASSES / 3 * ring * s.tokens * run.grad_accum
    traffic += tile_weight_bytes(run, sizes, s) * run.cfg.num_hidden_layers * run.grad_accum * (
        2 + recompute + ring_recompute(sizes))
    rate = (run.hw.elementwise_tb_per_s or run.hw.hbm_tb_per_s) * 1e12
    return run.residual * run.elementwise_scale * traffic / rate


def tile_weight_bytes(run: Workload, sizes: dict[str, int], s: Share) -> float:
    """The `tiled` grouped matmul's per-tile copies of its expert's weights, one layer, one pass
    (`kernels/tiled_grouped_matmul`): a one-hot product over the experts, memory-bound (its
    contraction is the expert count), writes [tiles, K, N] of every weight and the batched product
    reads them: 2 x tiles x 3·H·I fp32 bytes (a TSP ring's steps copy a slice each: the whole width
    in all). Forward and backward gather them (and a forward more under remat, and in the ring's
    backward)."""
    if run.backend("grouped_matmul", run.cfg.moe_kernel) != "tiled":
        return 0.0
    rows, groups = memory.held_rows(run, sizes, s)
    tiles = rows / tile(rows, groups) + groups
    return 2 * tiles * 3 * run.cfg.hidden_size * s.expert_width * F32


def _busiest_causal_share(run: Workload, sizes: dict[str, int]) -> float:
    """The slowest sequence device sets the step: 1 under zigzag (every device the same causal
    work), (2D-1)/D with D contiguous chunks (the last one's queries see nearly every key)."""
    devices = math.prod(sizes[a] for a in SEQUENCE_AXES)
    return zigzag.busiest_causal_share(devices, zigzag.zigzagged(run.zigzag, devices))


def transfers(run: Workload, sizes: dict[str, int]) -> list[Transfer]:
    """Every collective of one optimizer step, per device."""
    cfg, s, where = run.cfg, share(run, sizes), spans(sizes, run.gpus_per_node)
    a, layers, b = run.grad_accum, cfg.num_hidden_layers, run.compute_bytes
    passes = 3 if run.remat == "full" else 2  # forward (+ recomputed forward) and backward
    out = _gradient_reductions(run, sizes, where) + _muon_exchange(run, sizes, where)
    block = inventory.block_groups(cfg)
    if sizes["fsdp"] > 1:
        gathered = sum(g.count * inventory.local_bytes(g, sizes, ("fsdp",))
                       for g in inventory.param_groups(cfg) if "fsdp" in inventory.sharded_axes(g, sizes))
        out += [Transfer("fsdp", "all_gather", gathered, a * (passes - 1), True, "weights, forward and backward", where["fsdp"]),
                Transfer("fsdp", "reduce_scatter", gathered, a, True, "gradients", where["fsdp"])]
    if sizes["tensor"] > 1:
        out.append(Transfer("tensor", "all_reduce", s.tokens * cfg.hidden_size * F32, a * layers * 2 * passes, False,
                            "attention and expert outputs, their input gradients", where["tensor"]))
        if inventory.vocab_split(cfg, sizes) > 1:
            out.append(Transfer("tensor", "all_reduce", s.tokens * cfg.hidden_size * F32, a, False,
                                "the vocabulary-parallel loss's hidden-state gradient", where["tensor"]))
    kv, cca = 2 * s.kv_heads * cfg.head_dim * b, cfg.layer_kinds.count("C")  # K and V bytes per token
    for axis in SEQUENCE_AXES:
        n = sizes[axis]
        if n > 1 and cca:
            out += [Transfer(axis, "all_gather", s.tokens * n * kv, a * cca * (passes - 1), False, "K/V along the sequence", where[axis]),
                    Transfer(axis, "reduce_scatter", s.tokens * n * kv, a * cca, False, "K/V gradients", where[axis])]
    out += _lasp2_exchange(run, sizes, s, where, passes)
    if sizes["tsp"] > 1:
        u = sizes["tsp"]
        for kind, name in (("C", "attention"), ("L", "linear-attention")):
            n = cfg.layer_kinds.count(kind)
            if n:  # a layer's own mixer's weights, bucket by bucket
                weights = sum(inventory.local_bytes(g, sizes, ("fsdp", "tsp")) for g in inventory.mixer_groups(cfg, kind))
                out += [Transfer("tsp", "all_gather", weights, a * n * (passes - 1), False, f"{name} weight buckets", where["tsp"]),
                        Transfer("tsp", "reduce_scatter", weights, a * n, False, f"{name} weight gradients", where["tsp"])]
        experts = sum(inventory.local_bytes(g, sizes, ("fsdp",)) for g in block if g.part == "experts")
        # Each pass round the ring moves the slices (the backward's too), and the backward's gradient
        # accumulators go all the way round.
        hops = tsp_experts.slice_hops(u) * passes + u
        out += [Transfer("tsp", "permute", experts, a * layers * hops, True,
                         "expert slices round the ring (and their gradients)", where["tsp"])]
    if sizes["expert"] > 1:
        rows = s.tokens * sizes["expert"] * cfg.hidden_size
        out += [Transfer("expert", "all_gather", rows * b, a * layers * passes, False, "tokens to every expert's owner", where["expert"]),
                Transfer("expert", "reduce_scatter", rows * F32, a * layers * passes, False, "expert outputs back", where["expert"])]
    return out


def _lasp2_exchange(run: Workload, sizes: dict[str, int], s: Share, where: dict[str, Span], passes: int) -> list[Transfer]:
    """A linear layer on a split sequence (`parallel/lasp2.py`): one all-gather of every chunk's
    memory states over the sequence axes together (and one of the chunks' last segment ids), its
    transpose a reduce-scatter in the backward. No K/V, no halo; the bytes have no S in them."""
    axes = tuple(x for x in SEQUENCE_AXES if sizes[x] > 1)
    linear = run.cfg.layer_kinds.count("L")
    if not axes or not linear:
        return []
    axis, span, calls = "+".join(axes), _joint_span(where, axes), run.grad_accum * linear
    states = lasp2_state_bytes(run, sizes, s)
    return [Transfer(axis, "all_gather", states, calls * (passes - 1), False, "linear layers' memory states", span),
            Transfer(axis, "all_gather", lasp2_ends_bytes(run, sizes, s), calls * (passes - 1), False,
                     "linear layers' chunk ends", span),
            Transfer(axis, "reduce_scatter", states, calls, False, "linear layers' state gradients", span)]


def _muon_exchange(run: Workload, sizes: dict[str, int], where: dict[str, Span]) -> list[Transfer]:
    """Muon's matrices leave where their state lives for the spread and come back
    (`parallel/muon_spread`): an all-to-all over each axis that splits inside the matrices, both
    ways, each moving the device's tile padded to whole matrices; then the results back over the
    axes the state is replicated on: an all-gather of every replica's part (padded alike), or an
    all-reduce of the tile's where that would be mostly padding (`muon_spread.gathers_back`). Axes
    that split between whole matrices move nothing. They move in the iterations' dtype
    (`train/muon.orthogonal_update`)."""
    itemsize = 2 if run.ns_in_bf16 else 4
    exchanged: dict[str, float] = {}
    back: dict[tuple[tuple[str, ...], str], float] = {}
    for g in inventory.param_groups(run.cfg):
        if g.optimizer != "muon":
            continue
        matrices = g.count * math.prod(g.shape[: g.view.batch_axes])
        matrix = inventory.matrix_bytes(g, itemsize)
        between, inside = inventory.muon_tiles(g, sizes, run.zero1)
        held = -(-matrices // math.prod(sizes[a] for a in between | inside))  # whole, after the exchanges
        for axis in inside:
            exchanged[axis] = exchanged.get(axis, 0.0) + held * matrix
        rest = tuple(a for a in spread_axes(sizes) if a not in between | inside)
        if rest:
            replicas = math.prod(sizes[a] for a in rest)
            if muon_spread.gathers_back(held, replicas):
                back[rest, "all_gather"] = back.get((rest, "all_gather"), 0.0) + replicas * -(-held // replicas) * matrix
            else:
                back[rest, "all_reduce"] = back.get((rest, "all_reduce"), 0.0) + held * matrix
    out = [Transfer(axis, "all_to_all", nbytes, 2, False, "Muon's matrices to the spread and back", where[axis])
           for axis, nbytes in exchanged.items()]
    out += [Transfer("+".join(axes), op, nbytes, 1, False, "Muon's updates from the spread",
                     _joint_span(where, axes)) for (axes, op), nbytes in back.items()]
    return out


def _joint_span(where: dict[str, Span], axes: tuple[str, ...]) -> Span:
    """The placement of one collective over several axes at once."""
    return Span(math.prod(where[x].intra for x in axes), math.prod(where[x].inter for x in axes))


def _gradient_reductions(run: Workload, sizes: dict[str, int], where: dict[str, Span]) -> list[Transfer]:
    """The sum of each parameter's gradient over the token-splitting axes that do not shard it
    (FSDP's and TSP's own reductions are reduce-scatters, counted with their schedules; experts
    see every token of the expert axis). With several micro-batches the `data` part runs once,
    after the loop (`parallel/grad_reduction.py`): an all-reduce, or under ZeRO-1 a reduce-scatter onto
    the optimizer's shard; the other axes' parts stay in the loop, once per micro-batch. With one
    micro-batch GSPMD reduces over all of them at once inside the backward. ZeRO-1 then gathers
    the updated weights over `data`."""
    looped: dict[tuple[str, ...], list[float]] = {}  # axes → [bytes, arrays]
    once = {"all_reduce": [0.0, 0], "reduce_scatter": [0.0, 0], "all_gather": [0.0, 0]}

    def add(into: list, nbytes: float) -> None:
        into[0] += nbytes
        into[1] += 1

    for g in inventory.param_groups(run.cfg):
        sharded = inventory.sharded_axes(g, sizes)
        axes = tuple(x for x in TOKEN_AXES if sizes[x] > 1 and x not in sharded
                     and not (x == "expert" and g.part == "experts"))
        nbytes = g.count * inventory.local_bytes(g, sizes)
        split = "data" in axes and inventory.optimizer_split(g, sizes, run.zero1) > 1
        inner = axes if run.grad_accum == 1 else tuple(x for x in axes if x != "data")
        if inner:
            add(looped.setdefault(inner, [0.0, 0]), nbytes)
        if "data" in axes and "data" not in inner:
            add(once["reduce_scatter" if split else "all_reduce"], nbytes)
        if split:
            add(once["all_gather"], nbytes)
    # One collective per stacked weight (XLA:CPU's as compiled; a GPU's combiner may merge them,
    # which only saves the per-call latency): priced at the mean size, as many calls.
    out = []
    for axes, (nbytes, arrays) in looped.items():
        out.append(Transfer("+".join(axes), "all_reduce", nbytes / arrays, run.grad_accum * arrays, True, "gradients",
                            _joint_span(where, axes)))
    what = {"all_reduce": "gradients, once per step", "reduce_scatter": "gradients onto the ZeRO-1 shards",
            "all_gather": "updated weights from the ZeRO-1 shards"}
    # After the loop (or the update) there is no compute left to hide behind.
    out += [Transfer("data", op, nbytes / arrays, arrays, False, what[op], where["data"])
            for op, (nbytes, arrays) in once.items() if nbytes]
    return out


def optimizer_seconds(run: Workload, sizes: dict[str, int]) -> float:
    """Muon's Newton–Schulz on each device's share of the matrices (fp32 products at the profile's
    fp32 matmul peak and a profile's measured share of it; bf16 products, the GPU default, at the
    BF16 peak and the matmuls' share; each weight's stacked matrices one batched product: its rate,
    on a host measured by size, that of the whole batch), the iterations' elementwise updates of
    those matrices (`NS_PASSES` per iteration, in the products' dtype, on a host; a GPU's GEMMs
    take them as alpha and addend) and one pass over the state in memory."""
    state = inventory.state_bytes(run.cfg, sizes, run.zero1)
    stream = 3 * (state.params + state.grads + state.optimizer)  # read grads and state, write state
    bf16 = run.ns_in_bf16
    passes = 0 if run.hw.target in GPU_TARGETS else NS_PASSES
    stream += (0.5 if bf16 else 1.0) * passes * run.ns_steps * sum(
        memory.ns_matrix_bytes(g, sizes) for g in inventory.param_groups(run.cfg) if g.optimizer == "muon")
    hw = run.hw
    unscaled = dataclasses.replace(run, residual=1.0)  # the residual is the blocks' compute's, not this
    kind, peak = ("matmul", hw.peak_bf16_tflops) if bf16 else ("newton_schulz", hw.peak_fp32_matmul_tflops)
    matmuls = sum(compute_seconds(unscaled, {kind: flops}, {kind: flops / iterations}, in_step=1.0, peak_tflops=peak)
                  for flops, iterations in newton_schulz_work(run, sizes))
    return matmuls + stream / (hw.hbm_tb_per_s * 1e12)


def newton_schulz_flops(run: Workload, sizes: dict[str, int]) -> float:
    """Per device: each iteration of `train/muon.newton_schulz` on an m x n matrix (m <= n) is
    X·Xᵀ (2m²n), its square (2m³) and that times X (2m²n); a weight's matrices are spread whole
    over the devices (`parallel/muon_spread`), so each device runs its share."""
    return sum(flops for flops, _ in newton_schulz_work(run, sizes))


def newton_schulz_work(run: Workload, sizes: dict[str, int]) -> list[tuple[float, int]]:
    """Per Muon weight: (this device's Newton–Schulz FLOPs, the batched products they run in:
    three per iteration)."""
    out = []
    for g in inventory.param_groups(run.cfg):
        if g.optimizer != "muon":
            continue
        batch = math.prod(g.shape[: g.view.batch_axes])
        fan_in = math.prod(g.shape[g.view.batch_axes: g.view.batch_axes + g.view.in_axes])
        fan_out = g.elements // (batch * fan_in)
        m, n = min(fan_in, fan_out), max(fan_in, fan_out)
        out.append((inventory.ns_share(g, sizes) * run.ns_steps * (4 * m * m * n + 2 * m ** 3), 3 * run.ns_steps))
    return out


def predict(run: Workload, sizes: dict[str, int], network: Network) -> StepTime:
    s, hw = share(run, sizes), run.hw
    by_kernel = flops_by_kernel(run, sizes, s)
    work = sum(by_kernel.values())
    elementwise = elementwise_seconds(run, sizes, s)
    compute = compute_seconds(run, by_kernel, call_flops(run, sizes, s)) + elementwise
    fixed: dict[str, float] = {}
    hideable: dict[str, float] = {}
    # XLA:CPU runs a device's collectives in line with its compute: nothing hides behind it.
    overlaps = run.hw.target != "cpu"
    for tr in transfers(run, sizes):
        into = hideable if tr.overlappable and overlaps else fixed
        into[tr.axis] = into.get(tr.axis, 0.0) + tr.calls * network.time(tr.op, tr.nbytes, tr.span)
    total_hideable = sum(hideable.values())
    keep = max(0.0, total_hideable - compute) / total_hideable if total_hideable else 0.0
    exposed = {axis: fixed.get(axis, 0.0) + keep * hideable.get(axis, 0.0) for axis in {*fixed, *hideable}}
    opt = optimizer_seconds(run, sizes)
    step = compute + sum(exposed.values()) + opt
    model = flops.training_flops_per_token(run.cfg, run.seq_len).total * run.global_batch * run.seq_len
    mfu = model / (step * hw.peak_bf16_tflops * 1e12 * run.devices)
    return StepTime(compute, elementwise, exposed, opt, step, mfu, model, work)
