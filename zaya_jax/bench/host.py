"""`zaya bench host`: this machine's matmul rate and memory bandwidth, for `zaya mesh --host`.

Per device, with every device of the process running at once: a square matmul per dtype
(float32, bfloat16) in TFLOP/s, at 2048 (the rate) and at the smaller widths a model's own
matmuls have (`matmul_curve`: FLOPs per matmul against TFLOP/s), the smaller ones many to a timed
call in a loop so the call's dispatch is not in their time (a jitted call costs tens of
microseconds on a CPU; an operation inside a step, a few); a streaming pass over a large array
in place (read and write it: `x ← 1.0001·x`) in GB/s; and the rate of an activation-sized
elementwise kernel (an RMS norm of a [4096, 256] fp32 array, read and written, 16 to a call:
`elementwise_gb_per_s`), the rate the step's memory-bound work runs at. Each is the median of a
few timed calls after a warm-up. The device-to-device rate comes from `zaya bench collectives`. The numbers
replace a profile's peak and memory bandwidth (`hardware.measured`), so a CPU's explorer prices
its steps at what this host does, not at the nominal CPU profile's constants.
"""

from __future__ import annotations

import statistics
import time

MATMUL_SIZE = 2048  # large enough that the rate levels off on a CPU core, seconds per call at most
CURVE_SIZES = (64, 128, 256, 512, 1024)  # below MATMUL_SIZE: the widths of small models' matmuls
LOOP_FLOPS = 2 ** 31  # per timed call of the smaller matmuls: many of them in one loop
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
    def looped(op, times: int):
        """`op` applied `times` times in one call: no dispatch between the operations, as in a step."""
        return jax.jit(lambda v: jax.lax.fori_loop(0, times, lambda _, w: op(w), v), out_shardings=split), times

    for dtype in ("float32", "bfloat16"):
        curve = []
        for n in CURVE_SIZES + (MATMUL_SIZE,):
            # x·x/n keeps a matrix of ones one: the loop neither overflows nor folds away
            fn, times = looped(lambda w, n=n: jnp.einsum("bij,bjk->bik", w, w) * (1.0 / n),
                               max(1, LOOP_FLOPS // (2 * n ** 3)))
            seconds = _median(fn, placed((n, n), dtype), iters) / times
            curve.append([2 * n ** 3, 2 * n ** 3 / seconds / 1e12])
        out["matmul_curve"][dtype] = curve
        out["matmul_tflops"][dtype] = curve[-1][1]
    norm, times = looped(lambda v: v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-6), 16)
    act = placed(ELEMENTWISE_SHAPE, jnp.float32)
    out["elementwise_gb_per_s"] = 2 * act.nbytes / d / (_median(norm, act, iters) / times) / 1e9
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
