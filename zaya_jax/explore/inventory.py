"""Per-device bytes of parameters, gradients and optimizer state for a layout: exact, from the model.

The model's own parameter table (shapes and logical axes, from a copy one layer pattern deep: the
blocks are stored stacked, one row of each block weight per layer that has it: a token mixer's
per layer of its kind, `layer_stack.entry_layers`) goes through the one sharding rules table
(`parallel/rules.py`) with the layout's axis sizes, and through the optimizer partition
(`train/optim.py`): Muon keeps one fp32 momentum per parameter, AdamW two fp32 moments, split
over `data` as well under ZeRO-1 where the program finds them a dimension. So the
prediction and the run share every fact, and a change to the rules changes both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import jax.numpy as jnp

from zaya_jax.config import ModelConfig
from zaya_jax.model.layer_stack import LAYER_AXIS, entry_kind, entry_layers, is_stacked
from zaya_jax.model.params import PARAM_DTYPE
from zaya_jax.parallel import muon_spread
from zaya_jax.parallel.rules import data_split_dim, entry_axes, merged_spec, partition_spec, spec_axes, split_over_data
from zaya_jax.train.muon import MatrixView
from zaya_jax.train.optim import rule_for

PARAM_BYTES = jnp.dtype(PARAM_DTYPE).itemsize  # fp32 master weights
OPTIMIZER_STATES = {"muon": 1, "adamw": 2}  # fp32 tensors of the parameter's shape


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Parameters with one shape, logical axes and optimizer; `count` of them in the model."""

    path: str  # the model's path, e.g. layers/attn/wq (then shape/axes are one layer's)
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    count: int  # stacked: the layers that hold it (a mixer's: those of its kind)
    optimizer: str  # "muon" | "adamw"
    view: MatrixView | None  # how Muon reads it as a batch of matrices
    part: str  # "attention" | "experts" | "router" | "embedding" | "other": for the schedules' buffers
    kind: str | None = None  # a token mixer's layer kind ("C" CCA, "L" linear attention); None: every layer's

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float
    optimizer: float
    scattered_grads: float  # one fp32 copy split over `data` too where ZeRO-1 splits the optimizer state


def _part(path: str) -> str:
    for key, part in (("/attn/", "attention"), ("/linear_attn/", "attention"), ("/experts/", "experts"),
                      ("/router/", "router"), ("embedding", "embedding")):
        if key in path:
            return part
    return "other"


@functools.lru_cache(maxsize=16)
def param_groups(cfg: ModelConfig) -> tuple[ParamGroup, ...]:
    """Every parameter of the model as groups of identical ones (shape, axes, optimizer)."""
    from zaya_jax.train.flat_model import model_def

    small = model_def(cfg.replace(num_hidden_layers=len(cfg.layer_pattern)))  # every kind has a row
    shapes, axes = small.param_shapes, small.param_axes
    groups = []
    for path, shape in shapes.items():
        shape, path_axes, count, kind = tuple(shape), tuple(axes[path]), 1, None
        if is_stacked(path):  # one block's weight, stored once per layer that has it
            shape, path_axes = shape[1:], path_axes[1:]
            count, kind = entry_layers(path, cfg.layer_kinds), entry_kind(path)
        rule = rule_for(path)
        groups.append(ParamGroup(path, shape, path_axes, count, rule.optimizer, rule.view, _part(path), kind))
    return tuple(groups)


def block_groups(cfg: ModelConfig, kind: str | None = None) -> list[ParamGroup]:
    """The stacked (per-layer) parameters; with `kind`, those of one block of that layer kind:
    the parts every layer has and that kind's token mixer."""
    return [g for g in param_groups(cfg) if is_stacked(g.path) and (kind is None or g.kind in (None, kind))]


def mixer_groups(cfg: ModelConfig, kind: str) -> list[ParamGroup]:
    """One layer kind's token-mixer parameters (CCA's `layers/attn/*`, linear attention's `layers/linear_attn/*`)."""
    return [g for g in param_groups(cfg) if g.kind == kind]


@functools.lru_cache(maxsize=65536)
def _sharded_axes(group: ParamGroup, sizes: tuple[tuple[str, int], ...]) -> frozenset[str]:
    mesh = types.SimpleNamespace(shape=dict(sizes))
    return frozenset(spec_axes(partition_spec(group.axes, mesh, group.shape)))


def sharded_axes(group: ParamGroup, sizes: dict[str, int]) -> frozenset[str]:
    """The mesh axes the rules table splits this parameter over, on a mesh of these axis sizes."""
    return _sharded_axes(group, tuple(sizes.items()))


def shard_count(group: ParamGroup, sizes: dict[str, int]) -> int:
    """How many ways the rules table splits this parameter."""
    return math.prod(sizes[a] for a in sharded_axes(group, sizes))


def vocab_split(cfg: ModelConfig, sizes: dict[str, int]) -> int:
    """How many ways the LM head's vocabulary is split (the `vocab` rule: `tensor`, when it divides
    the table; the loss then runs vocabulary-parallel, `train/loss.py`)."""
    table = next(g for g in param_groups(cfg) if g.part == "embedding")
    return sizes["tensor"] if "tensor" in sharded_axes(table, sizes) else 1


def local_bytes(group: ParamGroup, sizes: dict[str, int], gathered: tuple[str, ...] = ()) -> float:
    """fp32 bytes of one of the group's parameters on a device, after gathering the named axes."""
    sharded = sharded_axes(group, sizes)
    regather = math.prod(sizes[a] for a in gathered if a in sharded)
    return group.elements * PARAM_BYTES * regather / shard_count(group, sizes)


@functools.lru_cache(maxsize=65536)
def _data_split(group: ParamGroup, sizes: tuple[tuple[str, int], ...]) -> int | None:
    mesh = types.SimpleNamespace(shape=dict(sizes))
    shape, axes = stored(group)
    return data_split_dim(partition_spec(axes, mesh, shape), shape, mesh)


def muon_tiles(group: ParamGroup, sizes: dict[str, int], zero1: bool) -> tuple[frozenset[str], frozenset[str]]:
    """The mesh axes that split a Muon weight's optimizer state between whole matrices (its batch
    dims: layers, experts) and inside them (its rows or columns), read as the program reads them:
    the state's spec (`rules.partition_spec`, ZeRO-1's `data` by `rules.data_split_dim`) kept
    through the reshape into matrices (`rules.merged_spec`, as `parallel/muon_spread` does)."""
    mesh = types.SimpleNamespace(shape=dict(sizes))
    shape, axes = stored(group)
    spec = partition_spec(axes, mesh, shape)
    if optimizer_split(group, sizes, zero1) > 1:
        spec = split_over_data(spec, data_split_dim(spec, shape, mesh), len(shape))
    batch = int(is_stacked(group.path)) + group.view.batch_axes
    fan_in = math.prod(shape[batch: batch + group.view.in_axes])
    matrices = (*shape[:batch], fan_in, math.prod(shape[batch:]) // fan_in)
    where = [entry_axes(e) for e in merged_spec(spec, shape, matrices)]
    return frozenset(a for e in where[:-2] for a in e), frozenset(a for e in where[-2:] for a in e)


def optimizer_split(group: ParamGroup, sizes: dict[str, int], zero1: bool) -> int:
    """How many more ways ZeRO-1 (`optim.shard_over_data`) splits the group's optimizer state:
    the data degree where the program finds a dimension for it (`rules.data_split_dim`), else 1."""
    return sizes.get("data", 1) if zero1 and _data_split(group, tuple(sizes.items())) is not None else 1


def matrix_bytes(group: ParamGroup, itemsize: int = 4) -> float:
    """Bytes of one of a Muon weight's matrices at `itemsize` (fp32 by default: Muon's state is fp32
    whatever the parameters'; the iterations' dtype may be bf16, `Workload.ns_in_bf16`)."""
    return group.elements / math.prod(group.shape[: group.view.batch_axes]) * itemsize


def ns_share(group: ParamGroup, sizes: dict[str, int]) -> int:
    """How many of the weight's whole matrices each device orthogonalises (`parallel/muon_spread`)."""
    return muon_spread.share(group.count * math.prod(group.shape[: group.view.batch_axes]), sizes)


def stored(group: ParamGroup) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The shape and logical axes the parameter is stored with (a block's weight: one row per layer)."""
    if is_stacked(group.path):
        return (group.count, *group.shape), (LAYER_AXIS, *group.axes)
    return group.shape, group.axes


def state_bytes(cfg: ModelConfig, sizes: dict[str, int], zero1: bool = False) -> StateBytes:
    """Per-device fp32 parameters, gradients (one fp32 copy: whole, and as ZeRO-1 scatters it) and
    optimizer moments (split over `data` too with `zero1`), plus the balancing biases (with the
    parameters) and their Adam moments (with the optimizer)."""
    params = optimizer = scattered = 0.0
    for g in param_groups(cfg):
        local = g.count * local_bytes(g, sizes)
        shard = local / optimizer_split(g, sizes, zero1)
        params += local
        scattered += shard
        optimizer += OPTIMIZER_STATES[g.optimizer] * shard
    biases = cfg.num_hidden_layers * (cfg.num_experts + 1) * 4  # replicated fp32 [E+1] per layer
    return StateBytes(params=params + biases, grads=params, optimizer=optimizer + 2 * biases,
                      scattered_grads=scattered)

