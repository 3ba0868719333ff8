"""The cached forward that generation runs: new tokens against a per-layer cache of what came before.

A batch of prompts is left-padded to one length, so every row writes the cache at the same slot;
`Cache.start` is each row's first real slot, and a token's position is its slot minus that start
(as if its prompt were alone). Pad slots form a document of their own: no real token looks at
them (attention, convolution taps and the delayed value all stop at a document start), and they
look only at each other, so their values stay finite.

Each layer's cache holds exactly what it reads of the past. A linear-attention layer (hybrid
models) holds its recurrent state, fp32 [B, nk, g, dk, dv] per layer whatever the length: the new
tokens read it as the state entering their row (`kernels.linear_attention`'s `initial_state`) and
leave `linear_attention.carry_state`. A CCA layer holds

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
from zaya_jax.kernels import linear_attention as la
from zaya_jax.kernels import ops as kernel_ops
from zaya_jax.model import cca, linear_attn
from zaya_jax.model.layer_stack import each_layer
from zaya_jax.model.schedule import LOCAL
from zaya_jax.model.segments import sequence_info

PAD_SEGMENT, TOKEN_SEGMENT = 0, 1


@dataclasses.dataclass(frozen=True)
class Cache:
    look_back: jax.Array  # [L_C, B, K, H] each CCA layer's last K input rows (compute dtype)
    keys: jax.Array  # [L_C, B, T, nk, d]
    values: jax.Array  # [L_C, B, T, nk, d]
    linear_state: jax.Array  # [L_L, B, nk, g, d, d] each linear-attention layer's state, fp32
    start: jax.Array  # int32 [B]: each row's first real slot
    length: jax.Array  # int32 []: slots written so far

    @property
    def slots(self) -> int:
        return self.keys.shape[2]


FIELDS = {"C": ("look_back", "keys", "values"), "L": ("linear_state",)}  # each layer kind's part
jax.tree_util.register_dataclass(Cache, data_fields=[*FIELDS["C"], *FIELDS["L"], "start", "length"],
                                 meta_fields=[])


def empty_cache(cfg: ModelConfig, start: jax.Array, slots: int) -> Cache:
    """A cache of `slots` slots for rows whose first real token is at slot `start` [B]."""
    kinds, batch, d = cfg.layer_kinds, start.shape[0], cfg.head_dim
    dtype = jnp.dtype(cfg.compute_dtype)
    cca_layers, linear_layers = kinds.count("C"), kinds.count("L")
    kv = jnp.zeros((cca_layers, batch, slots, cfg.num_key_value_heads, d), dtype)
    return Cache(look_back=jnp.zeros((cca_layers, batch, cca.look_back(cfg), cfg.hidden_size), dtype),
                 keys=kv, values=kv,
                 linear_state=jnp.zeros((linear_layers, batch, cfg.num_key_value_heads, cfg.kv_groups, d, d),
                                        jnp.float32),
                 start=start.astype(jnp.int32), length=jnp.zeros((), jnp.int32))


def cache_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes a CCA layer's cache grows by per slot: a key and a value per KV head (a linear layer's
    state does not grow)."""
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
    written = {kind: [] for kind in FIELDS}
    blocks, mixers = model.layers.split(cfg)
    for kind, j, block, mixer in each_layer(blocks, mixers, cfg.layer_kinds):
        mine = tuple(getattr(cache, name)[j] for name in FIELDS[kind])
        cached = CACHED[kind](mixer, mine, cache, segments)
        h, router_state, _ = block(cached, h, router_state, None, dtype)
        written[kind].append(cached.out)
    updates = {name: jnp.stack(parts) for kind, layers in written.items() if layers
               for name, parts in zip(FIELDS[kind], zip(*layers))}
    hidden = model.final_norm(h[:, -1:], jnp.float32)
    return model.logits(hidden)[:, 0], dataclasses.replace(cache, **updates, length=cache.length + new)


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


class _CachedLinearAttention:
    """A linear-attention layer run from its cached state, in the place `Block` calls its mixer; the
    state leaving the new tokens is left in `out`."""

    def __init__(self, layer: linear_attn.LinearAttention, layer_cache: tuple, cache: Cache, segments: jax.Array):
        self.layer, (self.state,), self.segments = layer, layer_cache, segments
        self.out = None

    def __call__(self, x: jax.Array, seq, schedule=LOCAL) -> jax.Array:
        del seq, schedule
        cfg = self.layer.cfg
        w = linear_attn.group_major(self.layer.params(), cfg, x.dtype)
        q, k, v = linear_attn.project(x, w, cfg)
        # Every row's real tokens are one document that the state continues; pad tokens read none of it.
        owner = jnp.full(x.shape[:1], TOKEN_SEGMENT, jnp.int32)
        attn = kernel_ops.linear_attention(q, k, v, self.segments, log_decay=w["log_decay"], initial_state=self.state,
                                           initial_segment=owner, backend="xla")
        self.out = (la.carry_state(self.state, k, v, self.segments, w["log_decay"], cfg.num_attention_heads),)
        return linear_attn.output(attn, x, w, cfg).astype(x.dtype)


CACHED = {"C": _CachedAttention, "L": _CachedLinearAttention}
