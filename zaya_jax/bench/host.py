"""`zaya bench host`: this machine's matmul rate and memory bandwidth, for `zaya mesh --host`.

On one device: a square matmul per dtype (float32, bfloat16), timed as the median of a few calls
after a warm-up, in TFLOP/s; and a streaming pass over a 256 MiB array in place (read and write
it: `x ← 1.0001·x`) in GB/s. The device-to-device rate comes from `zaya bench collectives`. The numbers
replace a profile's peak and memory bandwidth (`hardware.measured`), so a CPU's explorer prices
its steps at what this host does, not at the nominal CPU profile's constants.
"""

from __future__ import annotations

import statistics
import time

MATMUL_SIZE = 2048  # large enough that the rate levels off on a CPU core, seconds per call at most
STREAM_BYTES = 256 * 1024 ** 2  # far beyond the caches


def measure(device, iters: int = 5) -> dict:
    import jax
    import jax.numpy as jnp

    out = {"tool": "zaya bench host", "platform": device.platform, "device_kind": device.device_kind,
           "matmul_tflops": {}, "matmul_size": MATMUL_SIZE}
    for dtype in ("float32", "bfloat16"):
        a = jax.device_put(jnp.ones((MATMUL_SIZE, MATMUL_SIZE), dtype), device)
        seconds = _median(jax.jit(lambda x: x @ x), a, iters)
        out["matmul_tflops"][dtype] = 2 * MATMUL_SIZE ** 3 / seconds / 1e12
    # In place (the input donated), as a train step updates its state: a fresh output each call
    # would time the operating system's first touch of new pages, not the memory.
    x = jax.device_put(jnp.ones((STREAM_BYTES // 4,), jnp.float32), device)
    out["memory_gb_per_s"] = 2 * STREAM_BYTES / _median(jax.jit(lambda v: v * 1.0001, donate_argnums=0), x, iters,
                                                        chained=True) / 1e9
    return out


def _median(fn, arg, iters: int, chained: bool = False) -> float:
    """Median seconds of `fn(arg)`; `chained`: each call takes the previous one's result (a donated input)."""
    import jax

    result = jax.block_until_ready(fn(arg))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        result = jax.block_until_ready(fn(result if chained else arg))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
