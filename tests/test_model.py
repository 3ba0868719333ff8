"""Model mechanics beyond parity: compiled = eager, gradients flow, balancing biases are state."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.config import preset
from zaya_jax.model import BalancingBias, Zaya, logical_axes
from zaya_jax.model.state import flat_variables

CFG = preset("tiny", num_hidden_layers=2)


def model():
    return Zaya(CFG, rngs=nnx.Rngs(0))


def test_jit_matches_eager():
    m = model()
    ids = jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 10)))
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, x: m(x))(m, ids)), np.asarray(m(ids)), atol=1e-5)


def test_gradients_reach_every_trained_parameter_and_never_the_balancing_biases():
    m = model()
    ids = jnp.asarray(np.random.RandomState(1).randint(0, CFG.vocab_size, (2, 12)))

    def loss(m):
        logits = m(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    grads = nnx.jit(nnx.grad(loss))(m)  # jitted: eager op-by-op grads take half a minute
    flat = {"/".join(map(str, p)): v.get_value() for p, v in grads.flat_state()}
    assert not any(k.endswith("balancing_biases") for k in flat)  # state, not a parameter
    for key, g in flat.items():
        assert np.isfinite(np.asarray(g)).all(), key
    # The router learns only through the chosen probability, the experts only where chosen:
    # every tensor must still receive some gradient.
    dead = [k for k, g in flat.items() if not np.any(np.asarray(g))]
    assert not dead, f"no gradient reaches {dead}"


def test_every_parameter_carries_logical_axes():
    for key, var in flat_variables(model()).items():
        if isinstance(var, BalancingBias):
            continue
        axes = logical_axes(var)
        assert axes is not None and len(axes) == var.get_value().ndim, key


def test_skip_class_outputs_zero():
    m = model()
    skip_all = jnp.zeros(CFG.num_experts + 1).at[-1].set(10.0)  # force every token to the skip class
    m.layers.moe.router.balancing_biases[...] = jnp.tile(skip_all, (CFG.num_hidden_layers, 1))
    graphdef, stacked = nnx.split(m.layers)
    first = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stacked))
    x = jnp.ones((1, 5, CFG.hidden_size))
    out, _, routing = first.moe(x, None)
    assert (np.asarray(routing.expert) == CFG.num_experts).all()
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_gate_and_up_run_as_one_grouped_matmul_equal_to_separate_ones():
    """grouped_swiglu's one matmul against [gate ‖ up] gives what separate gate and up matmuls give
    (values and gradients), for every CPU backend."""
    from zaya_jax.kernels import reference
    from zaya_jax.model.moe import grouped_swiglu

    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    experts, hidden, width, rows = 3, 16, 24, 40
    xs = jax.random.normal(keys[0], (rows, hidden))
    gate, up = (0.3 * jax.random.normal(k, (experts, hidden, width)) for k in keys[1:3])
    down = 0.3 * jax.random.normal(keys[3], (experts, width, hidden))
    sizes = jnp.asarray([7, 0, 30], jnp.int32)  # 3 rows past the groups
    probe = jax.random.normal(keys[4], (rows, hidden))

    def separate(xs, gate, up, down):
        h = jax.nn.silu(reference.grouped_matmul(xs, gate, sizes)) * reference.grouped_matmul(xs, up, sizes)
        return jnp.sum(reference.grouped_matmul(h, down, sizes) * probe)

    want, want_grads = jax.value_and_grad(separate, (0, 1, 2, 3))(xs, gate, up, down)
    for backend in ("reference", "xla", "tiled", "pallas"):
        fused = lambda *a, b=backend: jnp.sum(grouped_swiglu(a[0], sizes, *a[1:], b) * probe)  # noqa: E731
        got, grads = jax.value_and_grad(fused, (0, 1, 2, 3))(xs, gate, up, down)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=backend)
        for name, g, w in zip(("xs", "gate", "up", "down"), grads, want_grads):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"{backend} d{name}")
    jaxpr = str(jax.make_jaxpr(lambda x: grouped_swiglu(x, sizes, gate, up, down, "xla"))(xs))
    assert jaxpr.count("ragged_dot_general[") == 2  # gate and up together, then down
