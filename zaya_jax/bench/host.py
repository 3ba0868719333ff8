"""`zaya bench host`: this machine's matmul rate and memory bandwidth, for `zaya mesh --host`.

Per device, with every device of the process running at once: a square matmul per dtype (float32, bfloat16), timed as the median of a few calls
after a warm-up, in TFLOP/s, at 2048 (the rate) and at the smaller sizes a model's own matmuls
have (`matmul_curve`: FLOPs per call against TFLOP/s; a CPU core reaches a third of its rate on
a 128-wide matmul); a streaming pass over a 256 MiB array in place (read and write it:
`x ← 1.0001·x`) in GB/s; and the rate of an activation-sized elementwise kernel (an RMS norm of a
[4096, 256] fp32 array, its input read and its output written: `elementwise_gb_per_s`), the
rate the step's memory-bound work runs at. The device-to-device rate comes from `zaya bench collectives`. The numbers
replace a profile's peak and memory bandwidth (`hardware.measured`), so a CPU's explorer prices
its steps at what this host does, not at the nominal CPU profile's constants.
"""

from __future__ import annotations

import statistics
import time

MATMUL_SIZE = 2048  # large enough that the rate levels off on a CPU core, seconds per call at most
CURVE_SIZES = (64, 128, 256, 512, 1024)  # below MATMUL_SIZE: the widths of small models' matmuls
ELEMENTWISE_SHAPE = (4096, 256)  # 4 MiB fp32: one layer's activations of a small model on a device
STREAM_BYTES = 256 * 1024 ** 2  # far beyond the caches


def measure(devices, iters: int = 5) -> dict:
    """Every rate per device while all `devices` run it at once (a batch of one problem per
    device, split over them): the devices of one host share its cores and memory, as in a step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    d = len(devices)

    def placed(shape, dtype):
        return jax.device_put(jnp.ones((d, *shape), dtype), split)

    out = {"tool": "zaya bench host", "platform": devices[0].platform, "device_kind": devices[0].device_kind,
           "devices": d, "matmul_tflops": {}, "matmul_size": MATMUL_SIZE, "matmul_curve": {}}
    matmul = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x), out_shardings=split)
    for dtype in ("float32", "bfloat16"):
        curve = []
        for n in CURVE_SIZES + (MATMUL_SIZE,):
            seconds = _median(matmul, placed((n, n), dtype), iters if n == MATMUL_SIZE else 4 * iters)
            curve.append([2 * n ** 3, 2 * n ** 3 / seconds / 1e12])
        out["matmul_curve"][dtype] = curve
        out["matmul_tflops"][dtype] = curve[-1][1]
    norm = jax.jit(lambda v: v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-6), out_shardings=split)
    act = placed(ELEMENTWISE_SHAPE, jnp.float32)
    out["elementwise_gb_per_s"] = 2 * act.nbytes / d / _median(norm, act, 4 * iters) / 1e9
    # In place (the input donated), as a train step updates its state: a fresh output each call
    # would time the operating system's first touch of new pages, not the memory.
    stream = max(STREAM_BYTES // d, 32 * 1024 ** 2)
    x = placed((stream // 4,), jnp.float32)
    out["memory_gb_per_s"] = 2 * stream / _median(jax.jit(lambda v: v * 1.0001, donate_argnums=0, out_shardings=split),
                                                  x, iters, chained=True) / 1e9
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
