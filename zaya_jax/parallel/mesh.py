"""The named device mesh of a run: axis sizes from `config.mesh`, checked against the machine.

Axes, always all six and in this order: `data` (replicated parameters), `fsdp` (parameters and
optimizer state sharded, ZeRO-3 style), `expert` (experts sharded, tokens dispatched), `tsp`
(folded tensor + sequence parallelism), `tensor` (Megatron), `sequence` (context parallel); see
`parallel/rules.py` for where each puts the weights. Size 1 means unused; one axis may be -1 and
takes the devices the others leave. `check_layout` says in words what a layout cannot do
(with `mesh.zigzag`, each sequence is cut into two chunks per sequence device: `parallel/zigzag.py`).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zaya_jax.config import ModelConfig
from zaya_jax.errors import ZayaError, raised_by_every_process
from zaya_jax.model.cca import look_back
from zaya_jax.parallel import zigzag as zigzag_layout
from zaya_jax.parallel.axes import BATCH_AXES, MESH_AXES, PLACEMENT, SEQUENCE_AXES


def resolve_axis_sizes(requested: dict[str, int], num_devices: int) -> dict[str, int]:
    """Replace a -1 by the remaining device count; the product must equal `num_devices`."""
    sizes = {axis: int(requested[axis]) for axis in MESH_AXES}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    free = [a for a, s in sizes.items() if s == -1]
    if free:
        if num_devices % fixed:
            raise ZayaError(f"mesh {_describe(sizes)} cannot fill {num_devices} devices: the fixed axes "
                            f"multiply to {fixed}, which does not divide {num_devices}")
        sizes[free[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total != num_devices:
        raise ZayaError(f"mesh {_describe(sizes)} needs {total} devices but this run has {num_devices}; "
                        "make the axis sizes multiply to the device count or set one axis to -1")
    return sizes


def _describe(sizes: dict[str, int]) -> str:
    used = [f"{a}={s}" for a, s in sizes.items() if s != 1]
    return "(" + (", ".join(used) or "all axes 1") + ")"


def check_layout(sizes: dict[str, int], model: ModelConfig, micro_batch: int, seq_len: int,
                 zigzag: bool = True) -> None:
    """Everything a layout needs of the model, batch and sequence, said in words (first failure);
    `zigzag` as `mesh.zigzag`."""
    message = _first_problem(sizes, model, micro_batch, seq_len, zigzag)
    if message:
        raise ZayaError(f"mesh {_describe(sizes)}: {message}")


def _first_problem(sizes, model: ModelConfig, micro_batch: int, seq_len: int, zigzag: bool) -> str | None:
    readers = math.prod(sizes[a] for a in BATCH_AXES)
    devices = math.prod(sizes[a] for a in SEQUENCE_AXES)
    zigzagged = zigzag_layout.zigzagged(zigzag, devices)
    chunks = devices * zigzag_layout.chunks_per_device(zigzagged)
    tsp, tensor = sizes["tsp"], sizes["tensor"]
    rows = look_back(model)
    checks = [
        (micro_batch % readers == 0,
         f"each micro-batch has {micro_batch} sequences (train.global_batch_size / train.grad_accum_steps), "
         f"which does not split over the {readers} data-parallel devices (data x fsdp x expert); "
         f"use a multiple of {readers}"),
        (model.num_experts % sizes["expert"] == 0,
         f"model.num_experts ({model.num_experts}) is not divisible by mesh.expert ({sizes['expert']})"),
        (tsp == 1 or tensor == 1,
         "mesh.tsp and mesh.tensor both split the heads and the experts' width, and TSP already folds tensor "
         "parallelism into its axis; use one of them"),
        (model.num_key_value_heads % tensor == 0,
         f"model.num_key_value_heads ({model.num_key_value_heads}) is not divisible by mesh.tensor ({tensor}): "
         "CCA mixes the query heads of a KV group, so tensor parallelism gives each device whole KV groups"),
        (model.moe_intermediate_size % (tensor * tsp) == 0,
         f"model.moe_intermediate_size ({model.moe_intermediate_size}) is not divisible by mesh.tensor x mesh.tsp "
         f"({tensor * tsp}): each device holds that share of every expert's width"),
        (model.hidden_size % (sizes["fsdp"] * tsp) == 0,
         f"model.hidden_size ({model.hidden_size}) is not divisible by mesh.fsdp x mesh.tsp "
         f"({sizes['fsdp'] * tsp}): FSDP and TSP store every weight split on its hidden dimension"),
        (zigzagged or seq_len % chunks == 0,
         f"train.seq_len ({seq_len}) is not divisible by mesh.tsp x mesh.sequence ({chunks}), "
         "the number of chunks each sequence is cut into"),
        (not zigzagged or seq_len % chunks == 0,
         f"train.seq_len ({seq_len}) is not divisible by 2 x mesh.tsp x mesh.sequence ({chunks}): zigzag cuts "
         f"each sequence into two chunks per sequence device for causal balance; use a multiple of {chunks} "
         "or set mesh.zigzag=False"),
        (chunks == 1 or seq_len // chunks >= rows,
         f"train.seq_len / ({'2 x ' if zigzagged else ''}mesh.tsp x mesh.sequence) = {seq_len // chunks} tokens "
         f"per chunk is shorter than CCA's look-back of {rows} tokens; use fewer sequence chunks or longer "
         "sequences"),
        (devices == 1 or model.attention_kernel != "cudnn",
         "model.attention_kernel=cudnn takes no causal offset for sequence-sharded queries (mesh.tsp or "
         "mesh.sequence > 1); use model.attention_kernel=pallas or xla"),
    ]
    return next((message for ok, message in checks if not ok), None)


def build_mesh(sizes: dict[str, int], devices=None) -> Mesh:
    """Devices laid out in `PLACEMENT` order (a node's devices share the inner axes), then the
    grid transposed to `MESH_AXES` order, which the shardings name."""
    devices = list(devices if devices is not None else jax.devices())
    placed = np.asarray(devices, dtype=object).reshape(tuple(sizes[a] for a in PLACEMENT))
    grid = placed.transpose([PLACEMENT.index(a) for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_for(requested: dict[str, int], model: ModelConfig, micro_batch: int, seq_len: int, devices=None,
             zigzag: bool = True) -> Mesh:
    """The run's mesh; a layout that cannot work is a `ZayaError` every process of a job raises at
    once (they lay the same config over the same devices), so they leave together."""
    devices = list(devices if devices is not None else jax.devices())
    with raised_by_every_process():
        sizes = resolve_axis_sizes(requested, len(devices))
        check_layout(sizes, model, micro_batch, seq_len, zigzag)
    return build_mesh(sizes, devices)
