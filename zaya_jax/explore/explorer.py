"""Rank every layout of a run: enumerate, check, predict memory and step time, sort.

`explore(run)` returns one `Prediction` per layout the model can use on `run.devices` devices:
those that fit first, fastest first, the tight ones (`memory.tight`: within the model's largest
measured underestimate of the limit) after the others; then those that do not, smallest first. Layouts that
break a rule of `parallel/mesh.check_layout` (divisibility, unsupported mixes) are dropped with
their reasons kept, so "no layout" can say why.
"""

from __future__ import annotations

import collections
import dataclasses

from zaya_jax.errors import ZayaError
from zaya_jax.explore import memory, step_time
from zaya_jax.explore.collectives import Network
from zaya_jax.explore.placement import describe, layouts
from zaya_jax.explore.workload import Workload
from zaya_jax.parallel.mesh import check_layout

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Prediction:
    layout: dict[str, int]
    fits: bool
    tight: bool  # fits as predicted, but not at the largest underestimate measured (`memory.UNDERESTIMATE`)
    memory: memory.Memory
    time: step_time.StepTime

    def to_json(self) -> dict:
        m, t = self.memory, self.time
        return {
            "layout": dict(self.layout), "fits": self.fits, "tight": self.tight,
            "predicted": {
                "param_bytes": round(m.param_bytes), "grad_bytes": round(m.grad_bytes),
                "optimizer_bytes": round(m.optimizer_bytes), "activation_bytes": round(m.activation_bytes),
                "total_bytes": round(m.total_bytes), "step_time_s": t.step_time_s, "mfu": t.mfu,
                "compute_s": t.compute_s, "elementwise_s": t.elementwise_s, "optimizer_s": t.optimizer_s,
                "exposed_comm_s": {k: v for k, v in sorted(t.exposed_comm_s.items())},
                "activation_parts": {k: round(v) for k, v in m.parts.items()},
            },
        }


def candidates(run: Workload) -> tuple[list[dict[str, int]], collections.Counter]:
    """Layouts the model accepts on this many devices, and why the others were refused."""
    ok, refused = [], collections.Counter()
    for sizes in layouts(run.devices):
        try:
            check_layout(sizes, run.cfg, run.micro_batch, run.seq_len, run.zigzag)
        except ZayaError as e:
            refused[str(e).split(": ", 1)[-1]] += 1
            continue
        ok.append(sizes)
    return ok, refused


def explore(run: Workload, network: Network | None = None) -> list[Prediction]:
    network = network or Network(run.hw)
    sizes_list, refused = candidates(run)
    if not sizes_list:
        reason = refused.most_common(1)[0][0] if refused else "no layout"
        raise ZayaError(f"no layout of {run.devices} devices works for this run ({len(refused)} tried); the most "
                        f"common reason: {reason}")
    out = []
    for sizes in sizes_list:
        mem = memory.predict(run, sizes)
        out.append(Prediction(sizes, memory.fits(run, mem.total_bytes), memory.tight(run, mem.total_bytes), mem,
                              step_time.predict(run, sizes, network)))
    out.sort(key=lambda p: (not p.fits, p.tight, p.time.step_time_s if p.fits else p.memory.total_bytes))
    return out


def fits_nowhere_message(run: Workload, predictions: list[Prediction]) -> str:
    best = min(predictions, key=lambda p: p.memory.total_bytes)
    usable = memory.usable_bytes(run)
    over = best.memory.total_bytes - usable
    return (f"the model fits on no layout of {run.nodes} x {run.gpus_per_node} {run.hw.name}: the smallest, "
            f"{describe(best.layout)}, needs {best.memory.total_bytes / GIB:.1f} GiB per device, "
            f"{over / GIB:.1f} GiB ({over / usable:.0%}) more than the {usable / GIB:.1f} GiB usable "
            f"({run.hw.hbm_gb:g} GB less {memory.HEADROOM:.0%} headroom); add devices"
            + (" or raise train.grad_accum_steps" if run.remat == "full" else
               ", raise train.grad_accum_steps, or use train.remat=full"))
