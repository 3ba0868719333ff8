"""Linear attention: the quadratic reference against the token-by-token recurrence it defines,
and the chunked form against the reference (values and gradients), with decay and document resets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.kernels import linear_attention as la


def _inputs(batch, length, nq, nk, dk, dv, doc_prob, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (batch, length, nq, dk)) * 0.3
    k = jax.random.normal(keys[1], (batch, length, nk, dk)) * 0.3
    v = jax.random.normal(keys[2], (batch, length, nk, dv))
    segments = None
    if doc_prob is not None:
        segments = jnp.cumsum(jax.random.bernoulli(keys[3], doc_prob, (batch, length)), axis=1).astype(jnp.int32)
    log_decay = -jax.random.uniform(keys[4], (nq,), minval=0.01, maxval=0.5)
    return q, k, v, segments, log_decay


def _recurrence(q, k, v, segments, log_decay):
    """The definition, one token at a time: M_t = λ M_{t-1} (same document) + k_tᵀ v_t; out_t = q_t M_t."""
    batch, length, nq, _ = q.shape
    nk = k.shape[2]
    g = nq // nk
    decay = np.exp(np.asarray(log_decay)) if log_decay is not None else np.ones(nq)
    out = np.zeros((batch, length, nq, v.shape[-1]))
    for b in range(batch):
        state = np.zeros((nq, k.shape[-1], v.shape[-1]))
        for t in range(length):
            if segments is not None and t and segments[b, t] != segments[b, t - 1]:
                state[:] = 0
            for h in range(nq):
                state[h] = decay[h] * state[h] + np.outer(k[b, t, h // g], v[b, t, h // g])
                out[b, t, h] = q[b, t, h] @ state[h]
    return out


@pytest.mark.parametrize("decay,doc_prob", [(False, None), (True, None), (True, 0.15)])
def test_reference_is_the_recurrence(decay, doc_prob):
    q, k, v, segments, log_decay = _inputs(2, 19, 4, 2, 8, 6, doc_prob)
    log_decay = log_decay if decay else None
    want = _recurrence(*map(lambda a: None if a is None else np.asarray(a, np.float64), (q, k, v)),
                       None if segments is None else np.asarray(segments), log_decay)
    np.testing.assert_allclose(la.reference(q, k, v, segments, log_decay=log_decay), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length,chunk,nq,nk,decay,doc_prob", [
    (32, 8, 4, 2, False, None),  # basic linear attention
    (32, 8, 4, 2, True, None),  # per-head decay
    (48, 16, 4, 1, True, 0.1),  # documents crossing chunk boundaries
    (40, 8, 2, 2, True, 0.4),  # many short documents, some inside one chunk
    (16, 16, 4, 2, True, 0.2),  # one chunk: the quadratic form alone
])
def test_chunked_equals_the_reference_values_and_gradients(length, chunk, nq, nk, decay, doc_prob):
    q, k, v, segments, log_decay = _inputs(2, length, nq, nk, 8, 8, doc_prob, seed=length)
    log_decay = log_decay if decay else None
    probe = jax.random.normal(jax.random.PRNGKey(9), (2, length, nq, 8))

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * probe)

    ref = lambda q, k, v: la.reference(q, k, v, segments, log_decay=log_decay)  # noqa: E731
    got = lambda q, k, v: la.chunked(q, k, v, segments, log_decay=log_decay, chunk=chunk)  # noqa: E731
    np.testing.assert_allclose(got(q, k, v), ref(q, k, v), rtol=1e-4, atol=1e-5)
    want = jax.grad(lambda *a: loss(ref, *a), (0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", jax.grad(lambda *a: loss(got, *a), (0, 1, 2))(q, k, v), want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def test_a_chunk_that_does_not_divide_the_sequence_is_named():
    q, k, v, *_ = _inputs(1, 10, 2, 1, 4, 4, None)
    with pytest.raises(ValueError, match="multiple of the chunk"):
        la.chunked(q, k, v, chunk=4)


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("length,decay,doc_prob", [(64, False, None), (64, True, 0.1), (256, True, 0.02)])
def test_lasp2_on_8_devices_equals_the_reference_with_one_state_all_gather(length, decay, doc_prob, zigzag):
    import re

    from jax.sharding import Mesh, PartitionSpec as P

    from zaya_jax.parallel import zigzag as zz
    from zaya_jax.parallel.lasp2 import lasp2

    devices = 8
    q, k, v, segments, log_decay = _inputs(2, length, 4, 2, 8, 8, doc_prob, seed=5)
    segments = jnp.zeros((2, length), jnp.int32) if segments is None else segments
    log_decay = log_decay if decay else None
    mesh = Mesh(np.array(jax.devices()[:devices]), ("sequence",))
    rows = P(None, "sequence")
    schedule = jax.shard_map(
        lambda q, k, v, s: lasp2(q, k, v, s, axis="sequence", devices=devices, zigzag=zigzag, log_decay=log_decay),
        mesh=mesh, in_specs=(rows,) * 4, out_specs=rows)
    probe = jax.random.normal(jax.random.PRNGKey(3), (2, length, 4, 8))
    place = lambda x: zz.place(x, devices, zigzag, axis=1)  # noqa: E731

    def loss(fn, q, k, v, s):
        return jnp.sum(fn(q, k, v, s) * probe)

    got = lambda q, k, v, s: zz.unplace(schedule(place(q), place(k), place(v), place(s)), devices, zigzag, axis=1)  # noqa: E731
    ref = lambda q, k, v, s: la.reference(q, k, v, s, log_decay=log_decay)  # noqa: E731
    np.testing.assert_allclose(jax.jit(got)(q, k, v, segments), ref(q, k, v, segments), rtol=1e-4, atol=1e-5)
    grad = jax.jit(jax.grad(lambda *a: loss(got, *a), (0, 1, 2)))
    wanted = jax.grad(lambda *a: loss(ref, *a), (0, 1, 2))(q, k, v, segments)
    for name, g, w in zip("qkv", grad(q, k, v, segments), wanted):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")
    # Forward: one all-gather of the [chunks, B, nk, g, dk, dv] states (and one of the chunks' last
    # segment ids), the same bytes at 4x the sequence; backward: its transpose, one reduce-scatter.
    hlo = grad.lower(q, k, v, segments).compile().as_text()
    gathers = re.findall(r"= (f32\[[\d,]+\])\S* all-gather\(", hlo)
    int_gathers = re.findall(r"= (s32\[[\d,]+\])\S* all-gather\(", hlo)
    scatters = re.findall(r"= (f32\[[\d,]+\])\S* reduce-scatter\(", hlo)
    chunks = devices * (2 if zigzag else 1)
    assert gathers == [f"f32[{chunks},2,2,2,8,8]"] and len(scatters) == 1, (gathers, scatters)
    assert int_gathers == [f"s32[{chunks},2]"], int_gathers
