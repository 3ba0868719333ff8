"""Block sizes and launch parameters of the Pallas kernels, per platform: the one tuning table.

Kernels take a `blocks=` argument; None means `blocks_for(kernel)`, the row for the current
platform (`cuda`, `rocm`, `cpu`). GPU rows are Triton tiles (powers of two, ≥ 16 for `dot`); CPU rows are small so
that interpret-mode tests exercise many tiles, partial tiles and loop trips on small shapes.
"""

from __future__ import annotations

import dataclasses

from zaya_jax.kernels.registry import gpu_vendor, platform


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    block_q: int  # query rows per program (forward and dq)
    block_k: int  # key rows per inner-loop step (forward and dq)
    block_q_bwd: int  # query rows per inner-loop step of the dk/dv kernel
    block_k_bwd: int  # key rows per program of the dk/dv kernel
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class GroupedMatmulBlocks:
    block_m: int  # rows (tokens) per tile
    block_k: int  # contraction step
    block_n: int  # output columns per tile
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class RmsNormBlocks:
    block_rows: int  # rows per program; the whole feature width is one tile
    num_warps: int = 4


# Untuned starting points (no GPU has timed them yet): the usual Triton tiles for d = 128.
_CUDA = {
    "attention": AttentionBlocks(block_q=64, block_k=64, block_q_bwd=32, block_k_bwd=64, num_warps=4, num_stages=2),
    "grouped_matmul": GroupedMatmulBlocks(block_m=128, block_k=64, block_n=128, num_warps=8, num_stages=3),
    "rms_norm": RmsNormBlocks(block_rows=4, num_warps=8),
}

TABLE = {
    "cuda": _CUDA,
    # JAX's Triton path defaults to one pipeline stage on ROCm; keep that until MI300X timings say otherwise.
    "rocm": {name: dataclasses.replace(blocks, num_stages=1) if hasattr(blocks, "num_stages") else blocks
             for name, blocks in _CUDA.items()},
    "cpu": {
        "attention": AttentionBlocks(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32),
        "grouped_matmul": GroupedMatmulBlocks(block_m=16, block_k=16, block_n=32),
        "rms_norm": RmsNormBlocks(block_rows=8),
    },
}


def blocks_for(kernel: str):
    """The current platform's block sizes for `kernel` (CPU's for platforms without a row)."""
    return TABLE.get(gpu_vendor() or platform(), TABLE["cpu"])[kernel]
