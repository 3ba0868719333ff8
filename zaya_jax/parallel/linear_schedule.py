"""Linear-attention layers on a mesh with `tsp`, `tensor` or `sequence` > 1: one `shard_map` schedule.

Each device holds activations [B/batch, S/(tsp·sequence), H] (its sequence chunks: one, or two
under zigzag) and runs `model.linear_attn`'s math — the single-device functions — on whole KV groups:

- **Sequence (LASP-2).** Every device projects its own tokens; the heads' memory states are
  exchanged by `parallel/lasp2.py`: one all-gather of the states of every chunk and head (the
  heads of all buckets together), the decayed prefix of the chunks before each local chunk, and
  the linear-attention kernel from that state. No K/V moves. In a hybrid model the CCA layers keep
  their own schedule (`attention_schedule`: K/V all-gathered), which makes the pair LASP-2H.
- **TSP.** Weights are stored 1/D on their hidden dimension. Heads go in buckets of one KV group:
  the bucket's q/k/v weight slices are all-gathered over `tsp` and its local tokens projected; then
  one LASP-2 exchange over `tsp` (and `sequence`) for every bucket's heads; then each bucket's
  gate/norm/Wo slices are all-gathered and `y @ Wo[bucket]` accumulates locally. Each weight is
  gathered once, one bucket resident at a time. No all-reduce.
- **Tensor (Megatron).** Query/KV heads (and Wo's rows, the gate's columns) are split by whole KV
  groups; the partial outputs are summed with one `psum` over `tensor`.
- **fsdp** shards arrive gathered at the `shard_map` boundary (GSPMD inserts the all-gather).

Autodiff gives the backward: the weight all-gathers transpose to reduce-scatters, the states'
all-gather to one reduce-scatter.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zaya_jax.kernels import ops as kernel_ops
from zaya_jax.model import linear_attn as lin
from zaya_jax.parallel.attention_schedule import gather_over_tsp, varying_weights
from zaya_jax.parallel.axes import SEQUENCE_AXES
from zaya_jax.parallel.batch_map import axis_size, is_pallas, row_spec, schedule_map, tensor_groups
from zaya_jax.parallel.lasp2 import lasp2
from zaya_jax.parallel.rules import keep_axes, partition_spec, spec_axes

PROJECTIONS = ("wq", "wk", "wv", "log_decay")  # what a bucket needs before the exchange
OUTPUTS = ("wg", "out_norm", "wo")  # and after it


def linear(params: dict, x, seq, cfg, zigzagged: bool = False):
    """The linear-attention layer's output [B, S, H] in x's dtype; `params` as `LinearAttention.params()`."""
    mesh = jax.sharding.get_abstract_mesh()
    specs = {n: keep_axes(partition_spec(lin.PARAM_AXES[n], mesh, p.shape), ("tsp", "tensor"))
             for n, p in params.items()}
    segment_ids = seq.segment_ids if seq.segment_ids is not None else jnp.zeros(x.shape[:2], jnp.int32)
    rows = row_spec()
    body = functools.partial(_local, cfg=cfg, specs=specs, zigzagged=zigzagged)
    mapped = schedule_map(body, in_specs=(P(*rows, None), rows, specs), out_specs=P(*rows, None),
                        check_vma=_tracks_vma(cfg))
    return mapped(x, segment_ids, params)


def _local(x, segment_ids, params, *, cfg, specs, zigzagged: bool):
    if _tracks_vma(cfg):
        params = varying_weights(params, specs)
    w, groups = _device_groups(params, specs, cfg, x.dtype)
    bucket = 1 if axis_size("tsp") > 1 else groups  # TSP: one KV group's weights resident at a time
    starts = range(0, groups, bucket)
    projected = [lin.project(x, _gather_bucket(lin.select_groups(w, s, bucket, cfg, PROJECTIONS), specs, PROJECTIONS),
                             cfg) for s in starts]
    q, k, v = (jnp.concatenate(t, axis=2) for t in zip(*projected))
    attn = _attend(q, k, v, segment_ids, w["log_decay"], cfg, zigzagged)
    g = cfg.kv_groups
    out = jnp.zeros(x.shape, jnp.float32)
    for s in starts:
        wb = _gather_bucket(lin.select_groups(w, s, bucket, cfg, OUTPUTS), specs, OUTPUTS)
        out = out + lin.output(attn[:, :, s * g:(s + bucket) * g], x, wb, cfg)
    if axis_size("tensor") > 1:
        out = jax.lax.psum(out, "tensor")
    return out.astype(x.dtype)


def _attend(q, k, v, segment_ids, log_decay, cfg, zigzagged: bool):
    seq_axes = tuple(a for a in SEQUENCE_AXES if axis_size(a) > 1)
    if not seq_axes:
        return kernel_ops.linear_attention(q, k, v, segment_ids, log_decay=log_decay, backend=cfg.linear_kernel)
    devices = math.prod(axis_size(a) for a in seq_axes)
    return lasp2(q, k, v, segment_ids, axis=seq_axes, devices=devices, zigzag=zigzagged, log_decay=log_decay,
                 backend=cfg.linear_kernel)


def _tracks_vma(cfg) -> bool:
    return not is_pallas("linear_attention", cfg.linear_kernel)  # Pallas outputs carry no vma


def _device_groups(params, specs, cfg, dtype):
    """Group-major weights cut to this device's KV groups (those `tensor` does not split already,
    and the decay, are cut here): (weights, group count)."""
    w = lin.group_major(params, cfg, dtype)
    first, groups = tensor_groups(cfg.num_key_value_heads)
    if axis_size("tensor") == 1:
        return w, groups
    whole = [n for n in lin.GROUP_AXES if n not in specs or "tensor" not in spec_axes(specs[n])]
    return lin.select_groups(w, first, groups, cfg, whole), groups


def _gather_bucket(wb: dict, specs: dict, names) -> dict:
    """The bucket's slices of `names` made whole over `tsp` (the decay is no weight: never split)."""
    return gather_over_tsp(wb, {name: specs[name] for name in names if name in specs})
