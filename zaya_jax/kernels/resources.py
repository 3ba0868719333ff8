"""Shared memory (LDS on AMD) one program of each Pallas kernel needs, checked against the devices.

Triton keeps the operands of every `dot` in shared memory on their way to the matrix cores, and
a loop's operand loads are software-pipelined through `num_stages` buffers. So one program of a
kernel needs, per dot operand tile it loads from memory, the tile's bytes, times `num_stages`
when the load sits in the kernel's main loop. A tile computed in registers that feeds a dot
(attention's probabilities) is not counted: MaxText's numbers below show no buffer for it. Cross-warp reductions (RMSNorm's row sums) take one fp32 word per row and warp.

The model reproduces the one public failure we know exactly: MaxText's Pallas flash attention
on MI300X (block 128 x 128, head_dim 128, bf16, one stage on ROCm: Q, K and V tiles of 32 KiB)
asked for 98,304 bytes of 65,536. It counts what the kernels' source makes Triton allocate, not
Triton's own scratch for layout changes it decides on, so rows keep headroom below the limit.
`check_table` checks every GPU row of `tuning.TABLE` on every device of its target in
`hardware.PROFILES` at ZAYA1's head_dim; a test runs it.
"""

from __future__ import annotations

import dataclasses

from zaya_jax.errors import ZayaError
from zaya_jax.kernels.tuning import TABLE, AttentionBlocks, GroupedMatmulBlocks, LinearAttentionBlocks, RmsNormBlocks

HEAD_DIM = 128  # ZAYA1's head_dim, the only one the model uses


@dataclasses.dataclass(frozen=True)
class Usage:
    kernel: str  # the Triton kernel (one pallas_call)
    bytes: int


def attention(blocks: AttentionBlocks, itemsize: int, head_dim: int = HEAD_DIM) -> list[Usage]:
    """The forward, dq and dk/dv kernels of `pallas_attention`."""
    stages, d = blocks.num_stages, head_dim
    bq, bk, bq_b, bk_b = blocks.block_q, blocks.block_k, blocks.block_q_bwd, blocks.block_k_bwd
    return [
        Usage("forward", itemsize * (bq * d + stages * 2 * bk * d)),  # Q once; K and V per key block
        Usage("dq", itemsize * (2 * bq * d + stages * 2 * bk * d)),  # Q and dO once; K and V per key block
        Usage("dkv", itemsize * (2 * bk_b * d + stages * 2 * bq_b * d)),  # K and V once; Q and dO per query block
    ]


def grouped_matmul(blocks: GroupedMatmulBlocks, itemsize: int) -> list[Usage]:
    """`pallas_grouped_matmul`: the grouped form (lhs tile · weight tile) and the transposed form
    (lhs tileᵀ · dout tile), both pipelined over their loop."""
    bm, bk, bn, stages = blocks.block_m, blocks.block_k, blocks.block_n, blocks.num_stages
    return [Usage("grouped_matmul", itemsize * stages * (bm * bk + bk * bn)),
            Usage("grouped_matmul_transposed", itemsize * stages * (bm * bk + bm * bn))]


def rms_norm(blocks: RmsNormBlocks, itemsize: int) -> list[Usage]:
    """`pallas_rms_norm`: no dots; the row sums reduce across warps."""
    del itemsize  # statistics are fp32 whatever the input
    scratch = 4 * blocks.block_rows * blocks.num_warps
    return [Usage("rms_norm_fwd", scratch), Usage("rms_norm_bwd", 2 * scratch)]


def linear_attention(blocks: LinearAttentionBlocks, itemsize: int, head_dim: int = HEAD_DIM) -> list[Usage]:
    """`pallas_linear_attention`: every operand tile is loaded per sequence step (the state and
    its gradient live in registers): forward q, k, v; dq k, v, dO; dk/dv q, k, v, dO."""
    per_token = {"forward": 2 * head_dim + blocks.block_dv, "dq": head_dim + 2 * blocks.block_dv,
                 "dkv": 2 * head_dim + 2 * blocks.block_dv}
    return [Usage(name, itemsize * blocks.num_stages * blocks.block * width) for name, width in per_token.items()]


MODELS = {"attention": attention, "grouped_matmul": grouped_matmul, "rms_norm": rms_norm,
          "linear_attention": linear_attention}


def usage(kernel: str, blocks, itemsize: int) -> list[Usage]:
    return MODELS[kernel](blocks, itemsize)


def row_itemsize(row: str) -> int:
    return 4 if row.endswith("/32") else 2


def problems(table: dict | None = None, profiles=None) -> list[str]:
    """Every (row, kernel, device) whose shared memory exceeds the device's, in words."""
    from zaya_jax.hardware import PROFILES

    table, profiles = table or TABLE, profiles or PROFILES.values()
    found = []
    for row, kernels in table.items():
        target = row.split("/")[0]
        devices = [p for p in profiles if p.target == target and p.shared_memory_kib]
        for kernel, blocks in kernels.items():
            for use in usage(kernel, blocks, row_itemsize(row)):
                for device in devices:
                    limit = device.shared_memory_kib * 1024
                    if use.bytes > limit:
                        found.append(f"tuning row {row}: the {kernel} kernel's {use.kernel} program needs "
                                     f"{use.bytes} bytes of shared memory, {device.name} has {limit}")
    return found


def check_table(table: dict | None = None, profiles=None) -> None:
    """ZayaError naming the first tuning row that does not fit a device of its target."""
    found = problems(table, profiles)
    if found:
        raise ZayaError(found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))


def report(table: dict | None = None, profiles=None) -> list[dict]:
    """Each GPU row's usage per kernel program against the smallest shared memory of its target."""
    from zaya_jax.hardware import PROFILES

    table, profiles = table or TABLE, list(profiles or PROFILES.values())
    rows = []
    for row, kernels in table.items():
        target = row.split("/")[0]
        limits = [p.shared_memory_kib * 1024 for p in profiles if p.target == target and p.shared_memory_kib]
        if not limits:
            continue
        for kernel, blocks in kernels.items():
            for use in usage(kernel, blocks, row_itemsize(row)):
                rows.append({"row": row, "kernel": kernel, "program": use.kernel, "bytes": use.bytes,
                             "smallest_limit": min(limits), "share": round(use.bytes / min(limits), 3)})
    return rows
