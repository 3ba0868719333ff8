"""The stacked block stack: one scan body whatever the depth, the same numbers as unrolled, layer 0's
inert EDA scale, and the per-layer interchange form."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
from jax.extend.core import jaxprs_in_params
import numpy as np
import pytest

from flax import nnx

from zaya_jax.config import preset
from zaya_jax.model import Zaya
from zaya_jax.model.layer_stack import per_layer
from zaya_jax.model.state import build_model, expected_shapes, flat_arrays

CFG = preset("tiny", num_hidden_layers=3)
IDS = jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 12)))


def model(cfg=CFG):
    return Zaya(cfg, rngs=nnx.Rngs(0))


def _equations(cfg, scan: bool) -> int:
    """Equations in the traced forward, counting into scan bodies once."""
    m = model(cfg)
    jaxpr = jax.make_jaxpr(lambda ids: m.hidden_states(ids, scan=scan)[0])(IDS)

    def count(j):
        return sum(1 + sum(count(sub) for sub in jaxprs_in_params(e.params)) for e in j.eqns)

    return count(jaxpr.jaxpr)


def test_the_scanned_forward_traces_one_block_whatever_the_depth():
    shallow, deep = CFG.replace(num_hidden_layers=2), CFG.replace(num_hidden_layers=6)
    assert _equations(shallow, scan=True) == _equations(deep, scan=True)
    per_block = (_equations(deep, scan=False) - _equations(shallow, scan=False)) / 4
    assert per_block > 50  # unrolled, each block is traced again


@pytest.mark.parametrize("remat", ["none", "full", "dots", "moe"])
def test_unrolled_layers_give_the_scanned_values_and_gradients(remat):
    m = model()
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params, scan, unroll):
        hidden, choices = nnx.merge(graphdef, params, rest).hidden_states(IDS, remat=remat, scan=scan, unroll=unroll)
        return jnp.sum(hidden ** 2), choices.expert

    run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(1, 2))
    (value, choices), grads = run(params, True, 1)
    assert choices.shape == (CFG.num_hidden_layers, *IDS.shape)
    for scan, unroll in ((False, 1), (True, 2)):  # unrolled; two blocks per iteration of three
        (value_u, choices_u), grads_u = run(params, scan, unroll)
        np.testing.assert_allclose(value, value_u, rtol=1e-6)
        np.testing.assert_array_equal(choices, choices_u)
        for (path, g), (_, g_u) in zip(grads.flat_state(), grads_u.flat_state()):
            # Against the leaf's largest entry: an embedding row's gradient sums every position
            # holding its token, and where those terms cancel, the order XLA adds them in (fused
            # differently scanned and unrolled) moves the few-ulp rounding by up to ~1e-3 of the
            # small sum (jax 0.12: 2.5e-5 of the largest entry on a router norm weight, a sum over
            # every token). A misplaced or missing block moves every entry by its own size.
            scale = float(np.max(np.abs(g.get_value()))) or 1.0
            np.testing.assert_allclose(g.get_value(), g_u.get_value(), rtol=0, atol=5e-5 * scale, err_msg=str(path))


def test_layer_0_eda_scale_is_inert():
    m = model()
    eda = m.layers.moe.router.eda_scale
    assert eda.get_value().shape == (CFG.num_hidden_layers, CFG.router_hidden_size)
    np.testing.assert_array_equal(eda.get_value()[0], 1.0)
    before = m(IDS)
    eda[...] = eda.get_value().at[0].set(7.0)  # layer 0 has no incoming router state
    np.testing.assert_array_equal(m(IDS), before)

    def loss(m):
        return jnp.sum(m(IDS) ** 2)

    grad = nnx.grad(loss)(m).layers.moe.router.eda_scale.get_value()
    np.testing.assert_array_equal(grad[0], 0.0)  # so Adam never moves it
    assert np.all(np.any(grad[1:] != 0, axis=-1))


def test_per_layer_form_round_trips_and_has_no_layer_0_eda_scale():
    m = model()
    arrays = per_layer(flat_arrays(m), CFG.layer_kinds)
    shapes = expected_shapes(CFG)
    assert sorted(arrays) == sorted(shapes)
    assert {k: a.shape for k, a in arrays.items()} == shapes
    assert "layers/0/moe/router/eda_scale" not in shapes and "layers/1/moe/router/eda_scale" in shapes
    assert shapes["layers/2/attn/wq"] == (CFG.hidden_size, CFG.num_attention_heads, CFG.head_dim)
    rebuilt = build_model(CFG, {k: np.asarray(v) for k, v in arrays.items()})
    for key, value in flat_arrays(rebuilt).items():
        np.testing.assert_array_equal(value, flat_arrays(m)[key], err_msg=key)
    np.testing.assert_array_equal(rebuilt(IDS), m(IDS))


def _saved_residuals(fn, *args) -> list[tuple[str, str]]:
    """(shape as f32[...], where it comes from) of each residual JAX saves for fn's backward."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return [tuple(line.split(" ", 1)) for line in out.getvalue().splitlines()]


ITEMSIZE = {"f32": 4, "bf16": 2, "i32": 4, "bool": 1}


def _parsed(shape: str) -> tuple[str, list[int]]:
    """'f32[3,2,64]' → ('f32', [3, 2, 64]), as `_saved_residuals` prints a residual's shape."""
    dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", shape).groups()
    return dtype, [int(n) for n in dims.split(",") if n]


def _nbytes(shape: str) -> int:
    dtype, dims = _parsed(shape)
    return ITEMSIZE[dtype] * int(np.prod(dims))


@pytest.mark.parametrize("pattern", ["C", "LC"])
def test_the_backward_reads_each_layers_weights_from_the_stack_not_a_saved_copy(pattern):
    """A weight the scan body slices out of its unit's rows is saved for the backward: a copy of
    every layer's weights. With one layer of a kind per unit the body gets the scan's own slice of
    the stack, which the backward reads from the stacked parameter itself."""
    cfg = CFG.replace(num_hidden_layers=4, layer_pattern=pattern)
    graphdef, params, rest = nnx.split(model(cfg), nnx.Param, ...)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params, rest).hidden_states(IDS, remat="none")[0] ** 2)

    units = cfg.num_hidden_layers // len(pattern)
    mixers, blocks = set(), set()  # one layer's weight stacked over the units, as a copy would be
    for path, p in params.flat_state():
        name = "/".join(map(str, path))
        if p.get_value().ndim >= 3 and path[0] == "layers":
            shape = (units, *p.get_value().shape[1:])
            (mixers if any(k in name for k in ("attn", "linear")) else blocks).add(
                "f32[" + ",".join(map(str, shape)) + "]")
    copies = [(shape, why) for shape, why in _saved_residuals(loss, params) if not why.startswith("from the argument")]
    # One layer of each kind per unit (shapes a block weight also has left out: those it may copy)
    assert not [c for c in copies if c[0] in mixers - blocks], copies
    if len(pattern) == 1:
        assert not [c for c in copies if c[0] in blocks], copies


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("remat", ["none", "dots"])
def test_the_experts_keep_no_cast_or_fused_copy_of_their_weights_for_the_backward(dtype, remat):
    """The grouped matmuls read their weight operand again in the backward. Were it saved, every
    layer would keep its fused [E, H, 2·I] gate/up and its cast weights until then
    (`remat.without_weight_copies` makes them again instead). Below fp32 the one copy kept is the
    stack cast once per step before the scan (`params.in_compute_dtype`), whose gradient comes back
    in that dtype too."""
    cfg = CFG.replace(num_hidden_layers=4, compute_dtype=dtype, moe_kernel="xla")
    graphdef, params, rest = nnx.split(model(cfg), nnx.Param, ...)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params, rest).hidden_states(IDS, remat=remat)[0].astype(jnp.float32) ** 2)

    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    weights = {f"[{cfg.num_hidden_layers},{e},{a},{b}]" for a, b in ((h, 2 * i), (h, i), (i, h))}
    residuals = _saved_residuals(loss, params)
    assert any(shape.endswith(f"[{cfg.num_hidden_layers},{e},{h},{i}]") for shape, _ in residuals)  # the stack
    copies = [(shape, why) for shape, why in residuals
              if not why.startswith("from the argument") and shape[shape.index("["):] in weights]
    cast_once = [(shape, why) for shape, why in copies if "in_compute_dtype" in why and shape.startswith("bf16")]
    assert copies == cast_once, copies
    assert bool(cast_once) == (dtype == "bfloat16")


@pytest.mark.parametrize("pattern, layers, loops", [("C", 1, 0), ("LC", 2, 0), ("C", 2, 2), ("LC", 4, 2)])
def test_a_layer_scan_of_one_iteration_compiles_to_no_loop(pattern, layers, loops):
    """The explorer prices a one-iteration scan's backward as no loop (`explore/memory.working_set_per_token`):
    XLA inlines it; from two units on, the forward and the backward each run a loop. (The `xla`
    kernels: the CPU's default ones loop over tiles and chunks of their own.)"""
    cfg = CFG.replace(num_hidden_layers=layers, layer_pattern=pattern, attention_kernel="xla", moe_kernel="xla",
                      linear_kernel="xla")
    graphdef, params, rest = nnx.split(model(cfg), nnx.Param, ...)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params, rest).hidden_states(IDS, remat="none")[0] ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    # Loops run as many times as the scan has units (XLA:CPU's element loops run 24, the tokens)
    trips = [int(n) for n in re.findall(r'while\(.*"known_trip_count":\{"n":"(\d+)"', hlo)]
    assert trips.count(layers // len(pattern)) == loops, trips


@pytest.mark.parametrize("pattern", ["C", "LC"])
def test_dots_keeps_what_the_explorer_prices_and_recomputes_the_experts(pattern):
    """`dots` saves the outputs of `dot_general`s without batch dimensions and the scan's carry (each
    block's input); the experts' grouped matmul is another primitive (`ragged_dot` or a kernel), so
    their gate/up and down outputs are made again in the backward. `moe` names and keeps them (the
    check that they would be seen). The explorer's `dots` bytes are what the layer scan saves, to the
    byte (seeds 56, 69, 87 and 150 on 8 fake CPUs: 0.84–0.88 of the prediction while it kept the
    experts' outputs)."""
    from zaya_jax import hardware
    from zaya_jax.explore import memory
    from zaya_jax.explore.workload import Workload, share
    from meshes import mesh_sizes

    cfg = CFG.replace(num_hidden_layers=4, layer_pattern=pattern, moe_intermediate_size=48, moe_kernel="xla",
                      attention_kernel="xla", linear_kernel="xla")  # 48 and 96 are no other width here
    graphdef, params, rest = nnx.split(model(cfg), nnx.Param, ...)

    def saved(remat):
        def loss(params):
            return jnp.sum(nnx.merge(graphdef, params, rest).hidden_states(IDS, remat=remat)[0] ** 2)

        return [shape for shape, why in _saved_residuals(loss, params) if "output of scan" in why]

    def expert_outputs(shapes):
        return [shape for shape in shapes if re.search(r",(48|96)\]$", shape)]

    dots = saved("dots")
    assert expert_outputs(saved("moe")) and not expert_outputs(dots)
    assert all(shape.startswith("f32[") for shape in dots)
    kept = sum(_nbytes(shape) for shape in dots if len(_parsed(shape)[1]) >= 4)  # stacked [units, B, S, ...]: not the last carry
    run = Workload(cfg, IDS.shape[1], IDS.shape[0], 1, "dots", hardware.profile("cpu"), 1, 1)
    # The carry is saved once a unit; the explorer prices every layer's input, which the unit's
    # recomputation holds (`memory.stored_per_token`)
    extra_inputs = (cfg.num_hidden_layers - cfg.num_hidden_layers // len(pattern)) * memory.block_input_bytes(run)
    assert kept / IDS.size == memory.stored_per_token(run, share(run, mesh_sizes())) - extra_inputs


@pytest.mark.parametrize("tsp", [1, 2])
def test_moe_keeps_the_experts_outputs_the_explorer_prices_and_none_inside_the_tsp_ring(tsp):
    """`moe` names the sorted rows and the experts' gate/up and down outputs. Under TSP the ring's
    `custom_vjp` makes those outputs inside its own forward, where the policy does not see the names,
    so only the rows are kept and the ring's backward makes the rest again. The explorer's `moe`
    bytes are what the layer scan saves, to the byte (ZAYA1-like draws on 8 deviceless H100s under
    `data 2 x expert 2 x tsp 2`: 0.73 of the prediction while it kept them)."""
    from zaya_jax import hardware
    from zaya_jax.explore import memory
    from zaya_jax.explore.workload import Workload, share
    from zaya_jax.parallel.mesh_schedule import MESH
    from zaya_jax.train.flat_model import init_arrays, model_def
    from meshes import fake_mesh, mesh_sizes

    cfg = CFG.replace(num_hidden_layers=4, moe_intermediate_size=56, moe_kernel="xla", attention_kernel="xla")
    params, biases = init_arrays(cfg, seed=3)
    mesh = fake_mesh(tsp=tsp)

    def loss(params):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            blocks = model_def(cfg).merge(params, biases).hidden_states(IDS, remat="moe", schedule=MESH)[0]
            return jnp.sum(blocks ** 2)

    stacked = [shape for shape, why in _saved_residuals(loss, params)
               if "output of scan" in why and shape.startswith(f"f32[{cfg.num_hidden_layers},")]
    assert any(shape.endswith(",112]") for shape in stacked) == (tsp == 1), stacked  # the fused gate/up
    kept = sum(_nbytes(shape) for shape in stacked)
    run = Workload(cfg, IDS.shape[1], IDS.shape[0], 1, "moe", hardware.profile("cpu"), 1, tsp)
    assert kept / IDS.size == memory.stored_per_token(run, share(run, mesh_sizes(tsp=tsp)))


def test_a_block_without_remat_on_a_gpu_keeps_what_the_explorer_prices():
    """With the GPU's kernels (traced for CUDA: Pallas attention, norms and grouped matmul) a scanned
    bf16 stack without remat saves, per token and layer, what the explorer's GPU block prices, within
    5%: the router's fp32 copy of its input and its twelve fp32 rows, and the experts' fused gate/up
    output in fp32 (the grouped matmul's accumulator dtype, which `moe.swiglu` keeps). The inventory
    the CPU's buffers fit (six router rows, the gate/up in bf16) prices 0.79 of it: ZAYA1-scale draws
    without remat on 8 deviceless H100s read up to 1.25 while the GPU block was priced so."""
    from zaya_jax import hardware
    from zaya_jax.explore import memory
    from zaya_jax.explore.workload import Workload, share
    from zaya_jax.kernels import registry
    from zaya_jax.train.flat_model import init_arrays, model_def
    from meshes import mesh_sizes

    # Widths no two of which are equal, so a residual's shape says what it is
    cfg = CFG.replace(num_hidden_layers=3, hidden_size=640, router_hidden_size=96, num_experts=4,
                      moe_intermediate_size=704, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                      compute_dtype="bfloat16")
    batch, length = 3, 128
    ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, length)))
    params, biases = init_arrays(cfg, seed=3)

    def loss(params):
        blocks = model_def(cfg).merge(params, biases).hidden_states(ids, remat="none")[0]
        return jnp.sum(blocks.astype(jnp.float32) ** 2)

    with registry.targeting("cuda"):
        residuals = _saved_residuals(loss, params)
    kept = 0
    for shape, why in residuals:
        dims = _parsed(shape)[1]
        # Activations stacked over the layers: [layers, batch, ...] or [layers, tokens, ...]
        if "output of scan" in why and len(dims) > 1 and dims[0] == cfg.num_hidden_layers and dims[1] in (
                batch, batch * length):
            kept += _nbytes(shape)
    run = Workload(cfg, length, batch, 1, "none", hardware.profile("h100"), 1, 1)
    priced = memory.stored_per_token(run, share(run, mesh_sizes())) * ids.size
    assert 1.0 <= kept / priced <= 1.05, kept / priced
