"""The TSP experts ring on 8 fake devices equals the single-device experts, values and gradients,
with no all-reduce in the compiled forward+backward."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kernel_checks import assert_close
from zaya_jax.model.moe import by_expert, grouped_swiglu
from zaya_jax.parallel.tsp_experts import ring_experts

E, H, I, T = 4, 16, 32, 64  # experts, hidden, expert width (I/8 = 4 per rank), tokens (8 per rank)
# tokens, expert choice, router weight: split over tsp; gate/up/down: split on the expert width.
SPECS = (P("tsp"), P("tsp"), P("tsp"), P(None, None, "tsp"), P(None, None, "tsp"), P(None, "tsp", None))


def _inputs(seed=0, E=E, H=H, I=I, T=T):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(keys[0], (T, H), jnp.float32)
    expert = jax.random.randint(keys[1], (T,), 0, E + 1)  # E = the skip class
    weight = jax.random.uniform(keys[2], (T,), jnp.float32, 0.5, 1.0)
    gate, up = (0.3 * jax.random.normal(k, (E, H, I), jnp.float32) for k in keys[3:5])
    down = 0.3 * jax.random.normal(keys[5], (E, I, H), jnp.float32)
    return x, expert, weight, gate, up, down


def _experts(x, expert, weight, gate, up, down, matmul, experts=E):
    """The MoE layer's sort → `matmul(xs, sizes, gate, up, down)` → unsort."""
    return by_expert(x, expert, weight, experts, lambda xs, sizes: matmul(xs, sizes, gate, up, down))


def _dense(xs, sizes, gate, up, down):
    return grouped_swiglu(xs, sizes, gate, up, down, "reference")


def _tsp(mesh, backend, experts=E):
    ring = jax.shard_map(
        lambda x, expert, weight, gate, up, down: _experts(
            x, expert, weight, gate, up, down,
            lambda xs, sizes, g, u, d: ring_experts(xs, sizes, g, u, d, axis="tsp", backend=backend), experts),
        mesh=mesh, in_specs=SPECS,
        out_specs=P("tsp"), check_vma=False)  # Pallas out_shapes carry no varying-axes annotation
    return ring


def _loss(fn, hidden=H):
    probe = jax.random.normal(jax.random.PRNGKey(9), (T, hidden))
    return lambda x, expert, weight, gate, up, down: jnp.sum(fn(x, expert, weight, gate, up, down) * probe)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_ring_matches_single_device_values_and_gradients(backend):
    mesh = jax.make_mesh((8,), ("tsp",))
    x, expert, weight, gate, up, down = _inputs()
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, expert, weight, gate, up, down), SPECS)]
    ring = _tsp(mesh, backend)
    single = lambda *a: _experts(*a, _dense)  # noqa: E731
    assert_close(jax.jit(ring)(*placed), single(x, expert, weight, gate, up, down), jnp.float32, "ring output")
    diff = (0, 3, 4, 5)
    grads = jax.jit(jax.grad(_loss(ring), diff))(*placed)
    ref = jax.grad(_loss(single), diff)(x, expert, weight, gate, up, down)
    for name, g, r in zip(("x", "gate", "up", "down"), grads, ref):
        assert_close(g, r, jnp.float32, f"ring gradient of {name}")


def test_compiled_ring_has_no_all_reduce_and_the_schedule_s_permutes():
    mesh = jax.make_mesh((8,), ("tsp",))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(_inputs(), SPECS)]
    forward = jax.jit(_tsp(mesh, "xla")).lower(*args).compile().as_text()
    backward = jax.jit(jax.grad(_loss(_tsp(mesh, "xla")), (0, 3, 4, 5))).lower(*args).compile().as_text()
    for hlo in (forward, backward):
        assert "all-reduce" not in hlo and "all-gather" not in hlo
    # The steps are one loop, the last one too: its body holds each hop once. Forward: the fused
    # gate|up slice and the down slice. Gradient (XLA drops the unused primal ring): the slices and
    # their gradient accumulators, whose last hop home is the loop's last step.
    assert forward.count("collective-permute(") == 2
    assert backward.count("collective-permute(") == 2 + 2


def test_two_slices_are_resident_not_one_per_step():
    """Wide experts and few tokens: the ring's memory is its weight slices. The forward holds the
    slice in use and the one arriving, the gradient those and their two accumulators, whatever the
    ring's length (eight steps here), with the rows and the CPU grouped matmul's masked copies."""
    shape = dict(E=E, H=64, I=8 * 64, T=T)
    mesh = jax.make_mesh((8,), ("tsp",))
    inputs = _inputs(**shape)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(inputs, SPECS)]
    slices = 3 * E * shape["H"] * (shape["I"] // 8) * 4  # this rank's gate, up and down, bytes
    ring = _tsp(mesh, "xla", E)
    forward = jax.jit(ring).lower(*args).compile().memory_analysis().temp_size_in_bytes
    gradient = jax.jit(jax.grad(_loss(ring, shape["H"]), (0, 3, 4, 5))).lower(*args).compile()
    assert forward < 3.5 * slices
    assert gradient.memory_analysis().temp_size_in_bytes < 5 * slices
