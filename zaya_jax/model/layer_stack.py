"""The layer stack: every layer's weights stored stacked along a leading `layers` axis, run as one scan.

Every variable is stacked along a leading logical axis named `layers` (the rules table never
splits it), so the training state holds one array per kind of weight. The parts every layer has
(norms, residual scales, the MoE) are stacked over all L layers (`layers/moe/router/down`,
[L, ...]); each token mixer over the layers of its kind (`MIXERS`: CCA's `layers/attn/wq`
[L_C, H, nq, d], linear attention's `layers/linear_attn/wq` [L_L, ...]; `model.layer_pattern`).
The forward is one `lax.scan` over the pattern's repeating unit, whose body — one unit of
blocks, under the remat policy — is traced and compiled once, whatever the depth. `scan=False`
runs the same body unrolled: for debugging, at a compile time that grows with depth. (`unroll`
keeps the scan but compiles several units per iteration.)

Layer 0 has no EDA: its incoming router state is zeros, so its row of the stacked `eda_scale`
is inert (it stays 1.0 and its gradient is exactly 0) and has no place in the per-layer model
(HF has no `router_states_scale` in layer 0).

The per-layer names `layers/{i}/...` are the model's interchange form (Orbax model
checkpoints, HF conversion, `zaya_jax.load`); `per_layer`, `layer_entries` and `stack_entries`
convert between it and the stacked form, one layer at a time where streaming needs it; a layer
has the mixer of its kind only (`layers/3/attn/...` or `layers/3/linear_attn/...`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.model.params import logical_axes
from zaya_jax.model.remat import checkpointed

PREFIX = "layers/"
LAYER_AXIS = "layers"
INERT_IN_LAYER_0 = ("moe/router/eda_scale",)  # present in the stack, absent from the per-layer model
INERT_VALUE = 1.0
# Each layer kind's token mixer (`ModelConfig.layer_kinds`): the attribute its stack is stored under.
MIXERS = {"C": "attn", "L": "linear_attn"}
MIXER_KINDS = {attr: kind for kind, attr in MIXERS.items()}


def init_stack(make_block: Callable[[nnx.Rngs], nnx.Module], key: jax.Array, layers: int) -> nnx.Module:
    """`layers` blocks from `make_block(rngs)`, one key each, initialised by one vmapped trace (the
    init's cost does not grow with depth) into one module whose variables lead with `layers`."""
    graphdefs = []  # the block's structure, kept from the one trace (a second one cost as much again)

    def one(k):
        graphdef, state = nnx.split(make_block(nnx.Rngs(k)))
        graphdefs.append(graphdef)
        return state

    state = jax.vmap(one)(jax.random.split(key, layers))
    graphdef = graphdefs[0]
    stacked = []
    for path, var in state.flat_state():
        axes = logical_axes(var)
        stacked.append((path, var if axes is None else var.replace(var.get_value(), logical_axes=(LAYER_AXIS, *axes))))
    return nnx.merge(graphdef, nnx.State.from_flat_path(stacked))


def run_blocks(blocks: tuple, mixers: Mapping[str, tuple], kinds: str, h: jax.Array,
               first_router_state: jax.Array, step: Callable, *, remat: str, scan: bool = True, unroll: int = 1):
    """Thread (h, router state) through every layer: `step(block, mixer, h, router_state)` →
    (h, router_state, routing). `blocks` is (one block's graphdef, the state stacked over all
    layers), `mixers[kind]` (graphdef, state stacked over the layers of that kind; `kinds`, one
    letter per layer). Returns h and every layer's `Routing`, stacked ([L, B, S] choices, [L, B, S, E+1]
    router probabilities).

    The scan runs over the repeating unit of the layer pattern (one block for an all-CCA model);
    `unroll` units run per scan iteration: the unit is still traced once, XLA compiles that many
    copies and may fuse across them (worth it for shallow models, where a loop iteration's
    overhead shows)."""
    unit = repeating_unit(kinds)
    units = len(kinds) // len(unit)
    block_def, block_state = blocks
    split = dict(mixers)
    xs = (_by_unit(block_state, len(unit)), {kind: _by_unit(state, unit.count(kind)) for kind, (_, state) in split.items()})

    def body(carry, unit_state):
        (h, router_state), (block_rows, mixer_rows) = carry, unit_state
        seen = dict.fromkeys(split, 0)
        chosen = []
        for j, kind in enumerate(unit):
            block = nnx.merge(block_def, _layer(block_rows, j, len(unit)))
            mixer = nnx.merge(split[kind][0], _layer(mixer_rows[kind], seen[kind], unit.count(kind)))
            seen[kind] += 1
            h, router_state, routing = step(block, mixer, h, router_state)
            chosen.append(routing)
        return (h, router_state), _stack(chosen)

    body = checkpointed(body, remat, in_scan=scan and unroll == 1)  # unrolled copies need the CSE barrier
    carry = (h, first_router_state)
    if scan:
        carry, routing = jax.lax.scan(body, carry, xs, unroll=unroll)
    else:
        per_unit = []
        for u in range(units):
            carry, chosen = body(carry, _row(xs, u))
            per_unit.append(chosen)
        routing = _stack(per_unit)
    return carry[0], jax.tree.map(lambda a: a.reshape(len(kinds), *a.shape[2:]), routing)


def each_layer(blocks: tuple, mixers: Mapping[str, tuple], kinds: str):
    """(kind, index among the layers of that kind, block, mixer) for every layer in order, unstacked
    one at a time (for paths that walk the layers in Python, such as generation's cached step),
    from the same (graphdef, stacked state) pairs as `run_blocks`."""
    block_def, block_state = blocks
    seen = dict.fromkeys(mixers, 0)
    for i, kind in enumerate(kinds):
        mixer_def, mixer_state = mixers[kind]
        j = seen[kind]
        seen[kind] += 1
        yield kind, j, nnx.merge(block_def, _row(block_state, i)), nnx.merge(mixer_def, _row(mixer_state, j))


def _stack(trees: list):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def repeating_unit(kinds: str) -> str:
    """The shortest pattern whose repeats make `kinds` ("LLLCLLLC" → "LLLC"; "CCCC" → "C")."""
    for size in range(1, len(kinds) + 1):
        if len(kinds) % size == 0 and kinds[:size] * (len(kinds) // size) == kinds:
            return kinds[:size]
    return kinds


def _by_unit(state, per_unit: int):
    """Stacked leaves [n, ...] → [n / per_unit, per_unit, ...] (the layers axis is never split: free);
    unchanged with one layer per unit, so the scan hands the body each layer's own slice of the stack."""
    if per_unit == 1:
        return state
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // per_unit, per_unit, *x.shape[1:]), state)


def _layer(rows, j: int, per_unit: int):
    """The j-th layer of a unit's rows. With one layer per unit the rows are the scan's own slice of
    the stack, which the backward reads where it lies; a slice taken here would be saved for the
    backward instead: a copy of every layer's weights that a matmul's backward reads."""
    return rows if per_unit == 1 else _row(rows, j)


def _row(state, i: int):
    return jax.tree.map(lambda x: x[i], state)


def is_stacked(path: str) -> bool:
    return path.startswith(PREFIX)


def _within_block(path: str) -> str:
    """`layers/attn/wq` → `attn/wq`."""
    return path[len(PREFIX):]


def _inert(rest: str, layer: int) -> bool:
    return layer == 0 and rest in INERT_IN_LAYER_0


def _kind_of(rest: str) -> str | None:
    """The layer kind a stacked entry belongs to (a mixer's), or None: every layer has it."""
    return MIXER_KINDS.get(rest.split("/", 1)[0])


def entry_kind(path: str) -> str | None:
    """The layer kind whose layers alone hold the stacked entry `path` (a mixer's:
    `layers/linear_attn/wq` → "L"), or None: every layer holds it."""
    return _kind_of(_within_block(path))


def entry_layers(path: str, kinds: str) -> int:
    """The stacked entry's leading size: the layers of its kind among `kinds` (all, for the parts
    every layer has)."""
    kind = entry_kind(path)
    return len(kinds) if kind is None else kinds.count(kind)


def _row_of(rest: str, layer: int, kinds: str) -> int | None:
    """The row of the stacked entry `rest` that holds layer `layer`'s value, or None if it has none."""
    kind = _kind_of(rest)
    if kind is None:
        return None if _inert(rest, layer) else layer
    return kinds[:layer].count(kind) if kinds[layer] == kind else None


def layer_entries(stacked: Mapping[str, Any], layer: int, kinds: str, take: Callable = lambda value, i: value[i]) -> dict:
    """Layer `layer`'s per-layer entries `layers/{layer}/...` of a stacked flat map (`kinds`: the
    layer kinds, `ModelConfig.layer_kinds`); `take(value, row)` cuts one row out (an array's row by
    default; a shape's tail, a device fetch...)."""
    out = {}
    for path in stacked:
        if not is_stacked(path):
            continue
        rest = _within_block(path)
        row = _row_of(rest, layer, kinds)
        if row is not None:
            out[f"{PREFIX}{layer}/{rest}"] = take(stacked[path], row)
    return out


def per_layer(stacked: Mapping[str, Any], kinds: str, take: Callable = lambda value, i: value[i]) -> dict:
    """A stacked flat map in the per-layer form: the unstacked entries, then layer 0, 1, ..."""
    out = {k: v for k, v in stacked.items() if not is_stacked(k)}
    for i in range(len(kinds)):
        out.update(layer_entries(stacked, i, kinds, take))
    return out


def stack_entries(arrays: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], kinds: str) -> dict[str, np.ndarray]:
    """Per-layer arrays → the stacked entries of `shapes` (stacked paths → shapes, leading: the
    layers that have the entry); layer 0's inert entries are filled in. Unstacked entries pass through."""
    out = {}
    for path, shape in shapes.items():
        if not is_stacked(path):
            out[path] = arrays[path]
            continue
        rest = _within_block(path)
        kind = _kind_of(rest)
        layers = [i for i, k in enumerate(kinds) if kind is None or k == kind]
        rows = [np.full(shape[1:], INERT_VALUE, np.float32) if _inert(rest, i) else np.asarray(arrays[f"{PREFIX}{i}/{rest}"])
                for i in layers]
        out[path] = np.stack(rows)
    return out
