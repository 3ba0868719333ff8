"""Linear attention, the `L` layers of a hybrid ZAYA (`model.layer_pattern`), in place of CCA.

    q = φ(x Wq)·d^-½,  k = φ(x Wk),  v = x Wv          (GQA: nq query heads, nk KV heads)
    o_t = Σ_{s ≤ t, same document} λ_h^(t−s) (q_t · k_s) v_s   (`kernels.ops.linear_attention`,
                                                               `model.linear_kernel`'s backend)
    y = (RMSNorm_head(o) ⊙ w_norm) ⊙ silu(x Wg),  out = y Wo

φ is `model.linear_feature_map` (elu(x)+1 as in Katharopoulos et al., silu, or none); λ_h is
`model.linear_decay`: 1 ("none": basic linear attention) or RetNet's fixed per-head
γ_h = 1 − 2^(−5−h) ("retention"). The per-head RMS norm keeps the output's scale independent of
how many tokens the unnormalised sum covers; the swish output gate is RetNet's. The state resets at
each document start (segment ids), so a packed document sees only itself.

As for CCA, the math is written over any whole run of KV groups (`project`, `output` on
group-major weights, `select_groups`), so the tensor- and sequence-parallel schedules
(`parallel/linear_schedule.py`, reached through the `Schedule`) run these same functions on their
groups; the decay of a run of groups is `log_decay(cfg)[heads of the run]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.kernels import ops as kernel_ops
from zaya_jax.model import kv_groups
from zaya_jax.model.schedule import LOCAL, Schedule
from zaya_jax.model.params import constant, make_param, normal
from zaya_jax.model.segments import SequenceInfo

PARAM_AXES = {
    "wq": ("embed", "heads", "head_dim"), "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"), "wg": ("embed", "heads", "head_dim"),
    "out_norm": ("heads", "head_dim"), "wo": ("heads", "head_dim", "embed"),
}
# Entry -> (axis holding the KV groups, entries per group as g -> int), g = query heads per group.
GROUP_AXES = {"wq": (1, lambda g: g), "wk": (1, lambda g: 1), "wv": (1, lambda g: 1), "wg": (1, lambda g: g),
              "out_norm": (0, lambda g: g), "wo": (0, lambda g: g), "log_decay": (0, lambda g: g)}
FEATURE_MAPS = {"elu1": lambda x: jax.nn.elu(x) + 1.0, "silu": jax.nn.silu, "identity": lambda x: x}


class LinearAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h, nq, nk, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        shapes = {"wq": (h, nq, d), "wk": (h, nk, d), "wv": (h, nk, d), "wg": (h, nq, d), "out_norm": (nq, d),
                  "wo": (nq, d, h)}
        inits = {"out_norm": constant(1.0)}
        for name, axes in PARAM_AXES.items():
            setattr(self, name, make_param(rngs, inits.get(name, normal(cfg.initializer_range)), shapes[name], axes))

    def params(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in PARAM_AXES}

    def __call__(self, x: jax.Array, seq: SequenceInfo, schedule: Schedule = LOCAL) -> jax.Array:
        out = schedule.linear_attention(self.params(), x, seq, self.cfg)
        if out is not None:
            return out
        w = group_major(self.params(), self.cfg, x.dtype)
        q, k, v = project(x, w, self.cfg)
        segment_ids = seq.segment_ids if seq.segment_ids is not None else jnp.zeros(x.shape[:2], jnp.int32)
        backend, decay = self.cfg.linear_kernel, w["log_decay"]

        def attend(q, k, v, segment_ids):
            return kernel_ops.linear_attention(q, k, v, segment_ids, log_decay=decay, backend=backend)

        attn = schedule.run_kernel("linear_attention", backend, attend, (q, k, v, segment_ids))
        return output(attn, x, w, self.cfg).astype(x.dtype)


def log_decay(cfg: ModelConfig) -> jax.Array | None:
    """log λ per query head, fp32 [nq], or None for no decay."""
    if cfg.linear_decay == "none":
        return None
    heads = jnp.arange(cfg.num_attention_heads, dtype=jnp.float32)
    return jnp.log1p(-jnp.exp2(-5.0 - heads))


def group_major(p: dict[str, jax.Array], cfg: ModelConfig, dtype) -> dict[str, jax.Array]:
    """The layer's weights cast to `dtype` (the norm weight and decay stay fp32), with the decay
    as an entry so that cutting a run of groups cuts it too."""
    w = {k: v.astype(dtype) for k, v in p.items() if k != "out_norm"}
    w["out_norm"] = p["out_norm"].astype(jnp.float32)
    w["log_decay"] = log_decay(cfg)
    return w


def select_groups(w: dict, first, count: int, cfg: ModelConfig, names=None) -> dict:
    """KV groups [first, first + count) of the entries `names` (default all); `first` may be traced."""
    sizes = {n: (axis, width(cfg.kv_groups)) for n, (axis, width) in GROUP_AXES.items()}
    return kv_groups.select(w, first, count, sizes, names)


def project(x: jax.Array, w: dict, cfg: ModelConfig):
    """q, k [B, S, n, d] after the feature map (q scaled by d^-½) and v [B, S, nk, d], in x's dtype."""
    phi = FEATURE_MAPS[cfg.linear_feature_map]
    q = phi(jnp.einsum("bsh,hnd->bsnd", x, w["wq"])) * cfg.head_dim ** -0.5
    k = phi(jnp.einsum("bsh,hnd->bsnd", x, w["wk"]))
    v = jnp.einsum("bsh,hnd->bsnd", x, w["wv"])
    return q.astype(x.dtype), k.astype(x.dtype), v


def output(attn: jax.Array, x: jax.Array, w: dict, cfg: ModelConfig) -> jax.Array:
    """fp32 [B, S, H]: the per-head norm, the gate and Wo of the attention output (of the heads `w` holds)."""
    a = attn.astype(jnp.float32)
    a = a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + cfg.rms_norm_eps) * w["out_norm"]
    gate = jax.nn.silu(jnp.einsum("bsh,hnd->bsnd", x, w["wg"], preferred_element_type=jnp.float32))
    return jnp.einsum("bsnd,ndh->bsh", (a * gate).astype(x.dtype), w["wo"], preferred_element_type=jnp.float32)
