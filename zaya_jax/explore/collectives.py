"""What one collective costs on the links it crosses: α + bytes / bus bandwidth, per tier.

Bus bandwidth (the nccl-tests / rccl-tests convention; docs/mesh_explorer.md): a
collective over n devices of S bytes (the gathered / reduced array) takes
`t = α + S·(n−1)/n / busbw` for all-gather, reduce-scatter and all-to-all, twice that for
all-reduce. An axis that spans nodes runs hierarchically: the intra-node phase over the node's
links, then the inter-node phase on 1/intra of the data over each device's own NIC (rails).

Per-device busbw comes from the hardware profile (`zaya_jax.hardware`): on a full mesh of
point-to-point links (MI300X xGMI) a group of k devices in a node has k−1 links each, on a switch
(NVSwitch) any group gets the full per-device bandwidth. A measured file overrides it:
`--collectives=FILE`, a JSON list of records
`{"tier": "intra"|"inter", "op": "all_gather"|"reduce_scatter"|"all_reduce"|"all_to_all"|"permute",
"group": 8, "bytes": 1048576, "busbw_gb_per_s": 250.0}`; the explorer interpolates busbw in
log(bytes) between the records of the same tier and op with the nearest group size.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os

from zaya_jax.errors import ZayaError
from zaya_jax.explore.placement import Span
from zaya_jax.hardware import HardwareProfile

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute")
TIERS = ("intra", "inter")
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Curves:
    """Measured busbw points: {(tier, op): {group: [(bytes, GB/s), ...] sorted}}."""

    points: dict

    def busbw(self, tier: str, op: str, group: int, nbytes: float) -> float | None:
        by_group = self.points.get((tier, op))
        if not by_group:
            return None
        nearest = min(by_group, key=lambda g: (abs(math.log(g) - math.log(max(group, 1))), g))
        pts = by_group[nearest]
        sizes = [p[0] for p in pts]
        i = bisect.bisect_left(sizes, nbytes)
        if i == 0:
            return pts[0][1]
        if i == len(pts):
            return pts[-1][1]
        (s0, b0), (s1, b1) = pts[i - 1], pts[i]
        w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return b0 + w * (b1 - b0)


def load_curves(path: str) -> Curves:
    """Read a measured-collectives file; ZayaError naming the first bad record."""
    if not os.path.isfile(path):
        raise ZayaError(f"--collectives file {path} does not exist; write a JSON list of "
                        '{"tier", "op", "group", "bytes", "busbw_gb_per_s"} records')
    try:
        with open(path) as f:
            records = json.load(f)
    except (OSError, ValueError) as e:
        raise ZayaError(f"--collectives file {path} is not valid JSON ({e}); it holds a list of records") from None
    if not isinstance(records, list) or not records:
        raise ZayaError(f"--collectives file {path} must hold a non-empty JSON list of records")
    points: dict = {}
    for i, r in enumerate(records):
        problem = _record_problem(r)
        if problem:
            raise ZayaError(f"--collectives file {path}, record {i}: {problem}")
        key = (r["tier"], r["op"])
        points.setdefault(key, {}).setdefault(int(r["group"]), []).append((float(r["bytes"]), float(r["busbw_gb_per_s"])))
    for by_group in points.values():
        for pts in by_group.values():
            pts.sort()
    return Curves(points)


def _record_problem(r) -> str | None:
    if not isinstance(r, dict):
        return "must be an object with tier, op, group, bytes and busbw_gb_per_s"
    missing = [k for k in ("tier", "op", "group", "bytes", "busbw_gb_per_s") if k not in r]
    if missing:
        return f"has no {missing[0]!r}"
    if r["tier"] not in TIERS:
        return f"tier {r['tier']!r} must be one of {TIERS}"
    if r["op"] not in OPS:
        return f"op {r['op']!r} must be one of {OPS}"
    numbers = (r["group"], r["bytes"], r["busbw_gb_per_s"])
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in numbers):
        return "group, bytes and busbw_gb_per_s must be positive numbers"
    return None


@dataclasses.dataclass(frozen=True)
class Network:
    """Collective timing for one hardware profile, optionally overridden by measured curves."""

    hw: HardwareProfile
    curves: Curves | None = None

    def busbw(self, tier: str, op: str, group: int, nbytes: float) -> float:
        """Bus bandwidth in bytes/s for `op` over `group` devices on `tier`."""
        measured = self.curves.busbw(tier, op, group, nbytes) if self.curves else None
        if measured is not None:
            return measured * GB
        if tier == "inter":
            return self.hw.scale_out_gb_per_s * self.hw.nic_efficiency * GB
        if op == "permute":  # one neighbour: one link on a mesh, the switch port otherwise
            links = 1 if self.hw.scale_up == "mesh" else self.hw.peer_links
            return self.hw.link_gb_per_s * links * self.hw.link_efficiency * GB
        links = (group - 1) if self.hw.scale_up == "mesh" else self.hw.peer_links
        return self.hw.link_gb_per_s * min(links, self.hw.peer_links) * self.hw.link_efficiency * GB

    def time(self, op: str, nbytes: float, span: Span) -> float:
        """Seconds for `op` on an array of `nbytes` (gathered/reduced size; for `permute` the bytes
        sent) over an axis group placed as `span`."""
        if span.size == 1 or nbytes <= 0:
            return 0.0
        if op == "all_reduce":
            return 2 * self.time("reduce_scatter", nbytes, span)
        if op == "permute":
            tier = "intra" if span.inter == 1 else "inter"
            return self._alpha(tier, 1) + nbytes / self.busbw(tier, op, span.size, nbytes)
        t = 0.0
        if span.intra > 1:
            t += self._alpha("intra", span.intra) + nbytes * (span.intra - 1) / span.intra / self.busbw(
                "intra", op, span.intra, nbytes)
        if span.inter > 1:
            part = nbytes / span.intra  # after the node's phase each device carries 1/intra of it
            t += self._alpha("inter", span.inter) + part * (span.inter - 1) / span.inter / self.busbw(
                "inter", op, span.inter, part)
        return t

    def _alpha(self, tier: str, n: int) -> float:
        if tier == "intra":
            return self.hw.latency_us_intra * 1e-6
        return self.hw.latency_us_inter * 1e-6 * max(1, n - 1)
