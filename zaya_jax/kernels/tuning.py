"""Block sizes and launch parameters of the Pallas kernels, per target and operand width: the one tuning table.

Kernels take a `blocks=` argument; None means `blocks_for(kernel, dtype)`, the row of the kernel
target (`registry.target()`) for that operand width: `cuda/16` and `rocm/16` for bf16/fp16,
`cuda/32` and `rocm/32` for fp32 (the parity dtype: a 4-byte tile needs twice the shared memory,
so its rows are smaller), `cpu` for both. GPU rows are Triton tiles (powers of two, ≥ 16 for `dot`);
the CPU row is small so that interpret-mode tests exercise many tiles, partial tiles and loop trips
on small shapes. `kernels/resources.py` checks every GPU row against the shared memory (LDS) of
every device of its target, and a test fails if one does not fit.

No GPU has timed these rows yet: they are the usual Triton starting tiles for head_dim 128,
sized to fit, not tuned.

Why `num_stages=1` on ROCm: Triton pipelines a loop's loads through `num_stages` shared-memory
buffers. MI300X/MI325X have 64 KiB of LDS per CU, a third of an H100's, so double-buffering the
K/V (or GEMM) tiles there either overflows LDS or forces tiles too small to feed the matrix
cores; JAX's Triton path also defaults to one stage on ROCm (and three on CUDA) for that reason.
AMD's stream pipeliner overlaps global loads with compute through registers even at one stage.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from zaya_jax.kernels.registry import target


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


@dataclasses.dataclass(frozen=True)
class LinearAttentionBlocks:
    block: int  # tokens per step of the loop over the sequence (the chunk C)
    block_dv: int  # value columns per program: the state is d_k × block_dv, fp32, in registers
    num_warps: int = 4
    num_stages: int = 2


_CPU = {
    "attention": AttentionBlocks(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32),
    "grouped_matmul": GroupedMatmulBlocks(block_m=16, block_k=16, block_n=32),
    "rms_norm": RmsNormBlocks(block_rows=8),
    "linear_attention": LinearAttentionBlocks(block=16, block_dv=16),
}

TABLE: dict[str, dict] = {
    "cuda/16": {
        "attention": AttentionBlocks(block_q=64, block_k=64, block_q_bwd=32, block_k_bwd=64, num_warps=4,
                                     num_stages=2),
        "grouped_matmul": GroupedMatmulBlocks(block_m=128, block_k=64, block_n=128, num_warps=8, num_stages=3),
        "rms_norm": RmsNormBlocks(block_rows=4, num_warps=8),
        "linear_attention": LinearAttentionBlocks(block=64, block_dv=64, num_warps=4, num_stages=2),
    },
    "cuda/32": {
        "attention": AttentionBlocks(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=64, num_warps=4,
                                     num_stages=2),
        "grouped_matmul": GroupedMatmulBlocks(block_m=64, block_k=32, block_n=64, num_warps=4, num_stages=3),
        "rms_norm": RmsNormBlocks(block_rows=4, num_warps=8),
        "linear_attention": LinearAttentionBlocks(block=32, block_dv=64, num_warps=4, num_stages=2),
    },
    "rocm/16": {
        "attention": AttentionBlocks(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=64, num_warps=4,
                                     num_stages=1),
        "grouped_matmul": GroupedMatmulBlocks(block_m=128, block_k=64, block_n=128, num_warps=8, num_stages=1),
        "rms_norm": RmsNormBlocks(block_rows=4, num_warps=8),
        "linear_attention": LinearAttentionBlocks(block=64, block_dv=64, num_warps=4, num_stages=1),
    },
    "rocm/32": {
        "attention": AttentionBlocks(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32, num_warps=4,
                                     num_stages=1),
        "grouped_matmul": GroupedMatmulBlocks(block_m=64, block_k=32, block_n=64, num_warps=4, num_stages=1),
        "rms_norm": RmsNormBlocks(block_rows=4, num_warps=8),
        "linear_attention": LinearAttentionBlocks(block=32, block_dv=32, num_warps=4, num_stages=1),
    },
    "cpu": _CPU,
}


def row_name(target_name: str, dtype) -> str:
    """The TABLE row for a target and an operand dtype ('cpu' and 'tpu' share the cpu row)."""
    if target_name not in ("cuda", "rocm"):
        return "cpu"
    return f"{target_name}/{32 if jnp.dtype(dtype).itemsize > 2 else 16}"


def blocks_for(kernel: str, dtype=jnp.bfloat16):
    """The kernel target's block sizes for `kernel` with operands of `dtype`."""
    return TABLE[row_name(target(), dtype)][kernel]
