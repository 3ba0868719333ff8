"""The cached forward that generation runs: new tokens against a per-layer cache of what came before.

A batch of prompts is left-padded to one length, so every row writes the cache at the same slot;
`Cache.start` is each row's first real slot, and a token's position is its slot minus that start
(as if its prompt were alone). Pad slots form a document of their own: no real token looks at
them (attention, convolution taps and the delayed value all stop at a document start), and they
look only at each other, so their values stay finite.

Per CCA layer the cache holds exactly what the layer reads of the past:

- its keys and values, [B, T, nk, d] for T slots;
- its look-back: the last `cca.look_back(cfg)` rows of its input (the normed hidden state). The
  layer's convolutions and delayed value are recomputed over [look-back ‖ new rows] by the same
  `cca.project` the training forward runs (`drop` cuts the look-back rows before the norms), so
  the cached path shares the model's math instead of restating it. That costs the look-back's
  projections again per step (2 rows at ZAYA1's kernel sizes) and keeps [B, 2, H] instead of
  the convolutions' intermediate states.

`step` runs S new tokens per row: the prompt (prefill, S = its length) or one token (decode).
Attention is the `xla` backend in its sequence-sharded form (queries at slot `length` onward
against every slot; `kernels.flash_attention`), whose offset may be traced, so one compiled
program serves every decode step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zaya_jax import kernels
from zaya_jax.config import ModelConfig
from zaya_jax.errors import ZayaError
from zaya_jax.model import cca
from zaya_jax.model.layer_stack import each_layer
from zaya_jax.model.schedule import LOCAL
from zaya_jax.model.segments import sequence_info

PAD_SEGMENT, TOKEN_SEGMENT = 0, 1


@dataclasses.dataclass(frozen=True)
class Cache:
    look_back: jax.Array  # [L_C, B, K, H] each CCA layer's last K input rows (compute dtype)
    keys: jax.Array  # [L_C, B, T, nk, d]
    values: jax.Array  # [L_C, B, T, nk, d]
    start: jax.Array  # int32 [B]: each row's first real slot
    length: jax.Array  # int32 []: slots written so far

    @property
    def slots(self) -> int:
        return self.keys.shape[2]


jax.tree_util.register_dataclass(Cache, data_fields=["look_back", "keys", "values", "start", "length"],
                                 meta_fields=[])


def check_supported(cfg: ModelConfig) -> None:
    if "L" in cfg.layer_kinds:
        raise ZayaError(f"generation runs CCA layers only; this model's layer pattern {cfg.layer_pattern!r} "
                        "has linear-attention layers")


def empty_cache(cfg: ModelConfig, start: jax.Array, slots: int) -> Cache:
    """A cache of `slots` slots for rows whose first real token is at slot `start` [B]."""
    check_supported(cfg)
    layers, batch = len(cfg.layer_kinds), start.shape[0]
    dtype = jnp.dtype(cfg.compute_dtype)
    kv = jnp.zeros((layers, batch, slots, cfg.num_key_value_heads, cfg.head_dim), dtype)
    return Cache(look_back=jnp.zeros((layers, batch, cca.look_back(cfg), cfg.hidden_size), dtype),
                 keys=kv, values=kv, start=start.astype(jnp.int32), length=jnp.zeros((), jnp.int32))


def cache_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes the cache grows by per slot and layer: a key and a value per KV head."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize


def step(model, input_ids: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """fp32 logits [B, V] of each row's last new token, and the cache with `input_ids` [B, S] written
    at slots `cache.length` onward."""
    cfg, dtype = model.cfg, model.compute_dtype
    batch, new = input_ids.shape
    if int(cache.slots) < new:
        raise ZayaError(f"{new} new tokens do not fit a cache of {cache.slots} slots")
    h = model.embed(input_ids, LOCAL)
    router_state = jnp.zeros((batch, new, cfg.router_hidden_size), jnp.float32)
    slot = cache.length + jnp.arange(new, dtype=jnp.int32)
    segments = jnp.where(slot[None, :] >= cache.start[:, None], TOKEN_SEGMENT, PAD_SEGMENT)
    look_back, keys, values = [], [], []
    blocks, mixers = model.layers.split(cfg)
    for i, _, block, mixer in each_layer(blocks, mixers, cfg.layer_kinds):
        cached = _CachedAttention(mixer, jax.tree.map(lambda a, i=i: a[i], _layer_view(cache)), cache, segments)
        h, router_state, _ = block(cached, h, router_state, None, dtype)
        look_back.append(cached.out[0])
        keys.append(cached.out[1])
        values.append(cached.out[2])
    hidden = model.final_norm(h[:, -1:], jnp.float32)
    new_cache = dataclasses.replace(cache, look_back=jnp.stack(look_back), keys=jnp.stack(keys),
                                    values=jnp.stack(values), length=cache.length + new)
    return model.logits(hidden)[:, 0], new_cache


def _layer_view(cache: Cache) -> tuple:
    return cache.look_back, cache.keys, cache.values


class _CachedAttention:
    """A CCA layer run against its slice of the cache, in the place `Block` calls its mixer; the
    layer's new (look-back, keys, values) are left in `out`."""

    def __init__(self, layer: cca.CCAttention, layer_cache: tuple, cache: Cache, segments: jax.Array):
        self.layer, self.layer_cache, self.cache, self.segments = layer, layer_cache, cache, segments
        self.out = None

    def __call__(self, x: jax.Array, seq, schedule=LOCAL) -> jax.Array:
        del seq, schedule  # the cache's slots say where each row's document starts
        layer, cfg = self.layer, self.layer.cfg
        look_back, keys, values = self.layer_cache
        rows = look_back.shape[1]
        window = jnp.concatenate([look_back.astype(x.dtype), x], axis=1)
        # Each window row's position in its document; a negative one is before the document
        # (padding, or before the prompt): `sequence_info` takes row t-j to exist where index - j >= 0.
        slot = self.cache.length - rows + jnp.arange(window.shape[1], dtype=jnp.int32)
        position = slot[None, :] - self.cache.start[:, None]
        seq = sequence_info(window.shape[:2], None, jnp.maximum(position, 0), cca.max_lag(cfg), index=position)
        w = cca.group_major(layer.params(), cfg, x.dtype)
        q, k, v = cca.project(window, w, seq, cfg, first_group=0, drop=rows)
        at = (0, self.cache.length, 0, 0)
        keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype), at)
        values = jax.lax.dynamic_update_slice(values, v.astype(values.dtype), at)
        key_segments = jnp.where(jnp.arange(keys.shape[1])[None, :] >= self.cache.start[:, None],
                                 TOKEN_SEGMENT, PAD_SEGMENT)
        out = kernels.flash_attention(q, keys.astype(q.dtype), values.astype(q.dtype), segment_ids=self.segments,
                                      kv_segment_ids=key_segments, q_offset=self.cache.length, backend="xla")
        self.out = (window[:, -rows:], keys, values)
        return jnp.einsum("bsnd,ndh->bsh", out, w["wo"])
