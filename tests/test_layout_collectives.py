"""The layouts' collectives, counted in the lowered and compiled HLO of one layer on 8 devices.

The lowered module is the schedule as written (one op per collective call); the compiled one
is what XLA runs (it may combine or share ops). TSP attention and TSP experts must have no
all-reduce on the activation path: none in the forward, and in the backward only the one sum of
the gradients of the few small weights every device keeps whole (conv taps, biases, temperature).
"""

import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from zaya_jax.config import preset
from zaya_jax.model.cca import PARAM_AXES, CCAttention
from zaya_jax.model.segments import sequence_info
from zaya_jax.parallel import attention_schedule, experts_schedule
from meshes import fake_mesh
from zaya_jax.parallel.rules import named_sharding

CFG = preset("tiny", attention_kernel="xla", moe_kernel="xla", norm_kernel="xla")
B, S = 8, 64
OPS = ("all_gather", "all_reduce", "reduce_scatter", "collective_permute", "all_to_all")


def _abstract(mesh):
    row = named_sharding(("batch", "length"), mesh)
    params = CCAttention(CFG, rngs=nnx.Rngs(0)).params()
    attn = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=named_sharding(PARAM_AXES[n], mesh, v.shape))
            for n, v in params.items()}
    e, h, i = CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size
    experts = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=named_sharding(experts_schedule.WEIGHT_AXES[n], mesh, s))
               for n, s in (("gate", (e, h, i)), ("up", (e, h, i)), ("down", (e, i, h)))]
    x = jax.ShapeDtypeStruct((B, S, h), jnp.float32, sharding=NamedSharding(mesh, P(*row.spec, None)))
    ints = jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=row)
    floats = jax.ShapeDtypeStruct((B, S), jnp.float32, sharding=row)
    return attn, experts, x, ints, floats


def _attention(mesh, zigzagged=False):
    def layer(params, x, segments, positions):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return attention_schedule.cca(params, x, sequence_info((B, S), segments, positions, 1), CFG,
                                        zigzagged=zigzagged)
    return layer


def _experts(mesh):
    def layer(x, expert, weight, gate, up, down):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return experts_schedule.experts(x, expert, weight, gate, up, down, backend="xla")
    return layer


def _grad(layer, argnums):
    return jax.grad(lambda *a: jnp.sum(layer(*a) ** 2), argnums=argnums)


def _collectives(fn, *args):
    """(lowered counts, compiled counts, compiled all-reduce operand element counts)."""
    lowered = jax.jit(fn).lower(*args)
    written = Counter(re.findall(r"stablehlo\.(" + "|".join(OPS) + ")", lowered.as_text()))
    hlo = lowered.compile().as_text()
    ops = [op.replace("-", "_") for op in re.findall(r" (" + "|".join(o.replace("_", "-") for o in OPS)
                                                     + r")(?:-start)?\(", hlo)]
    reduced = [math.prod(int(d) for d in dims.split(",") if d) for line in hlo.splitlines() if " all-reduce(" in line
               for dims in re.findall(r"f32\[([\d,]*)\]", line.split(" all-reduce(")[0])]
    return dict(written), dict(Counter(ops)), reduced


def _replicated_attention_elements(mesh, attn):
    """Elements of the attention weights stored whole on every device of the mesh."""
    return sum(math.prod(a.shape) for a in attn.values() if a.sharding.is_fully_replicated)


def test_tsp_attention_gathers_one_bucket_at_a_time_and_never_all_reduces_activations():
    d = 8
    mesh = fake_mesh(tsp=d)
    attn, _, x, ints, _ = _abstract(mesh)
    buckets = CFG.num_key_value_heads  # one KV group per bucket
    written, compiled, _ = _collectives(_attention(mesh), attn, x, ints, ints)
    # Per bucket: wq, wk, wv, wo and the two grouped-conv slices, then K and V; once: the keys'
    # segment ids. The look-back rows: x, segment ids and positions from the previous chunk.
    assert written == {"all_gather": buckets * (6 + 2) + 1, "collective_permute": 3}
    assert "all_reduce" not in compiled
    written, compiled, reduced = _collectives(_grad(_attention(mesh), (0, 1)), attn, x, ints, ints)
    # The backward adds the transposes: a reduce-scatter per float all-gather, the x look-back rows'
    # reverse permute, and the gradient sums of the 4 replicated small weights (combined by XLA).
    assert written["reduce_scatter"] == buckets * (6 + 2) and written["collective_permute"] == 4
    assert written["all_reduce"] == 4 and compiled["all_reduce"] == 1
    assert sum(reduced) == _replicated_attention_elements(mesh, attn)


def test_tsp_experts_ring_has_only_permutes():
    d = 8
    mesh = fake_mesh(tsp=d)
    _, experts, x, ints, floats = _abstract(mesh)
    written, compiled, _ = _collectives(_experts(mesh), x, ints, floats, *experts)
    # The D steps are one loop (parallel/tsp_experts.py): its body moves the fused gate|up slice and
    # the down slice once each, and no step is written after it.
    assert written == compiled == {"collective_permute": 2}
    written, compiled, _ = _collectives(_grad(_experts(mesh), (0, 3, 4, 5)), x, ints, floats, *experts)
    # With the backward: the forward's loop and the backward's (the slices and their gradient
    # accumulators, whose last hop home is the loop's last step).
    assert written == compiled == {"collective_permute": 2 + 2 + 2}


@pytest.mark.parametrize("zigzagged", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("layout", [dict(sequence=8), dict(tensor=2, sequence=4)], ids=str)
def test_sequence_attention_gathers_keys_and_values_once(layout, zigzagged):
    mesh = fake_mesh(**layout)
    attn, _, x, ints, _ = _abstract(mesh)
    written, _, _ = _collectives(_attention(mesh, zigzagged), attn, x, ints, ints)
    tensor_sums = 1 if layout.get("tensor", 1) > 1 else 0  # Megatron's one all-reduce of the output
    # Look-back rows (x, segment ids, positions): from the left neighbour, and under zigzag for
    # the second chunks from the right one too (parallel/zigzag.py).
    permutes = 3 * (2 if zigzagged else 1)
    assert written == {"all_gather": 3, "collective_permute": permutes, **({"all_reduce": 1} if tensor_sums else {})}


def test_expert_parallel_dispatch_is_all_gather_and_reduce_scatter():
    mesh = fake_mesh(expert=4, data=2)
    _, experts, x, ints, floats = _abstract(mesh)
    written, compiled, _ = _collectives(_experts(mesh), x, ints, floats, *experts)
    assert written == compiled == {"all_gather": 3, "reduce_scatter": 1}  # tokens, choices, weights; outputs


HYBRID = CFG.replace(layer_pattern="LC", linear_decay="retention")


def _linear(mesh, length, zigzagged):
    from zaya_jax.model.linear_attn import PARAM_AXES as LINEAR_AXES, LinearAttention
    from zaya_jax.parallel import linear_schedule

    row = named_sharding(("batch", "length"), mesh)
    params = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=named_sharding(LINEAR_AXES[n], mesh, v.shape))
              for n, v in LinearAttention(HYBRID, rngs=nnx.Rngs(0)).params().items()}
    x = jax.ShapeDtypeStruct((B, length, CFG.hidden_size), jnp.float32, sharding=NamedSharding(mesh, P(*row.spec, None)))
    ints = jax.ShapeDtypeStruct((B, length), jnp.int32, sharding=row)

    def layer(params, x, segments):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return linear_schedule.linear(params, x, sequence_info((B, length), segments, None, 1), HYBRID,
                                        zigzagged=zigzagged)
    return layer, (params, x, ints)


def _state_gathers(fn, args):
    """The compiled float all-gathers' result shapes (the memory states')."""
    return re.findall(r"= (f32\[[\d,]+\])\S* all-gather(?:-start)?\(", jax.jit(fn).lower(*args).compile().as_text())


@pytest.mark.parametrize("zigzagged", [False, True], ids=["contiguous", "zigzag"])
def test_lasp2_exchanges_one_state_all_gather_per_linear_layer_whatever_the_length(zigzagged):
    mesh = fake_mesh(sequence=8)
    layer, args = _linear(mesh, S, zigzagged)
    written, _, _ = _collectives(layer, *args)
    # One all-gather of every chunk's states and one of their last segment ids; no K/V, no permute.
    assert written == {"all_gather": 2}
    written, compiled, _ = _collectives(_grad(layer, (0, 1)), *args)
    # The backward: the states' gather transposed to one reduce-scatter; the replicated weights'
    # gradients summed once (XLA combines them).
    assert written["reduce_scatter"] == 1 and written["all_gather"] == 2 and "collective_permute" not in written
    assert compiled.get("all_reduce", 0) == 1
    chunks = 8 * (2 if zigzagged else 1)
    nk, g, d = CFG.num_key_value_heads, CFG.kv_groups, CFG.head_dim
    state = f"f32[{chunks},{B},{nk},{g},{d},{d}]"
    assert _state_gathers(layer, args) == [state]
    longer_layer, longer = _linear(mesh, 4 * S, zigzagged)
    assert _state_gathers(longer_layer, longer) == [state]  # the same bytes at 4x the sequence


def test_tsp_linear_attention_gathers_each_weight_slice_once_and_never_all_reduces_activations():
    mesh = fake_mesh(tsp=8)
    layer, args = _linear(mesh, S, zigzagged=True)
    buckets = CFG.num_key_value_heads
    written, compiled, _ = _collectives(layer, *args)
    # Per bucket: wq, wk, wv before the exchange, wg and wo after it; once: the states and their ends.
    assert written == {"all_gather": buckets * 5 + 2}
    assert "all_reduce" not in compiled
    written, _, _ = _collectives(_grad(layer, (0, 1)), *args)
    assert written["reduce_scatter"] == buckets * 5 + 1 and "collective_permute" not in written
