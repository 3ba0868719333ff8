"""Hardware numbers: the project's one table of accelerator peaks.

Owns `HardwareProfile` and `PROFILES`. Everything else that needs a hardware number (the
training MFU now, the mesh-layout explorer's link bandwidths later) reads it from here, so a
corrected datasheet figure changes in exactly one place.

Sources (summarised in `shared/reference/mesh_explorer.md` §2 and §5.5):
* MI300X: AMD Instinct MI300X datasheet: 1307.4 TFLOP/s dense BF16 (2614.9 with sparsity),
  192 GB HBM3, 5.3 TB/s (theoretical; AMD staff say real tests do not reach it).
* MI325X: AMD product page: same CDNA3 compute as MI300X, 256 GB HBM3E, 6.0 TB/s.
* MI355X: AMD CDNA4 whitepaper / MI355X datasheet: ≈2.5 PFLOP/s dense BF16 (2516.6),
  288 GB HBM3E, 8.0 TB/s.
* H100 SXM: NVIDIA H100 datasheet: 989.4 TFLOP/s dense BF16, 80 GB HBM3, 3.35 TB/s.
* H200 SXM: NVIDIA H200 datasheet: 989.4 TFLOP/s dense BF16, 141 GB HBM3E, 4.8 TB/s.
* cpu: NOT a measurement. A nominal 1 TFLOP/s per device so that MFU is defined (and the
  code path exercised) on CPU; `nominal=True` marks it and MFU from it means nothing.
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
    nominal: bool = False  # True: a placeholder, not a datasheet figure


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("mi300x", 1307.4, 192, 5.3, "AMD Instinct MI300X datasheet"),
        HardwareProfile("mi325x", 1307.4, 256, 6.0, "AMD Instinct MI325X product page"),
        HardwareProfile("mi355x", 2516.6, 288, 8.0, "AMD CDNA4 whitepaper / MI355X datasheet (~2.5 PF dense BF16)"),
        HardwareProfile("h100", 989.4, 80, 3.35, "NVIDIA H100 SXM datasheet"),
        HardwareProfile("h200", 989.4, 141, 4.8, "NVIDIA H200 SXM datasheet"),
        HardwareProfile("cpu", 1.0, 0, 0.0, "nominal 1 TFLOP/s so MFU is defined on CPU; not a measurement",
                        nominal=True),
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
