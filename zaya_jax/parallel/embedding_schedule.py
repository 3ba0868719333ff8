"""The embedding lookup over a mesh: each device gets its own tokens' rows, whole, from a split table.

The rules split the table [V, H] on its hidden dimension over fsdp and tsp and on its
vocabulary over tensor, while the token ids [B, S] are split over the batch and sequence axes.
GSPMD's gather cannot move from the first layout to the second: it gathers the whole global
micro-batch of embeddings, [B, S, H] fp32, onto every device ("involuntary full
rematerialization"; 96 MiB per device at hidden 1536 and 8 × 2048 tokens, read off the
buffers of a step compiled for H100s), and inside the data replicas' loop XLA aborted on it (jax 0.10), so the table was
gathered whole instead.

Here every collective is written out, in a `shard_map` with a `custom_vjp` (as `train/loss.py`'s
vocabulary-parallel loss), so no autodiff convention decides a gradient's scale:

* forward: gather the token ids (int32, small) over the axes that split the hidden dimension,
  look up the group's rows in this device's slice of the table (masked to its vocabulary slice
  and summed over `tensor` when that splits the vocabulary), then `all_to_all` back along those
  axes, so each device ends with its own tokens' rows, every hidden column: moved bytes and held
  bytes are one micro-batch's rows per device, never the global batch's.
* backward: the `all_to_all`s reversed, a scatter-add into this device's table slice, summed over
  the other devices that hold the same slice (the token axes that do not split it).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.axes import BATCH_AXES, SEQUENCE_AXES
from zaya_jax.parallel.batch_map import axes_in_context, axis_size, row_spec, schedule_map
from zaya_jax.parallel.rules import entry_axes, partition_spec


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """The rows of `table` [V, H] for token `ids` [B, S]: [B, S, H], laid out like the ids' rows."""
    vocab, hidden = _table_axes(table)
    if not vocab and not hidden:
        return jnp.take(table, ids, axis=0)
    return _lookup(vocab, hidden, table.shape[0], table, ids)


def _table_axes(table) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The split axes (in context) of the table's vocabulary and hidden dimensions, major first."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), ()
    live = set(axes_in_context())
    spec = partition_spec(("vocab", "embed"), mesh, table.shape)
    vocab, hidden = (tuple(a for a in entry_axes(entry) if a in live) for entry in spec)
    dims = [_token_dim(a) for a in hidden if a in BATCH_AXES + SEQUENCE_AXES]
    if len(dims) != len(hidden) or len(set(dims)) != len(dims):
        raise ValueError(f"the embedding's hidden dimension is split over {hidden}; the lookup needs each "
                         "of them to split a different dimension of the tokens (one batch, one sequence axis)")
    return vocab, hidden


def _token_dim(axis: str) -> int:
    """The ids' dimension an axis splits: the batch (0) or the sequence (1)."""
    return 0 if axis in BATCH_AXES else 1


def _specs(vocab, hidden):
    rows = row_spec()
    table = P(vocab or None, hidden or None)
    return rows, table


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _lookup(vocab, hidden, table_rows, table, ids):
    return _lookup_fwd(vocab, hidden, table_rows, table, ids)[0]


def _lookup_fwd(vocab, hidden, table_rows, table, ids):
    rows, table_spec = _specs(vocab, hidden)

    def forward(table, ids):
        group = _group_ids(ids, hidden)
        local, hit = _in_slice(group, table.shape[0], vocab)
        found = jnp.take(table, local, axis=0)
        if vocab:  # each row from the rank whose slice holds it
            found = jax.lax.psum(found * hit[..., None].astype(found.dtype), vocab)
        for axis in reversed(hidden):  # the minor axis first: its slices are adjacent columns
            found = jax.lax.all_to_all(found, axis, _token_dim(axis), 2, tiled=True)
        return found

    out = schedule_map(forward, in_specs=(table_spec, rows), out_specs=P(*rows, None), check_vma=False)(table, ids)
    return out, ids


def _lookup_bwd(vocab, hidden, table_rows, ids, g):
    rows, table_spec = _specs(vocab, hidden)
    # The devices holding the same slice of the table: the token axes that do not split it.
    shared = tuple(a for entry in rows for a in entry_axes(entry) if a not in hidden)
    local_rows = table_rows // math.prod(axis_size(a) for a in vocab)

    def backward(g, ids):
        for axis in hidden:  # the forward's all_to_alls, reversed
            g = jax.lax.all_to_all(g, axis, 2, _token_dim(axis), tiled=True)
        group = _group_ids(ids, hidden)
        local, hit = _in_slice(group, local_rows, vocab)
        if vocab:
            g = g * hit[..., None].astype(g.dtype)
        d_table = jnp.zeros((local_rows, g.shape[-1]), g.dtype).at[local.reshape(-1)].add(g.reshape(-1, g.shape[-1]))
        return jax.lax.psum(d_table, shared) if shared else d_table

    d_table = schedule_map(backward, in_specs=(P(*rows, None), rows), out_specs=table_spec,
                           check_vma=False)(g, ids)
    return d_table, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _group_ids(ids, hidden):
    """The ids of every device that holds another hidden slice of these rows, in axis order."""
    for axis in hidden:
        ids = jax.lax.all_gather(ids, axis, axis=_token_dim(axis), tiled=True)
    return ids


def _in_slice(ids, rows: int, vocab):
    """Row indices into this device's vocabulary slice of `rows` rows, and which ids fall in it."""
    if not vocab:
        return ids, jnp.ones(ids.shape, bool)
    local = ids - jax.lax.axis_index(vocab) * rows  # the rank over the vocabulary axes, major first
    hit = (local >= 0) & (local < rows)
    return jnp.where(hit, local, 0), hit
