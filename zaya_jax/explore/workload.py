"""What one layout asks of each device: the run's shape (`Workload`) and its per-device split (`Share`).

`Workload` is the question (model, sequence length, global batch, micro-batches, remat policy, the
hardware and its nodes); `Share` is what one device of a layout holds of one micro-batch:
its tokens and sequences, heads, KV heads, expert width and the keys its queries see. Also here,
for memory and collectives alike: the size of a linear layer's LASP-2 state exchange.
"""

from __future__ import annotations

import dataclasses
import math

from zaya_jax.config import ModelConfig
from zaya_jax.hardware import HardwareProfile
from zaya_jax.kernels.registry import DEFAULTS
from zaya_jax.model.layer_stack import repeating_unit
from zaya_jax.parallel import zigzag
from zaya_jax.parallel.axes import BATCH_AXES, SEQUENCE_AXES

F32 = 4
FLASH_BACKENDS = ("pallas", "cudnn")  # attention kernels that never store [queries, keys] scores


@dataclasses.dataclass(frozen=True)
class Workload:
    cfg: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    grad_accum: int  # micro-batches per step
    remat: str  # none | full | dots
    hw: HardwareProfile
    nodes: int
    gpus_per_node: int
    vocab_chunk: int = 16384
    ns_steps: int = 5  # Muon's Newton–Schulz iterations
    zero1: bool = True  # optimizer state split over `data` too (optim.shard_over_data)
    zigzag: bool = True  # mesh.zigzag: causal attention balanced over the sequence devices
    # train.scan_unroll: units of the layer pattern an iteration of the layer scan runs, at most the
    # model's (`from_experiment`: a scan unrolls no further than its length)
    scan_unroll: int = 1
    # Measured shares of the peak per kernel kind (`step_time.flops_by_kernel`, and Muon's
    # `newton_schulz` of the fp32 peak), the factor a profiled step puts on the modelled elementwise
    # work, and the residual that scales compute to a measured step (`explore/calibration.py`);
    # none: the profile's.
    efficiencies: tuple[tuple[str, float], ...] = ()
    elementwise_scale: float = 1.0
    residual: float = 1.0
    ns_dtype: str = "auto"  # optim.muon_ns_dtype: the dtype of Newton–Schulz's products (`train/muon.ns_dtype`)

    @classmethod
    def from_experiment(cls, exp, hw: HardwareProfile, nodes: int, gpus_per_node: int) -> "Workload":
        c = exp.config
        return cls(exp.model, c.train.seq_len, c.train.global_batch_size, c.train.grad_accum_steps, c.train.remat,
                   hw, nodes, gpus_per_node, c.train.loss_vocab_chunk, c.optim.muon_ns_steps, c.optim.shard_over_data,
                   c.mesh.zigzag, scan_unroll=min(c.train.scan_unroll, pattern_units(exp.model)),
                   ns_dtype=c.optim.muon_ns_dtype)

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.grad_accum

    @property
    def ns_in_bf16(self) -> bool:
        """Whether Muon's Newton–Schulz multiplies in bf16 on this hardware (`train/muon.ns_dtype`)."""
        from zaya_jax.train.muon import ns_dtype

        return ns_dtype(self.ns_dtype, self.hw.target) == "bfloat16"

    @property
    def compute_bytes(self) -> int:
        return 2 if self.cfg.compute_dtype == "bfloat16" else 4

    def efficiency(self, kind: str) -> float:
        """The share of the peak a kernel of this kind reaches: measured, else the profile's."""
        return dict(self.efficiencies).get(kind, self.hw.compute_efficiency)

    def backend(self, kernel: str, configured: str) -> str:
        """The kernel backend the run would use on this hardware ('auto' → its kernel target's default)."""
        return DEFAULTS[self.hw.target][kernel] if configured == "auto" else configured

    @property
    def flash_attention(self) -> bool:
        return self.backend("attention", self.cfg.attention_kernel) in FLASH_BACKENDS


@dataclasses.dataclass(frozen=True)
class Share:
    """One device's part of one micro-batch under a layout."""

    tokens: float  # rows of the residual stream on this device
    heads: int  # query heads computed here
    kv_heads: int
    expert_width: float  # each expert's intermediate width computed here per pass
    keys: int  # keys each local query attends over (the whole sequence with sequence chunks)
    dispatch: int  # tokens gathered per local token for the experts (expert axis size)
    rows: float  # sequences of the micro-batch on this device (whole, or its chunks of each)
    chunks: int = 1  # pieces each sequence is split into along its length (tsp × sequence)
    ring: int = 1  # slices of each expert's width circulating in the TSP experts' ring (tsp)


def pattern_units(cfg: ModelConfig) -> int:
    """How many times the layer pattern's repeating unit runs: the layer scan's length."""
    return cfg.num_hidden_layers // len(repeating_unit(cfg.layer_kinds))


def share(run: Workload, sizes: dict[str, int]) -> Share:
    cfg = run.cfg
    split = math.prod(sizes[a] for a in BATCH_AXES + SEQUENCE_AXES)
    t = sizes["tensor"]
    return Share(tokens=run.micro_batch * run.seq_len / split, heads=cfg.num_attention_heads // t,
                 kv_heads=cfg.num_key_value_heads // t, expert_width=cfg.moe_intermediate_size / t,
                 keys=run.seq_len, dispatch=sizes["expert"],
                 rows=run.micro_batch / math.prod(sizes[a] for a in BATCH_AXES),
                 chunks=math.prod(sizes[a] for a in SEQUENCE_AXES), ring=sizes["tsp"])


def lasp2_chunks(run: Workload, sizes: dict[str, int]) -> int:
    """Sequence chunks a linear layer's LASP-2 exchange gathers (`parallel/lasp2.py`): 2 per
    sequence device under zigzag, 1 contiguous; 0 when no axis splits the sequence (no exchange)."""
    devices = math.prod(sizes[a] for a in SEQUENCE_AXES)
    if devices == 1:
        return 0
    return devices * zigzag.chunks_per_device(zigzag.zigzagged(run.zigzag, devices))


def lasp2_state_bytes(run: Workload, sizes: dict[str, int], s: Share) -> float:
    """One linear layer's all-gathered memory states: fp32 [chunks, rows, nk, g, d, d] (this
    device's KV heads, g query heads each). No sequence length in it: a chunk's state is d × d."""
    return lasp2_chunks(run, sizes) * s.rows * s.heads * run.cfg.head_dim ** 2 * F32


def lasp2_ends_bytes(run: Workload, sizes: dict[str, int], s: Share) -> float:
    """The int32 last segment id of every gathered chunk: LASP-2's second, tiny all-gather."""
    return lasp2_chunks(run, sizes) * s.rows * 4
