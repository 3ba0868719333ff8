"""The ZAYA1 causal language model: embedding affine, L × (mixer, MoE) blocks, final norm, tied head.

Residual stream in fp32; each block is
    r = (a + b1)·s1 + (h + b2)·s2  with a = mixer(RMSNorm(h))
    h = (m + b3)·s3 + (r + b4)·s4  with m = MoE(RMSNorm(r), ρ)
and ρ, the router state, flows from layer to layer (EDA). The mixer is CCA (ZAYA1) or, in a
hybrid model, linear attention where `model.layer_pattern` says `L` (`model/linear_attn.py`).
The layers are stored stacked and run as one scan (`model/layer_stack.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config import ModelConfig
from zaya_jax.model.cca import CCAttention, max_lag
from zaya_jax.model.layer_stack import MIXERS, init_stack, run_blocks
from zaya_jax.model.schedule import LOCAL, Schedule
from zaya_jax.model.linear_attn import LinearAttention
from zaya_jax.model.moe import MoE
from zaya_jax.model.norms import Affine, RMSNorm, ResidualMerge
from zaya_jax.model.params import in_compute_dtype, make_param, normal
from zaya_jax.model.segments import SequenceInfo, sequence_info


MIXER_CLASSES = {"C": CCAttention, "L": LinearAttention}


class Block(nnx.Module):
    """One layer's own parts around its token mixer (which the layer stack stores by kind)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", kernel=cfg.norm_kernel, rngs=rngs)
        self.attn_merge = ResidualMerge(cfg.hidden_size, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", kernel=cfg.norm_kernel, rngs=rngs)
        self.moe = MoE(cfg, rngs=rngs)
        self.mlp_merge = ResidualMerge(cfg.hidden_size, rngs=rngs)

    def __call__(self, mixer, h: jax.Array, router_state, seq: SequenceInfo, dtype, schedule: Schedule = LOCAL):
        # Named scopes: the profiler's trace and the HLO's op names read like the model.
        with jax.named_scope("block"):
            with jax.named_scope("attention" if isinstance(mixer, CCAttention) else "linear_attention"):
                a = mixer(self.attn_norm(h, dtype, schedule), seq, schedule)
                r = self.attn_merge(a, h)
            with jax.named_scope("moe"):
                m, router_state, routing = self.moe(self.mlp_norm(r, dtype, schedule), router_state, schedule)
                return self.mlp_merge(m, r), router_state, routing


class Layers(nnx.Module):
    """The depth, stacked: each `Block` part over all L layers (`layers/moe/...`), and each kind's
    mixer over the layers of that kind (`layers/attn/...` for CCA, `layers/linear_attn/...`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        kinds = cfg.layer_kinds
        blocks = init_stack(lambda r: Block(cfg, rngs=r), rngs.params(), len(kinds))
        for name in nnx.state(blocks).keys():
            setattr(self, name, getattr(blocks, name))
        for kind, attr in MIXERS.items():
            if kind in kinds:
                make = MIXER_CLASSES[kind]
                setattr(self, attr, init_stack(lambda r, make=make: make(cfg, rngs=r), rngs.params(), kinds.count(kind)))

    def split(self, cfg: ModelConfig, dtype=None):
        """((block graphdef, block parts stacked over L), {kind: (mixer graphdef, stacked state)});
        with `dtype`, the weights read only in it already cast (`params.in_compute_dtype`)."""
        block_def, shapes = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
        parts = nnx.State({name: nnx.state(getattr(self, name)) for name in shapes.keys()})
        mixers = {kind: nnx.split(getattr(self, attr)) for kind, attr in MIXERS.items() if kind in cfg.layer_kinds}
        if dtype is not None:
            parts = in_compute_dtype(parts, dtype)
            mixers = {kind: (graphdef, in_compute_dtype(state, dtype)) for kind, (graphdef, state) in mixers.items()}
        return (block_def, parts), mixers


class Zaya(nnx.Module):
    """`model(input_ids, segment_ids=None, positions=None)` → fp32 logits [B, S, vocab]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = make_param(rngs, normal(cfg.initializer_range), (cfg.vocab_size, cfg.hidden_size),
                                    ("vocab", "embed"))
        self.input_affine = Affine(cfg.hidden_size, rngs=rngs)
        self.layers = Layers(cfg, rngs=rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", kernel=cfg.norm_kernel, rngs=rngs)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.cfg.compute_dtype)

    def hidden_states(self, input_ids: jax.Array, segment_ids=None, positions=None, remat: str = "none",
                      schedule: Schedule = LOCAL, scan: bool = True, unroll: int = 1):
        """Final-normed fp32 hidden states [B, S, H] and every layer's `Routing` stacked (`.expert` [L, B, S]).

        `remat` names a policy of `model/remat.py` applied to each block (training memory);
        `schedule` runs the layers over devices (`model/schedule.py`; default: here, one device);
        `scan=False` unrolls the layer scan (debugging; same values); `unroll`: pattern units per scan iteration.
        """
        cfg, dtype = self.cfg, self.compute_dtype
        seq = sequence_info(input_ids.shape, segment_ids, positions, max_lag=max_lag(cfg))
        h = self.embed(input_ids, schedule)
        no_router_state = jnp.zeros((*h.shape[:-1], cfg.router_hidden_size), jnp.float32)

        def step(block, mixer, h, router_state):
            return block(mixer, h, router_state, seq, dtype, schedule)

        blocks, mixers = self.layers.split(cfg, dtype)
        h, routing = run_blocks(blocks, mixers, cfg.layer_kinds, h, no_router_state, step, remat=remat, scan=scan,
                                unroll=unroll)
        return self.final_norm(h, jnp.float32, schedule), routing

    def embed(self, input_ids: jax.Array, schedule: Schedule = LOCAL) -> jax.Array:
        """The residual stream's start [B, S, H]: the tokens' embedding rows through the input affine."""
        return self.input_affine(schedule.embed(self.embedding[...], input_ids))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Tied LM head in fp32."""
        return hidden.astype(jnp.float32) @ self.embedding[...].T

    def __call__(self, input_ids: jax.Array, segment_ids=None, positions=None) -> jax.Array:
        hidden, _ = self.hidden_states(input_ids, segment_ids, positions)
        return self.logits(hidden)
