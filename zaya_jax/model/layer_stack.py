"""The block stack: L identical blocks stored as one module with a leading `layers` axis, run as one scan.

Every block variable is stacked along a leading logical axis named `layers` (the rules table
never splits it), so the training state holds one array per kind of weight (`layers/attn/wq`,
[L, H, nq, d]) and the forward is one `lax.scan` whose body — one block, under the remat
policy — is traced and compiled once, whatever the depth. `scan=False` runs the same body
unrolled over the layers: for debugging, at a compile time that grows with depth. (`unroll`
keeps the scan but compiles several blocks per iteration.)

Layer 0 has no EDA: its incoming router state is zeros, so its row of the stacked `eda_scale`
is inert (it stays 1.0 and its gradient is exactly 0) and has no place in the per-layer model
(HF has no `router_states_scale` in layer 0).

The per-layer names `layers/{i}/...` are the model's interchange form (Orbax model
checkpoints, HF conversion, `zaya_jax.load`); `per_layer`, `layer_entries` and `stack_entries`
convert between it and the stacked form, one layer at a time where streaming needs it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

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


def init_stack(make_block: Callable[[nnx.Rngs], nnx.Module], key: jax.Array, layers: int) -> nnx.Module:
    """`layers` blocks from `make_block(rngs)`, one key each, initialised by one vmapped trace (the
    init's cost does not grow with depth) into one module whose variables lead with `layers`."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make_block(nnx.Rngs(0))))
    state = jax.vmap(lambda k: nnx.state(make_block(nnx.Rngs(k))))(jax.random.split(key, layers))
    stacked = []
    for path, var in state.flat_state():
        axes = logical_axes(var)
        stacked.append((path, var if axes is None else var.replace(var.get_value(), logical_axes=(LAYER_AXIS, *axes))))
    return nnx.merge(graphdef, nnx.State.from_flat_path(stacked))


def run_blocks(blocks: nnx.Module, h: jax.Array, first_router_state: jax.Array, step: Callable, *,
               remat: str, scan: bool = True, unroll: int = 1):
    """Thread (h, router state) through every block of the stack: `step(block, h, router_state)`
    → (h, router_state, routing). Returns h and the per-layer expert choices [L, B, S].

    `unroll` blocks run per scan iteration: the block is still traced once, XLA compiles that
    many copies and may fuse across them (worth it for shallow models, where a loop iteration's
    overhead shows)."""
    graphdef, state = nnx.split(blocks)

    def body(carry, layer):
        h, router_state = carry
        h, router_state, routing = step(nnx.merge(graphdef, layer), h, router_state)
        return (h, router_state), routing.expert

    body = checkpointed(body, remat, in_scan=scan and unroll == 1)  # unrolled copies need the CSE barrier
    carry = (h, first_router_state)
    if scan:
        carry, choices = jax.lax.scan(body, carry, state, unroll=unroll)
        return carry[0], choices
    choices = []
    for i in range(depth(state)):
        carry, chosen = body(carry, jax.tree.map(lambda x: x[i], state))
        choices.append(chosen)
    return carry[0], jnp.stack(choices)


def depth(state) -> int:
    return jax.tree.leaves(state)[0].shape[0]


def is_stacked(path: str) -> bool:
    return path.startswith(PREFIX)


def _within_block(path: str) -> str:
    """`layers/attn/wq` → `attn/wq`."""
    return path[len(PREFIX):]


def _inert(rest: str, layer: int) -> bool:
    return layer == 0 and rest in INERT_IN_LAYER_0


def layer_entries(stacked: Mapping[str, Any], layer: int, take: Callable = lambda value, i: value[i]) -> dict:
    """Layer `layer`'s per-layer entries `layers/{layer}/...` of a stacked flat map; `take(value, i)`
    cuts one layer out (an array's row by default; a shape's tail, a device fetch...)."""
    rests = {path: _within_block(path) for path in stacked if is_stacked(path)}
    return {f"{PREFIX}{layer}/{rest}": take(stacked[path], layer)
            for path, rest in rests.items() if not _inert(rest, layer)}


def per_layer(stacked: Mapping[str, Any], layers: int, take: Callable = lambda value, i: value[i]) -> dict:
    """A stacked flat map in the per-layer form: the unstacked entries, then layer 0, 1, ..."""
    out = {k: v for k, v in stacked.items() if not is_stacked(k)}
    for i in range(layers):
        out.update(layer_entries(stacked, i, take))
    return out


def stack_entries(arrays: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Per-layer arrays → the stacked entries of `shapes` (stacked paths → shapes, leading L);
    layer 0's inert entries are filled in. Unstacked entries pass through."""
    out = {}
    for path, shape in shapes.items():
        if not is_stacked(path):
            out[path] = arrays[path]
            continue
        rest = _within_block(path)
        rows = [np.full(shape[1:], INERT_VALUE, np.float32) if _inert(rest, i) else np.asarray(arrays[f"{PREFIX}{i}/{rest}"])
                for i in range(shape[0])]
        out[path] = np.stack(rows)
    return out
