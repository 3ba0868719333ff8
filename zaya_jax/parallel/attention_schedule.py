"""CCA attention on a mesh with `tsp`, `tensor` or `sequence` > 1: one `shard_map` schedule.

Each device holds activations [B/batch, S/(tsp·sequence), H] and runs `model.cca.project` — the
single-device math — on whole KV groups. Its rows are one contiguous chunk of the sequence, or,
zigzagged (`mesh.zigzag`, the program's default), two: chunks p and 2D−1−p of 2D, so that causal
attention costs every device the same. `parallel/zigzag.chunks_of` says which; the schedule
stacks a device's chunks on the batch dimension, so the layer math sees independent rows.

- **Halo.** CCA's convolutions look (t0-1)+(t1-1) tokens back and the delayed values one token
  back, so each chunk takes the last rows of the chunk before it in the sequence from the
  device holding it (`zigzag.previous_chunk_routes`: contiguous, one `ppermute` from the left
  neighbour; zigzagged, the first chunks from the left neighbour's first, the second chunks
  from the right neighbour's second, and chunk D from chunk D−1 on its own device), each a
  `ppermute` of x, segment ids and positions. The layer runs on [look-back rows ‖ chunk] with
  each column's global index (so the masks of the convolutions and delayed values are right)
  and drops the look-back rows. The first chunk's look-back lies before the sequence and is
  masked as such.
- **Sequence (context) parallel.** K and V of every device are all-gathered along the sequence
  (tiled, in device order) and put back in sequence order (a static permutation of chunks when
  zigzagged), and each local chunk's queries attend with a causal mask offset by that chunk's
  place: one kernel call per local chunk, so the Pallas kernel skips the key blocks past each
  chunk's diagonal. Segment ids are gathered once per layer for the packed-document mask.
- **TSP.** Weights are stored 1/D on their hidden dimension (see `parallel/rules.py`). Heads
  are processed in buckets of one KV group: the bucket's weight slices are all-gathered over
  `tsp` (each a plain all-gather; only one bucket is resident at a time), local tokens are
  projected, the bucket's K/V all-gathered over the sequence, local queries attend and
  `attn @ Wo[bucket]` accumulates locally. No all-reduce: each device owns its output tokens.
- **Tensor (Megatron).** Query/KV heads (and Wo's rows) are split by whole KV groups; the small
  replicated weights (convs, values, biases) are cut to the device's groups; the partial outputs
  are summed with one `psum` over `tensor`.
- **fsdp** shards arrive gathered at the `shard_map` boundary (GSPMD inserts the all-gather).

Autodiff gives the backward: all-gathers transpose to reduce-scatters (weight gradients to
their owners, dK/dV to the chunk that made them), the look-back `ppermute` to the reverse one.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zaya_jax import kernels
from zaya_jax.model import cca as cca_math
from zaya_jax.model.segments import sequence_info
from zaya_jax.parallel import zigzag
from zaya_jax.parallel.axes import SEQUENCE_AXES
from zaya_jax.parallel.batch_map import axes_in_context, axis_size, is_pallas, row_spec, schedule_map, tensor_groups
from zaya_jax.parallel.rules import entry_axes, keep_axes, partition_spec, spec_axes

LAYOUT_AXES = ("tsp", "tensor", "sequence")  # any of these > 1 routes attention through this schedule


def active() -> bool:
    return bool(axes_in_context(LAYOUT_AXES))


def cca(params: dict, x, seq, cfg, zigzagged: bool = False):
    """The CCA layer's output [B, S, H] in x's dtype; `params` as `CCAttention.params()`.

    `zigzagged`: the rows are placed as `parallel/zigzag.py` says, two chunks per device."""
    mesh = jax.sharding.get_abstract_mesh()
    specs = {n: keep_axes(partition_spec(cca_math.PARAM_AXES[n], mesh, p.shape), ("tsp", "tensor"))
             for n, p in params.items()}
    segment_ids = seq.segment_ids if seq.segment_ids is not None else jnp.zeros(seq.positions.shape, jnp.int32)
    rows = row_spec()
    body = functools.partial(_local_cca, cfg=cfg, specs=specs, zigzagged=zigzagged)
    mapped = schedule_map(body, in_specs=(P(*rows, None), rows, rows, specs), out_specs=P(*rows, None),
                        check_vma=_tracks_vma(cfg))
    return mapped(x, segment_ids, seq.positions, params)


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """This device's sequence chunks: which global chunks (`zigzag.chunks_of`), and their size."""

    axes: tuple[str, ...]  # the sequence-like axes that split the sequence (empty: it is whole)
    devices: int
    zigzagged: bool
    size: int  # tokens per chunk
    rank: object  # this device's index over `axes` (traced; 0 when whole)

    @property
    def slots(self) -> int:
        return zigzag.chunks_per_device(self.zigzagged)

    def ids(self, device=None) -> tuple:
        return zigzag.chunks_of(self.rank if device is None else device, self.devices, self.zigzagged)


def _local_cca(x, segment_ids, positions, params, *, cfg, specs, zigzagged: bool):
    if _tracks_vma(cfg):
        params = varying_weights(params, specs)
    seq_axes = tuple(a for a in SEQUENCE_AXES if axis_size(a) > 1)
    devices = math.prod(axis_size(a) for a in seq_axes)
    on = zigzagged and bool(seq_axes)
    chunks = _Chunks(seq_axes, devices, on, x.shape[1] // (2 if on else 1),
                     jax.lax.axis_index(seq_axes) if seq_axes else 0)
    # A device's chunks are stacked on the batch dim, [chunks·B, size, ...]: the layer math sees
    # independent rows, each with its own look-back.
    x, segment_ids, positions = (zigzag.by_chunk(a, chunks.slots) for a in (x, segment_ids, positions))
    x, info, look_back = _with_look_back(x, segment_ids, positions, cfg, chunks)
    local_segments = info.segment_ids[:, look_back:]
    key_segments = _gather_keys(local_segments, chunks) if seq_axes else None

    def attend(q, k, v):
        if not seq_axes:
            return kernels.flash_attention(q, k, v, segment_ids=local_segments, backend=cfg.attention_kernel)
        k, v = (_gather_keys(t, chunks) for t in (k, v))
        return _offset_attention(q, k, v, local_segments, key_segments, chunks, cfg.attention_kernel)

    w, first, groups = _device_groups(params, specs, cfg, x.dtype)
    bucket = 1 if axis_size("tsp") > 1 else groups  # TSP: one KV group's weights resident at a time
    out = jnp.zeros((x.shape[0], chunks.size, x.shape[2]), jnp.float32)
    for start in range(0, groups, bucket):
        wb = gather_over_tsp(cca_math.select_groups(w, start, bucket, cfg),
                             {name: specs[src] for name, src in cca_math.SOURCE.items()})
        attn = attend(*cca_math.project(x, wb, info, cfg, first + start, drop=look_back))
        out = out + jnp.einsum("bsnd,ndh->bsh", attn, wb["wo"], preferred_element_type=jnp.float32)
    if axis_size("tensor") > 1:
        out = jax.lax.psum(out, "tensor")
    return zigzag.from_chunks(out, chunks.slots).astype(x.dtype)


def _gather_keys(t, chunks: _Chunks):
    """Every device's rows of t [slots·B, C, ...] all-gathered along the sequence, in sequence
    order (the attention kernels index keys by sequence position: that is how they skip blocks)."""
    t = jax.lax.all_gather(zigzag.from_chunks(t, chunks.slots), chunks.axes, axis=1, tiled=True)
    if not chunks.zigzagged:
        return t
    order = np.argsort(zigzag.chunk_order(chunks.devices, chunks.zigzagged))
    b = t.shape[0]
    return t.reshape(b, len(order), chunks.size, *t.shape[2:])[:, order].reshape(t.shape)


def _offset_attention(q, k, v, segments, key_segments, chunks: _Chunks, backend):
    """Each local chunk's queries against all keys, causally offset by the chunk's place in the
    sequence. Pallas shapes its loops by the offset, so it gets one static branch per device;
    the others take the traced offsets."""
    b = q.shape[0] // chunks.slots

    def on(device):
        return jnp.concatenate([
            kernels.flash_attention(q[s * b:(s + 1) * b], k, v, segment_ids=segments[s * b:(s + 1) * b],
                                    kv_segment_ids=key_segments, q_offset=chunk * chunks.size, backend=backend)
            for s, chunk in enumerate(chunks.ids(device))], axis=0)

    if not is_pallas("attention", backend):
        return on(None)
    return jax.lax.switch(chunks.rank, [functools.partial(on, d) for d in range(chunks.devices)])


def _with_look_back(x, segment_ids, positions, cfg, chunks: _Chunks):
    """[previous chunk's last rows ‖ chunk] of x for each local chunk, and its SequenceInfo with
    global indices (the first chunk's look-back rows lie before the sequence: nothing looks back
    into it)."""
    look_back = cca_math.look_back(cfg) if chunks.axes else 0
    if chunks.axes:
        x, segment_ids, positions = (jnp.concatenate([_from_previous(a[:, -look_back:], chunks), a], axis=1)
                                     for a in (x, segment_ids, positions))
    starts = jnp.stack([jnp.asarray(c, jnp.int32) * chunks.size for c in chunks.ids()])
    index = starts[:, None] - look_back + jnp.arange(chunks.size + look_back, dtype=jnp.int32)
    index = jnp.repeat(index, x.shape[0] // chunks.slots, axis=0)  # one row of indices per batch row
    return x, sequence_info(x.shape[:2], segment_ids, positions, cca_math.max_lag(cfg), index), look_back


def _tracks_vma(cfg) -> bool:
    return not is_pallas("attention", cfg.attention_kernel)  # Pallas outputs carry no vma


def _device_groups(params, specs, cfg, dtype):
    """Group-major weights cut to this device's KV groups: (weights, first group, group count)."""
    w = cca_math.group_major(params, cfg, dtype)
    first, groups = tensor_groups(cfg.num_key_value_heads)
    if axis_size("tensor") == 1:
        return w, first, groups
    replicated = [n for n, src in cca_math.SOURCE.items() if "tensor" not in spec_axes(specs[src])]
    return cca_math.select_groups(w, first, groups, cfg, replicated), first, groups


def gather_over_tsp(wb: dict, specs: dict) -> dict:
    """`wb` with each entry named in `specs` (entry → the PartitionSpec it is stored with) all-gathered
    over `tsp` on the dimensions stored 1/D there: a TSP bucket's weight slices made whole."""
    out = dict(wb)
    for name, spec in specs.items():
        for dim, entry in enumerate(spec):
            if "tsp" in entry_axes(entry):
                out[name] = jax.lax.all_gather(wb[name], "tsp", axis=dim, tiled=True)
    return out


def varying_weights(params: dict, specs: dict) -> dict:
    """Mark each weight as device-varying over the axes it is replicated on, so that the backward
    sums its gradient once at weight size, and not as the activation-sized broadcasts the weight
    enters (where autodiff would otherwise put that sum: an all-reduce of [B, S, heads, d])."""
    axes = axes_in_context()
    out = {}
    for name, leaf in params.items():
        missing = tuple(a for a in axes if a not in spec_axes(specs[name]))
        out[name] = _pvary(leaf, missing) if missing else leaf
    return out


def _pvary(x, axes):
    if hasattr(jax.lax, "pcast"):  # jax >= 0.8 spells it pcast(..., to="varying")
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def _from_previous(rows, chunks: _Chunks):
    """Each local chunk's rows [slots·B, n, ...] replaced by those of the chunk before it in the
    sequence (`zigzag.previous_chunk_routes`); the sequence's first chunk receives zeros."""
    b = rows.shape[0] // chunks.slots
    mine = [rows[s * b:(s + 1) * b] for s in range(chunks.slots)]
    got = [jnp.zeros_like(m) for m in mine]
    for route in zigzag.previous_chunk_routes(chunks.devices, chunks.zigzagged):
        source = mine[route.source_slot]
        if route.pairs:
            got[route.slot] = got[route.slot] + jax.lax.ppermute(source, chunks.axes, list(route.pairs))
        if route.local:
            here = jnp.isin(chunks.rank, jnp.asarray(route.local))
            got[route.slot] = jnp.where(here, source, got[route.slot])
    return jnp.concatenate(got, axis=0)
