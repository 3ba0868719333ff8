"""`host_memory`: with freed memory kept, a jitted step's large buffers stop faulting in new pages."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from zaya_jax import host_memory
from zaya_jax.errors import ZayaError
from xla_test_flags import xla_flags

glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="mallopt is glibc's")

# A train step in miniature (JAX not started before the setting, as in `zaya train`): the
# backward of a 6-layer MLP over 16K rows, whose saved activations XLA:CPU allocates as one
# ~100 MB block. Prints the minor page faults per step.
PROBE = textwrap.dedent("""
    import json, os, resource
    from zaya_jax import host_memory
    if os.environ["KEEP"] == "1":
        assert host_memory.keep_freed_memory()
    import jax, jax.numpy as jnp

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x * x)

    ws = [jnp.full((256, 256), 0.01, jnp.float32) for _ in range(6)]
    x = jnp.ones((16384, 256), jnp.float32)
    step = jax.jit(jax.grad(loss))
    for _ in range(3):
        jax.block_until_ready(step(ws, x))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        jax.block_until_ready(step(ws, x))
    print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5))
""")


def _faults_per_call(keep: bool) -> float:
    env = {**os.environ, "KEEP": "1" if keep else "0", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_kept_memory_removes_the_page_faults_of_each_step():
    pages = 16384 * 256 * 4 * 6 // 4096  # the six saved activations, in 4 KB pages
    assert _faults_per_call(keep=False) > pages  # glibc's defaults: the step's block is mapped afresh
    assert _faults_per_call(keep=True) < pages / 20


@glibc_only
def test_too_late_once_jax_has_started():
    probe = ("import jax; jax.devices(); from zaya_jax import host_memory; "
             "print(host_memory.keep_freed_memory(), host_memory.applied())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_choice_reads_the_environment_and_refuses_other_words():
    assert host_memory.choice({}) == "keep"
    assert host_memory.choice({host_memory.ENV: "System"}) == "system"
    with pytest.raises(ZayaError, match="ZAYA_HOST_MALLOC='always': use 'keep'"):
        host_memory.choice({host_memory.ENV: "always"})


def test_cpu_is_decided_by_jax_platforms_then_by_installed_plugins():
    assert host_memory.cpu_backend("cpu,cuda", ["xla_cuda12"])
    assert not host_memory.cpu_backend("cuda", [])
    assert not host_memory.cpu_backend(None, ["xla_cuda12"])
    assert host_memory.cpu_backend(None, [])
    assert host_memory.cpu_backend("", [])
