"""The experts on a mesh: one `shard_map` schedule for expert, TSP and tensor parallelism.

Each device holds its tokens [B/batch, S/(tsp·sequence), H] and their routing, flattens them,
and runs `model.moe.by_expert` (sort by expert → grouped SwiGLU → unsort) with:

- **Expert parallel** (`expert` = X): every device owns E/X experts. Tokens are exchanged by a
  ring all-gather over `expert` (every device sees the X shards' tokens; those routed elsewhere
  sort past its groups and cost nothing in the grouped matmul), and the outputs return to their
  owners with a reduce-scatter (`psum_scatter`). Static shapes, no capacity factor, no drops.
- **TSP** (`tsp` = D): each device stores a 1/D slice of every expert's width; the slices
  circulate in the `ppermute` ring of `parallel.tsp_experts` (two slices resident, no all-reduce).
- **Tensor** (`tensor` = T): each device applies its 1/T of every expert's width to the tokens
  and the partial outputs are summed with one `psum` over `tensor`.
- **fsdp** splits the experts (`parallel/rules.py`: E / (expert·fsdp) on each device); the schedule
  all-gathers a layer's fsdp shards over `fsdp` itself, along the experts' dimension. Left to
  GSPMD at the boundary, the backward's gather ran on the layer scan's [1, E/f, ...] slice and XLA
  kept the gathered dimension major over the layers: a relayout copy of every layer's expert
  weights made before the scan and held through the step (`docs/layouts.md`). The gathered
  weights are recomputed in the backward, not kept (`model/remat.without_weight_copies`). Where
  the experts do not divide over fsdp, it splits their hidden dimension and GSPMD gathers it.

On a mesh with only data-like axes (data, fsdp, sequence) the schedule still runs per device:
left to GSPMD, the sort by expert is one global argsort over the sharded tokens, which gathers
every device's tokens to every device (found by `zaya mesh --validate`: 2-3x the temporaries of
the per-device sort on 8 devices).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zaya_jax.model import moe as moe_math
from zaya_jax.parallel.axes import MODEL_AXES
from zaya_jax.parallel.batch_map import axes_in_context, axis_size, schedule_map, row_spec
from zaya_jax.parallel.rules import entry_axes, keep_axes, partition_spec
from zaya_jax.parallel.tsp_experts import ring_experts

FSDP = "fsdp"
WEIGHT_AXES = {"gate": ("experts", "embed", "mlp"), "up": ("experts", "embed", "mlp"),
               "down": ("experts", "mlp", "embed")}


def active(backend: str) -> bool:
    """True on any mesh with a split axis: each device sorts only its own tokens."""
    return bool(axes_in_context())


def experts(x, expert, weight, gate, up, down, *, backend: str):
    """x [B, S, H], expert/weight [B, S]; gate/up [E, H, I], down [E, I, H] → [B, S, H] in x's dtype."""
    mesh = jax.sharding.get_abstract_mesh()
    specs = tuple(partition_spec(WEIGHT_AXES[n], mesh, w.shape) for n, w in (("gate", gate), ("up", up), ("down", down)))
    gather = FSDP in entry_axes(specs[0][0])  # the rules split all three alike
    specs = tuple(keep_axes(s, MODEL_AXES + ((FSDP,) if gather else ())) for s in specs)
    rows = row_spec()
    mapped = schedule_map(functools.partial(_local_experts, backend=backend, gather=gather),
                        in_specs=(P(*rows, None), rows, rows) + specs, out_specs=P(*rows, None),
                        check_vma=False)  # Pallas outputs carry no vma
    return mapped(x, expert, weight, gate, up, down)


def _local_experts(x, expert, weight, gate, up, down, *, backend, gather):
    if gather:
        gate, up, down = (jax.lax.all_gather(w, FSDP, axis=0, tiled=True) for w in (gate, up, down))
    batch, length, hidden = x.shape
    x, expert, weight = x.reshape(-1, hidden), expert.reshape(-1), weight.reshape(-1)
    owners = axis_size("expert")
    local = gate.shape[0]
    if owners > 1:
        x, expert, weight = (jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x, expert, weight))
        expert = expert - jax.lax.axis_index("expert") * local
        expert = jnp.where((expert >= 0) & (expert < local), expert, local)  # not mine: past every group

    def swiglu(xs, sizes):
        if axis_size("tsp") > 1:
            out = ring_experts(xs, sizes, gate, up, down, axis="tsp", backend=backend)
        else:
            out = moe_math.grouped_swiglu(xs, sizes, gate, up, down, backend)
        return jax.lax.psum(out, "tensor") if axis_size("tensor") > 1 else out

    out = moe_math.by_expert(x, expert, weight, local, swiglu)
    if owners > 1:
        out = jax.lax.psum_scatter(out, "expert", scatter_dimension=0, tiled=True)
    return out.reshape(batch, length, hidden)
