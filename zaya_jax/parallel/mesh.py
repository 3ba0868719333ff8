"""The named device mesh of a run: axis sizes from `config.mesh`, checked against the machine.

Axes, always all six and in this order: `data` (replicated parameters), `fsdp` (parameters and
optimizer state sharded, ZeRO-3 style), `expert` (experts sharded), `tsp`, `tensor`, `sequence`.
Size 1 means unused; one axis may be -1 and takes the devices the others leave.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zaya_jax.config import ModelConfig
from zaya_jax.errors import ZayaError
from zaya_jax.kernels.registry import resolve as resolve_kernel
from zaya_jax.parallel.axes import BATCH_AXES, MESH_AXES



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


def check_layout(sizes: dict[str, int], model: ModelConfig, micro_batch: int) -> None:
    """Divisibility the layout needs, in words."""
    readers = math.prod(sizes[a] for a in BATCH_AXES)
    if micro_batch % readers:
        raise ZayaError(
            f"each micro-batch has {micro_batch} sequences (train.global_batch_size / train.grad_accum_steps), "
            f"which does not split over the {readers} data-parallel devices (data x fsdp x expert); "
            f"use a multiple of {readers}")
    if model.num_experts % sizes["expert"]:
        raise ZayaError(f"model.num_experts ({model.num_experts}) is not divisible by mesh.expert ({sizes['expert']})")
    if sizes["expert"] > 1 and resolve_kernel("grouped_matmul", model.moe_kernel) == "pallas":
        raise ZayaError("model.moe_kernel=pallas runs every expert on each device's own tokens, which mesh.expert > 1 "
                        "(experts sharded over devices) cannot feed yet; use model.moe_kernel=xla or mesh.expert=1")
    if model.hidden_size % sizes["fsdp"]:
        raise ZayaError(f"model.hidden_size ({model.hidden_size}) is not divisible by mesh.fsdp ({sizes['fsdp']}): "
                        "FSDP shards the hidden dimension of every weight")


def build_mesh(sizes: dict[str, int], devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = tuple(sizes[a] for a in MESH_AXES)
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_for(requested: dict[str, int], model: ModelConfig, micro_batch: int, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_axis_sizes(requested, len(devices))
    check_layout(sizes, model, micro_batch)
    return build_mesh(sizes, devices)
