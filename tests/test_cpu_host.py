"""`cpu_host`: with freed memory kept, a jitted step's large buffers stop faulting in new pages."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from zaya_jax import cpu_host
from zaya_jax.errors import ZayaError
from xla_test_flags import xla_flags
from zaya_process import python_probe

glibc_only = pytest.mark.skipif(cpu_host._glibc() is None, reason="mallopt is glibc's")

# A train step in miniature (JAX not started before the setting, as in `zaya train`): the
# backward of a 6-layer MLP over 16K rows, whose saved activations XLA:CPU allocates as one
# ~100 MB block. Prints the minor page faults of each of 12 steps.
PROBE = textwrap.dedent("""
    import json, os, resource
    from zaya_jax import cpu_host
    if os.environ["KEEP"] == "1":
        assert cpu_host.keep_freed_memory()
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
    faults = []
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(step(ws, x))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(faults))
""")


def _faults_per_step(keep: bool) -> list[int]:
    env = {**os.environ, "KEEP": "1" if keep else "0", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_kept_memory_removes_the_page_faults_of_each_step():
    pages = 16384 * 256 * 4 * 6 // 4096  # the six saved activations, in 4 KB pages
    assert min(_faults_per_step(keep=False)) > pages  # glibc's defaults: every step maps its block afresh
    # Kept: a step reuses the last one's pages. (Now and then the heap grows once more, when a step's
    # block is asked for before the last one's is freed; most steps fault nothing.)
    kept = sorted(_faults_per_step(keep=True))
    assert kept[len(kept) // 2] < pages / 20, kept


@glibc_only
def test_too_late_once_jax_has_started():
    probe = ("import jax; jax.devices(); from zaya_jax import cpu_host; "
             "print(cpu_host.keep_freed_memory(), cpu_host.applied())")
    out = python_probe(probe)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_choice_reads_the_environment_and_refuses_other_words():
    assert cpu_host.choice({}) == "keep"
    assert cpu_host.choice({cpu_host.ENV: "System"}) == "system"
    with pytest.raises(ZayaError, match="ZAYA_HOST_MALLOC='always': use 'keep'"):
        cpu_host.choice({cpu_host.ENV: "always"})


def test_cpu_is_decided_by_jax_platforms_then_by_installed_plugins():
    assert cpu_host.cpu_backend("cpu,cuda", ["xla_cuda12"])
    assert not cpu_host.cpu_backend("cuda", [])
    assert not cpu_host.cpu_backend(None, ["xla_cuda12"])
    assert cpu_host.cpu_backend(None, [])
    assert cpu_host.cpu_backend("", [])


def test_split_into_devices_sets_jax_unless_the_environment_fixes_the_count(monkeypatch):
    import jax

    from zaya_jax.kernels import xla_flags

    calls = []
    monkeypatch.setattr(xla_flags, "backends_started", lambda: False)
    monkeypatch.setattr(jax.config, "update", lambda name, value: calls.append((name, value)))
    assert cpu_host.split_into_devices(2, {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert calls == [("jax_num_cpu_devices", 2)]
    assert not cpu_host.split_into_devices(2, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert not cpu_host.split_into_devices(0, {})
    assert calls == [("jax_num_cpu_devices", 2)]


@pytest.mark.parametrize("flags,want", [
    ("", "--xla_force_host_platform_device_count=4"),
    ("--xla_cpu_foo=1 --xla_force_host_platform_device_count=8", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"),
    ("--xla_force_host_platform_device_count=8  --a=1", "--a=1 --xla_force_host_platform_device_count=4"),
])
def test_a_device_count_replaces_the_one_in_xla_flags(flags, want):
    assert cpu_host.with_device_count(flags, 4) == want


def test_more_devices_than_cores_get_two_threads_each_unless_the_environment_names_a_count(monkeypatch):
    from zaya_jax.kernels import xla_flags

    monkeypatch.setattr(xla_flags, "backends_started", lambda: False)
    monkeypatch.setattr(cpu_host, "_threads_set", 0)
    environ = {}
    assert cpu_host.threads_for_devices(8, environ, cores=2)
    assert environ == {"PJRT_NPROC": "16"} and "16 CPU threads" in cpu_host.threads_note()
    assert cpu_host.threads_for_devices(2, (small := {}), cores=2) and small == {"PJRT_NPROC": "4"}
    for count, cores, named in [(8, 16, {}), (1, 1, {}), (8, 2, {"NPROC": "4"}), (8, 2, {"PJRT_NPROC": "2"})]:
        environ = dict(named)
        assert not cpu_host.threads_for_devices(count, environ, cores=cores)
        assert environ == named


def test_the_device_count_is_read_from_xla_flags():
    assert cpu_host.flagged_device_count({"XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=8"}) == 8
    assert cpu_host.flagged_device_count({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}) == 0
    assert cpu_host.flagged_device_count({}) == 0
