"""The one declarative table between HF `ZayaForCausalLM` tensor names and our parameter paths.

Each rule names HF tensors, our paths, and a layout transform that works in both directions
from the two sides' shapes alone. Rules come in groups (`top`, `layer.{i}`) so converters can
stream one group at a time. HF shapes are those of transformers' `ZayaForCausalLM` state dict.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

import numpy as np

from zaya_jax.config import ModelConfig
from zaya_jax.errors import ZayaError

Arrays = Sequence[np.ndarray]
Shapes = Sequence[tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Transform:
    to_ours: Callable[[Arrays, Shapes], list[np.ndarray]]  # (hf arrays, our shapes)
    to_hf: Callable[[Arrays, Shapes], list[np.ndarray]]  # (our arrays, hf shapes)


def _same(arrays, shapes):
    # Hand back the very array when no reshape is needed: a view of a 2 GB embedding makes
    # the Orbax/TensorStore write path take an extra full copy.
    return [a if a.shape == tuple(s) else np.reshape(a, s) for a, s in zip(arrays, shapes)]


def _linear_to_ours(arrays, shapes):  # torch Linear [out, in] → ours [in, *out]
    return [np.reshape(arrays[0].T, shapes[0])]


def _linear_to_hf(arrays, shapes):  # ours [in, *out] → torch Linear [out, in]
    out, inp = shapes[0]
    return [np.reshape(arrays[0], (inp, out)).T]


def _depthwise_to_ours(arrays, shapes):  # [C, 1, t0] → [t0, C]
    return [arrays[0][:, 0, :].T]


def _depthwise_to_hf(arrays, shapes):
    return [arrays[0].T[:, None, :]]


def _grouped_to_ours(arrays, shapes):  # hf[h·d + o, i, k] → ours[k, h, i, o]
    t1, heads, d, _ = shapes[0]
    return [np.reshape(arrays[0], (heads, d, d, t1)).transpose(3, 0, 2, 1)]


def _grouped_to_hf(arrays, shapes):
    return [arrays[0].transpose(1, 3, 2, 0).reshape(shapes[0])]


def _gate_up_to_ours(arrays, shapes):  # [E, 2I, H] (gate rows first) → gate, up [E, H, I]
    inter = shapes[0][2]
    fused = arrays[0]
    return [fused[:, :inter].transpose(0, 2, 1), fused[:, inter:].transpose(0, 2, 1)]


def _gate_up_to_hf(arrays, shapes):
    return [np.concatenate([arrays[0].transpose(0, 2, 1), arrays[1].transpose(0, 2, 1)], axis=1)]


def _swap_last(arrays, shapes):  # [E, H, I] ⇄ [E, I, H]
    return [arrays[0].transpose(0, 2, 1)]


SAME = Transform(_same, _same)
LINEAR = Transform(_linear_to_ours, _linear_to_hf)
DEPTHWISE = Transform(_depthwise_to_ours, _depthwise_to_hf)
GROUPED = Transform(_grouped_to_ours, _grouped_to_hf)
GATE_UP = Transform(_gate_up_to_ours, _gate_up_to_hf)
EXPERT_DOWN = Transform(_swap_last, _swap_last)


@dataclasses.dataclass(frozen=True)
class Rule:
    group: str
    hf: tuple[str, ...]
    ours: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    transform: Transform


def rules(cfg: ModelConfig) -> Iterator[Rule]:
    """Every tensor of the model, in HF checkpoint order, grouped for streaming."""
    h, v = cfg.hidden_size, cfg.vocab_size
    nq, nk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e, i_, r, c = cfg.num_experts, cfg.moe_intermediate_size, cfg.router_hidden_size, cfg.qk_channels

    def one(group, hf, ours, shape, transform=SAME):
        return Rule(group, (hf,), (ours,), (shape,), transform)

    yield one("top", "model.embed_tokens.weight", "embedding", (v, h))
    yield one("top", "model.input_hidden_states_scale", "input_affine/scale", (h,))
    yield one("top", "model.input_hidden_states_bias", "input_affine/bias", (h,))
    yield one("top", "model.norm.weight", "final_norm/weight", (h,))
    for n in range(cfg.num_hidden_layers):
        g, hp, op = f"layer.{n}", f"model.layers.{n}.", f"layers/{n}/"
        qkv, gate = hp + "self_attn.qkv_proj.", hp + "mlp.gate."
        yield one(g, hp + "input_layernorm.weight", op + "attn_norm/weight", (h,))
        yield one(g, qkv + "q_proj.weight", op + "attn/wq", (nq * d, h), LINEAR)
        yield one(g, qkv + "k_proj.weight", op + "attn/wk", (nk * d, h), LINEAR)
        yield one(g, qkv + "v_proj_current.weight", op + "attn/wv_current", (cfg.value_half, h), LINEAR)
        yield one(g, qkv + "v_proj_delayed.weight", op + "attn/wv_delayed", (cfg.value_half, h), LINEAR)
        yield one(g, qkv + "conv_qk_depthwise.weight", op + "attn/conv_depthwise", (c, 1, cfg.cca_time0), DEPTHWISE)
        yield one(g, qkv + "conv_qk_depthwise.bias", op + "attn/conv_depthwise_bias", (c,))
        yield one(g, qkv + "conv_qk_grouped.weight", op + "attn/conv_grouped", (c, d, cfg.cca_time1), GROUPED)
        yield one(g, qkv + "conv_qk_grouped.bias", op + "attn/conv_grouped_bias", (c,))
        yield one(g, hp + "self_attn.qk_norm.temp", op + "attn/temperature", (nk,))
        yield one(g, hp + "self_attn.o_proj.weight", op + "attn/wo", (h, nq * d), LINEAR)
        for hf_mod, ours_mod in (("post_attention_residual_scale", "attn_merge"),
                                 ("post_mlp_residual_scale", "mlp_merge")):
            for hf_part, ours_part in (("hidden_states", "branch"), ("residual", "residual")):
                for kind in ("scale", "bias"):
                    yield one(g, f"{hp}{hf_mod}.{hf_part}_{kind}", f"{op}{ours_mod}/{ours_part}/{kind}", (h,))
        yield one(g, hp + "post_attention_layernorm.weight", op + "mlp_norm/weight", (h,))
        ro = op + "moe/router/"
        yield one(g, gate + "down_proj.weight", ro + "down", (r, h), LINEAR)
        yield one(g, gate + "down_proj.bias", ro + "down_bias", (r,))
        if n > 0:
            yield one(g, gate + "router_states_scale", ro + "eda_scale", (r,))
        yield one(g, gate + "router_mlp.norm.weight", ro + "norm/weight", (r,))
        yield one(g, gate + "router_mlp.fc1.weight", ro + "fc1", (r, r), LINEAR)
        yield one(g, gate + "router_mlp.fc1.bias", ro + "fc1_bias", (r,))
        yield one(g, gate + "router_mlp.fc2.weight", ro + "fc2", (r, r), LINEAR)
        yield one(g, gate + "router_mlp.fc2.bias", ro + "fc2_bias", (r,))
        yield one(g, gate + "router_mlp.out_proj.weight", ro + "out", (e + 1, r), LINEAR)
        yield one(g, gate + "balancing_biases", ro + "balancing_biases", (e + 1,))
        yield Rule(g, (hp + "mlp.experts.gate_up_proj",), (op + "moe/experts/gate", op + "moe/experts/up"),
                   ((e, 2 * i_, h),), GATE_UP)
        yield one(g, hp + "mlp.experts.down_proj", op + "moe/experts/down", (e, h, i_), EXPERT_DOWN)


# HF tensors that may appear in a checkpoint but carry no information of their own.
TIED_ALIASES = ("lm_head.weight",)


def grouped_rules(cfg: ModelConfig) -> dict[str, list[Rule]]:
    groups: dict[str, list[Rule]] = {}
    for rule in rules(cfg):
        groups.setdefault(rule.group, []).append(rule)
    return groups


def convert_group_to_ours(rules_in_group: Sequence[Rule], fetch: Callable[[str], np.ndarray],
                          our_shapes: dict[str, tuple[int, ...]], source: str) -> dict[str, np.ndarray]:
    """HF tensors of one group → our arrays; `fetch(name)` reads one HF tensor (fp32 or bf16)."""
    out = {}
    for rule in rules_in_group:
        arrays = []
        for name, shape in zip(rule.hf, rule.hf_shapes):
            array = fetch(name)
            if tuple(array.shape) != shape:
                raise_shape(source, name, array.shape, shape)
            arrays.append(array)
        for path, array in zip(rule.ours, rule.transform.to_ours(arrays, [our_shapes[p] for p in rule.ours])):
            out[path] = array
    return out


def convert_group_to_hf(rules_in_group: Sequence[Rule], fetch: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """Our arrays of one group → HF tensors; `fetch(path)` reads one of ours."""
    out = {}
    for rule in rules_in_group:
        arrays = [fetch(p) for p in rule.ours]
        for name, array in zip(rule.hf, rule.transform.to_hf(arrays, rule.hf_shapes)):
            out[name] = np.ascontiguousarray(array)
    return out


def raise_shape(source: str, name: str, got, want) -> None:
    raise ZayaError(
        f"{source}: tensor {name!r} has shape {tuple(got)} but config.json implies {tuple(want)}; "
        "the weights and config.json disagree"
    )
