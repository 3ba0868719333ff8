"""A CPU run's host, set up before JAX starts: freed memory kept for reuse, the cores as devices,
and the threads their collectives need.

**Freed memory stays in the heap.** XLA:CPU allocates a step's temporaries as one block (at
`tiny_cpu`, every layer's saved activations: a few hundred MB) and frees it when the step ends.
glibc's malloc serves a block that large from a fresh `mmap` (in the per-thread arena of the
thread that runs the step) and unmaps it on free, so every step faults in its whole block again:
~50,000 page faults and ~100 ms of kernel time per `tiny_cpu` step on a 2-core host, a third of
the step's CPU time (`benchmarks/step_vs_eager.md`). With one arena, no `mmap` for large blocks
and no trimming of the heap's top, the freed block stays in the heap and the next step takes it
again: no faults. The cost is that the process keeps its peak heap until it exits, which a
training run reaches in its first step anyway. `keep_freed_memory()` sets that through `mallopt`
(glibc only; elsewhere it does nothing); `ZAYA_HOST_MALLOC=system` keeps glibc's defaults.

**The cores as devices.** XLA:CPU runs most of a small model's matmuls on one thread each, so one
device leaves the second core of a 2-core host idle half the time. `train.cpu_devices: N` starts
N CPU devices (`jax_num_cpu_devices`), which the mesh's `data` axis then spans: each runs its own
share of the batch on its own core. A device count already in the environment (XLA_FLAGS'
`--xla_force_host_platform_device_count`, as the tests and layout explorations set it) wins.

**Threads for the devices' collectives.** XLA's CPU client runs its devices' work on one pool of
threads, one per core (`PJRT_NPROC` or `NPROC` when set), and a device waiting in an in-process
collective for its peers holds a thread while it waits. On jax 0.12's XLA:CPU a device can have
two collectives ready at once and its peers take them in another order, so with as many threads as
devices every thread can end up waiting while the collective that would free them has none to run
on: after 40 s XLA aborts the process ("Termination timeout for `all gather ...`", a C++ check
failure). Measured with `experiments/layouts/tsp4_data2.py` on 8 fake devices of a 2-core host
(jax 0.12.0.1): 4 of 6 runs aborted with the host's 2 threads, 1 of 2 with 8 (5 threads in a
collective-permute, 3 in an all-gather one device had not reached), none of 8 with 16; never seen
on jax 0.10, whose steps run as fast with 16 threads. `threads_for_devices` sets `PJRT_NPROC`
to twice the device count where the host has fewer cores than that and the environment names no
thread count of its own.

All three must happen before JAX creates its CPU client (a thread picks its malloc arena at its first
allocation, and the client's threads allocate as soon as they start); `zaya train` calls
`prepare` first, which acts when JAX will run on CPU (`will_run_on_cpu`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import pkgutil
import re

ENV = "ZAYA_HOST_MALLOC"  # "keep" (the default on CPU) or "system"
THREAD_COUNT_ENV = ("PJRT_NPROC", "NPROC")  # XLA's CPU client's pool size, in the order it reads them
THREADS_PER_DEVICE = 2  # one device's two collectives ready at once (measured: one per device aborts)
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
CHOICES = ("keep", "system")
# glibc's mallopt parameters (malloc.h) and the values set.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))

_applied = False
_threads_set = 0


def prepare(cpu_devices: int, environ=os.environ) -> None:
    """Everything this module sets up, if JAX will run on CPU (`zaya train` calls it before JAX
    starts): freed memory kept unless `ZAYA_HOST_MALLOC=system`, `cpu_devices` devices (unless
    XLA_FLAGS sets a count) and two threads for each. A bad `ZAYA_HOST_MALLOC` is an error on any
    platform."""
    keep = choice(environ) == "keep"
    if not will_run_on_cpu():
        return
    if keep:
        keep_freed_memory()
    split_into_devices(cpu_devices, environ)
    threads_for_devices(flagged_device_count(environ) or cpu_devices, environ)


def threads_for_devices(count: int, environ=os.environ, cores: int | None = None) -> bool:
    """Size XLA's CPU thread pool to two threads per device (`PJRT_NPROC`) for `count` devices
    where the host has fewer cores than that; False (nothing set) for one device, with enough cores, where
    the environment already names a thread count, or once JAX has started (the pool is made with
    the client)."""
    from zaya_jax.kernels.xla_flags import backends_started

    global _threads_set
    threads = THREADS_PER_DEVICE * count
    if count <= 1 or threads <= (cores or _cores()) or any(name in environ for name in THREAD_COUNT_ENV) \
            or backends_started():
        return False
    environ[THREAD_COUNT_ENV[0]] = str(threads)
    _threads_set = threads
    return True


def threads_for_flagged_devices(environ=os.environ) -> bool:
    """`threads_for_devices` for the CPU device count XLA_FLAGS sets, if JAX will run on CPU
    (every command that starts JAX calls it first; `prepare` adds `train.cpu_devices`)."""
    return will_run_on_cpu() and threads_for_devices(flagged_device_count(environ), environ)


def threads_note() -> str:
    """For the run's banner: the thread count this process set for its devices; "" when none."""
    return f"; {_threads_set} CPU threads for its collectives ({THREAD_COUNT_ENV[0]})" if _threads_set else ""


def flagged_device_count(environ=os.environ) -> int:
    """The CPU device count XLA_FLAGS sets; 0 when it sets none (or not as a number)."""
    found = re.findall(rf"{DEVICE_COUNT_FLAG}=(\d+)", environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 0


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def with_device_count(xla_flags: str, count: int) -> str:
    """XLA_FLAGS' value `xla_flags` with its CPU device count set to `count` (any earlier one dropped)."""
    kept = re.sub(rf"{DEVICE_COUNT_FLAG}=\S+", "", xla_flags).split()
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={count}"])


def split_into_devices(count: int, environ=os.environ) -> bool:
    """Have JAX start `count` CPU devices; False (left to JAX) for a count of 0, a count the
    environment already fixes (XLA_FLAGS), or once JAX has started."""
    import jax

    from zaya_jax.kernels.xla_flags import backends_started

    if count <= 0 or _count_in_flags(environ) or backends_started():
        return False
    jax.config.update("jax_num_cpu_devices", count)
    return True


def devices_note(requested: int, started: int, environ=os.environ) -> str:
    """Why this process has `started` CPU devices rather than `train.cpu_devices` (`requested`),
    for the run's banner; "" when they agree or nothing was requested."""
    if requested <= 0 or requested == started:
        return ""
    why = f"XLA_FLAGS' {DEVICE_COUNT_FLAG} set {started}" if _count_in_flags(environ) else \
        "JAX had started before it could be set"
    return f"; train.cpu_devices={requested} not applied: {why}"


def _count_in_flags(environ) -> bool:
    """Whether XLA_FLAGS fixes the CPU device count (it then wins over `train.cpu_devices`)."""
    return DEVICE_COUNT_FLAG in environ.get("XLA_FLAGS", "")


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (one arena, no mmap, no trim); True if it
    took effect, False where the C library is not glibc or JAX has started already (too late)."""
    from zaya_jax.kernels.xla_flags import backends_started

    global _applied
    libc = _glibc()
    if libc is None or backends_started():
        return False
    _applied = all(libc.mallopt(param, value) == 1 for param, value in _SETTINGS)
    return _applied


def applied() -> bool:
    """Whether `keep_freed_memory()` has taken effect in this process."""
    return _applied


def choice(environ=os.environ) -> str:
    """The `ZAYA_HOST_MALLOC` setting, checked: "keep" (default) or "system"."""
    from zaya_jax.errors import ZayaError

    value = environ.get(ENV, "keep").strip().lower() or "keep"
    if value not in CHOICES:
        raise ZayaError(f"{ENV}={environ[ENV]!r}: use 'keep' (reuse freed memory, the default on CPU) or "
                        "'system' (glibc's defaults)")
    return value


def will_run_on_cpu() -> bool:
    """Whether JAX's default backend will be the CPU, decided without starting it (`cpu_backend`
    of `jax_platforms` and the installed plugins)."""
    import jax

    return cpu_backend(jax.config.jax_platforms, _accelerator_plugins())


def cpu_backend(platforms: str | None, plugins: list[str]) -> bool:
    """The first of `platforms` (JAX_PLATFORMS) when set is "cpu"; unset, no accelerator plugin
    (CUDA, ROCm, TPU) is installed."""
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not plugins


def _accelerator_plugins() -> list[str]:
    names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    namespace = importlib.util.find_spec("jax_plugins")
    if namespace is not None and namespace.submodule_search_locations:
        names += [m.name for m in pkgutil.iter_modules(namespace.submodule_search_locations)]
    if importlib.util.find_spec("libtpu") is not None:
        names.append("libtpu")
    return names


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc
