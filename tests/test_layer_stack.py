"""The stacked block stack: one scan body whatever the depth, the same numbers as unrolled, layer 0's
inert EDA scale, and the per-layer interchange form."""

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
            # small sum. A misplaced or missing block moves every entry by its own size.
            scale = float(np.max(np.abs(g.get_value()))) or 1.0
            np.testing.assert_allclose(g.get_value(), g_u.get_value(), rtol=0, atol=2e-5 * scale, err_msg=str(path))


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
