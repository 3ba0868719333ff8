"""Hardware numbers: the project's one table of accelerator peaks, efficiencies and links.

Owns `HardwareProfile` and `PROFILES`. Everything that needs a hardware number (the training
MFU, the mesh-layout explorer's compute and link model) reads it from here, so a corrected
datasheet figure changes in exactly one place. Per device (one GPU), not per node.

Peaks and memory (the vendors' published figures):
* MI300X: AMD Instinct MI300X datasheet: 1307.4 TFLOP/s dense BF16 (2.1 GHz x 1216 matrix cores
  x 512 FLOP/clk), 192 GB HBM3, 5.3 TB/s.
* MI325X: AMD product page: same CDNA3 compute as MI300X, 256 GB HBM3E, 6.0 TB/s.
* MI355X: AMD MI355X product page / CDNA4 whitepaper: 2516.6 TFLOP/s dense BF16 (2.4 GHz x
  1024 x 1024; AMD rounds it to 2.5 PF; 2.3 PF is the MI350X), 288 GB HBM3E, 8.0 TB/s.
* H100 SXM / H200 SXM: NVIDIA datasheets: 989.4 TFLOP/s dense BF16; 80 GB HBM3 at 3.35 TB/s /
  141 GB HBM3E at 4.8 TB/s.

Derating (`compute_efficiency`, the share of the peak a large BF16 GEMM reaches):
* MI300X 0.54 and MI325X 0.645: AMD ROCm blog "Measuring Max-Achievable FLOPs, Part 2" (hipBLASLt
  maximum achievable 708 and 843 TFLOP/s).
* MI355X 0.62, H100/H200 0.80: best measured BF16 matmul (1565 and 794.5 TFLOP/s) in
  stas00/ml-engineering `compute/accelerator/README.md`.

Links (`scale_up` "mesh": `peer_links` point-to-point links of `link_gb_per_s` each, a group of k
devices in a node uses k-1 of them; "switch": every device gets `link_gb_per_s` to any peer):
* MI300X / MI325X: full xGMI mesh, 7 links at 64 GB/s per direction raw, 48 usable (RCCL's
  topology constant, ROCm/rccl#1210; ROCm blog "Understanding RCCL Bandwidth and xGMI
  Performance on MI300X": 8-GPU all-reduce busbw 305-319 GB/s at 256 MiB-16 GiB of 336 usable,
  hence `link_efficiency` 0.9; small all-reduce about 13 us).
* MI355X: 7 links, about 153 GB/s bidirectional each (AMD); 57 usable per direction is our
  estimate (MI300X's usable/raw 48/64 applied to 76.5). Uncalibrated.
* H100 / H200: NVSwitch, 450 GB/s per direction line rate, about 370 measured busbw for 8 GPUs
  (NVIDIA/nccl-tests#212, #272, #290), hence 0.82.
* Scale-out: one 400 Gb/s NIC per GPU (Pollara 400 on ZAYA1's rails-only IBM cluster; ConnectX-7
  NDR on NVIDIA nodes) = 50 GB/s per direction; 46-48 measured (nccl-tests#290), hence 0.94.
  Inter-node latency per ring step 10 us (order of NCCL's per-hop network constants).
Shared memory per program (`shared_memory_kib`, what one Triton program may allocate; the bound
`kernels/resources.py` checks every tuning row against):
* MI300X / MI325X (gfx942, CDNA3): 64 KiB of LDS per CU (AMD CDNA3 ISA guide; a Pallas kernel
  asking more fails with "Shared memory size limit exceeded: requested 98304, available: 65536").
* MI355X (gfx950, CDNA4): 160 KiB of LDS per CU (AMD CDNA4 whitepaper).
* H100 / H200 (sm_90): 227 KiB per thread block with the opt-in carve-out (CUDA programming
  guide, compute capability 9.0: 228 KiB per SM, 1 KiB reserved per block).

* cpu: NOT a measurement. Nominal numbers (1 TFLOP/s per device, 32 GB, 10 GB/s links) so MFU
  and the explorer's code paths are defined on CPU; `nominal=True` marks it.
"""

from __future__ import annotations

import dataclasses
import re

from zaya_jax.errors import ZayaError


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Peak numbers for ONE device (one GPU), not a node."""

    name: str
    peak_bf16_tflops: float  # dense (no sparsity) BF16 matmul peak
    hbm_gb: float
    hbm_tb_per_s: float
    source: str
    compute_efficiency: float  # share of the peak that large BF16 GEMMs reach (measured)
    scale_up: str  # "mesh" (point-to-point links to each peer) | "switch" (NVSwitch)
    peer_links: int  # links per device inside a node (1 for a switch: one port to all)
    link_gb_per_s: float  # usable GB/s per direction per link (switch: per device)
    link_efficiency: float  # share of the usable link rate large collectives reach
    scale_out_gb_per_s: float = 50.0  # NIC per device per direction (400 Gb/s)
    nic_efficiency: float = 0.94
    latency_us_intra: float = 13.0  # one small collective inside a node
    latency_us_inter: float = 10.0  # per ring step across nodes
    nominal: bool = False  # True: a placeholder, not a datasheet figure
    target: str = "cpu"  # the kernel target (`kernels.registry.TARGETS`) this device compiles for
    shared_memory_kib: int = 0  # shared memory / LDS one Triton program may use (0: no limit checked)
    # Dense fp32 matmul peak at XLA's default precision (Muon's Newton–Schulz runs in fp32): TF32
    # tensor cores on NVIDIA (cuBLAS's f32f32_tf32 kernels on an H200 here); on ROCm XLA asks
    # hipBLASLt for fp32 compute (tf32 only for CUDA: openxla/xla#46177), the FP32-matrix peak.
    # 0: the BF16 peak (the CPU, whose measured host rates are its own).
    peak_fp32_matmul_tflops: float = 0.0
    # Measured on this host (`zaya bench host`), none in a datasheet profile: the matmul rate by
    # FLOPs per call ((flops, TFLOP/s) rising), and the rate of activation-sized elementwise
    # kernels (0: the memory bandwidth's).
    matmul_curve: tuple[tuple[float, float], ...] = ()
    elementwise_tb_per_s: float = 0.0


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("mi300x", 1307.4, 192, 5.3, "AMD Instinct MI300X datasheet", 0.54, "mesh", 7, 48.0, 0.9,
                        target="rocm", shared_memory_kib=64, peak_fp32_matmul_tflops=163.4),
        HardwareProfile("mi325x", 1307.4, 256, 6.0, "AMD Instinct MI325X product page", 0.645, "mesh", 7, 48.0, 0.9,
                        target="rocm", shared_memory_kib=64, peak_fp32_matmul_tflops=163.4),
        HardwareProfile("mi355x", 2516.6, 288, 8.0, "AMD MI355X product page / CDNA4 whitepaper (~2.5 PF dense BF16)",
                        0.62, "mesh", 7, 57.0, 0.9, target="rocm", shared_memory_kib=160, peak_fp32_matmul_tflops=157.3),
        HardwareProfile("h100", 989.4, 80, 3.35, "NVIDIA H100 SXM datasheet", 0.80, "switch", 1, 450.0, 0.82,
                        latency_us_intra=8.0, target="cuda", shared_memory_kib=227, peak_fp32_matmul_tflops=494.7),
        HardwareProfile("h200", 989.4, 141, 4.8, "NVIDIA H200 SXM datasheet", 0.80, "switch", 1, 450.0, 0.82,
                        latency_us_intra=8.0, target="cuda", shared_memory_kib=227, peak_fp32_matmul_tflops=494.7),
        HardwareProfile("cpu", 1.0, 32, 0.1, "nominal 1 TFLOP/s so MFU is defined on CPU; not a measurement",
                        1.0, "switch", 1, 10.0, 1.0, scale_out_gb_per_s=1.0, nic_efficiency=1.0, nominal=True),
    )
}

# device_kind patterns → profile, first match wins. Word boundaries keep "GH200" from matching
# "h200"; PCIe and NVL parts have lower clocks than the SXM peaks above, so they stay unknown
# rather than get an MFU against the wrong peak.
_KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bmi355x\b", "mi355x"),
    (r"\bmi325x\b", "mi325x"),
    (r"\bmi300x\b", "mi300x"),
    (r"\bh200\b", "h200"),
    (r"\bh100\b", "h100"),
)
_EXCLUDED_VARIANTS = re.compile(r"\b(pcie|nvl)\b")


def measured(base: HardwareProfile, path: str, dtype: str) -> HardwareProfile:
    """`base` with the matmul rate (of `dtype`) and memory bandwidth `zaya bench host` measured on
    this machine: the rate is what its matmuls reach, so the efficiency is 1."""
    import json
    import os

    if not os.path.isfile(path):
        raise ZayaError(f"--host file {path} does not exist; write it with zaya bench host --out={path}")
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise ZayaError(f"--host file {path} is not readable JSON ({e}); write it again with zaya bench host") from None
    return measured_from(base, record, dtype, f"--host file {path}")


def measured_from(base: HardwareProfile, record: dict, dtype: str, where: str = "the host record") -> HardwareProfile:
    """`measured` from a record already in hand (`bench/host.measure`'s)."""
    try:
        rate, memory = float(record["matmul_tflops"][dtype]), float(record["memory_gb_per_s"])
    except (KeyError, TypeError, ValueError) as e:
        raise ZayaError(f"{where} is not a zaya bench host record ({type(e).__name__}: {e}); "
                        "write it again with zaya bench host") from None
    try:  # records written before the curve was measured price every matmul at the large one's rate
        curve = tuple((float(f), float(r)) for f, r in record.get("matmul_curve", {}).get(dtype, ()))
        elementwise = float(record.get("elementwise_gb_per_s", 0.0))
    except (AttributeError, TypeError, ValueError) as e:
        raise ZayaError(f"{where} has a malformed matmul_curve or elementwise rate ({e}); write it again with "
                        "zaya bench host") from None
    if not (rate > 0 and memory > 0 and elementwise >= 0 and all(f > 0 and r > 0 for f, r in curve)):
        raise ZayaError(f"{where} holds rates that are not positive; write it again with zaya bench host")
    return dataclasses.replace(base, peak_bf16_tflops=rate, compute_efficiency=1.0, hbm_tb_per_s=memory / 1e3,
                               matmul_curve=tuple(sorted(curve)), elementwise_tb_per_s=elementwise / 1e3,
                               nominal=False, source=f"measured by zaya bench host ({record.get('device_kind', '?')}, {dtype})")


def profile(name: str) -> HardwareProfile:
    """The profile called `name` (e.g. "mi300x"); ZayaError listing the known names otherwise."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in PROFILES:
        raise ZayaError(f"unknown hardware {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[key]


def detect(device) -> HardwareProfile | None:
    """The profile for a jax device, or None for an accelerator this table does not know.

    None (not a guess) so the caller can say "MFU unavailable: unknown device kind X; set
    train.hardware" instead of reporting an MFU against the wrong peak.
    """
    if getattr(device, "platform", None) == "cpu":
        return PROFILES["cpu"]
    return profile_for_kind(getattr(device, "device_kind", "") or "")


def profile_for_kind(device_kind: str) -> HardwareProfile | None:
    """Map a `device_kind` string ("NVIDIA H100 80GB HBM3", "AMD Instinct MI300X") to a profile."""
    kind = device_kind.lower()
    if kind == "cpu":
        return PROFILES["cpu"]
    if _EXCLUDED_VARIANTS.search(kind):
        return None
    for pattern, name in _KIND_PATTERNS:
        if re.search(pattern, kind):
            return PROFILES[name]
    return None
