"""Hot-path kernels with interchangeable backends: flash attention, grouped matmul, fused RMSNorm,
linear attention.

`ops` holds the entry points, `registry` the backend names, the kernel target (`targeting`) and
its defaults, `tuning` the block sizes, `resources` their shared memory against each device,
`gpu_lowering` the Pallas → Triton check for CUDA/ROCm on any machine, `reference` the plain-jnp
semantics, `xla_attention` the `xla` attention, `xla_backends` the other XLA and vendor forms,
and one `pallas_*` module per Pallas kernel (`pallas_dot`: the block product and launch they share).
`linear_attention` holds the linear-attention math (quadratic reference, chunked form: the
`reference` and `xla` backends) that the hybrid layers and LASP-2 build on; its registry entry point is `ops.linear_attention` (not re-exported here: the
name is the math module's, which `parallel/lasp2.py` imports from this package).
Pallas kernels are imported only when selected.
"""

from zaya_jax.kernels.ops import flash_attention, grouped_matmul, grouped_matmul_transposed, rms_norm
from zaya_jax.kernels.registry import BACKENDS, DEFAULTS, KERNELS, TARGETS, resolve, target, targeting

__all__ = ["flash_attention", "grouped_matmul", "grouped_matmul_transposed", "rms_norm",
           "BACKENDS", "DEFAULTS", "KERNELS", "TARGETS", "resolve", "target", "targeting"]
