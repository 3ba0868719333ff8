"""Which implementation runs each hot-path kernel, and for which target: backend names, the
per-target defaults, and the kernel target itself.

Three kernels (`attention`, `grouped_matmul`, `rms_norm`) each have a `reference` (plain jnp,
the obviously-correct form every other backend is tested against), an `xla` form, and a
`pallas` form (Triton lowering on CUDA and ROCm, `interpret=True` on CPU). Attention also has
`cudnn` (NVIDIA only, through `jax.nn.dot_product_attention`). `auto` picks the target's default
below. Nothing here imports the kernels, so the config can validate names cheaply.

**The target** is the platform the kernels are traced for: `cpu`, `cuda`, `rocm` or `tpu`. It
decides what `auto` means, whether Pallas runs interpreted, and which row of `tuning.TABLE`
sets the block sizes. By default it is this machine's (`machine_target()`); a program built
for other devices says so with `targeting(...)` around its tracing, exactly as it hands the
model its mesh. That is how a CPU machine lowers the real GPU program
(`tools/lower_for_gpu.py`, `Program.lower_train_step`).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from zaya_jax.errors import ZayaError

KERNELS = ("attention", "grouped_matmul", "rms_norm")
BACKENDS: dict[str, tuple[str, ...]] = {
    "attention": ("reference", "xla", "pallas", "cudnn"),
    "grouped_matmul": ("reference", "xla", "pallas"),
    "rms_norm": ("reference", "xla", "pallas"),
}
TARGETS = ("cpu", "cuda", "rocm", "tpu")
GPU_TARGETS = ("cuda", "rocm")

# Why these defaults: on CPU, Pallas runs only through the (slow) interpreter, so XLA is the
# fast path. On GPUs, XLA's attention materialises [S, S] logits per head and XLA's ragged_dot
# becomes a dense padded batched matmul on NVIDIA (one expert's work per expert, repeated
# for all), so the Pallas kernels are the only scalable choice on both vendors.
_PALLAS = {"attention": "pallas", "grouped_matmul": "pallas", "rms_norm": "pallas"}
DEFAULTS: dict[str, dict[str, str]] = {
    "cpu": {"attention": "xla", "grouped_matmul": "xla", "rms_norm": "xla"},
    "cuda": dict(_PALLAS),
    "rocm": dict(_PALLAS),
    "tpu": {"attention": "xla", "grouped_matmul": "xla", "rms_norm": "xla"},
}

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("zaya_kernel_target", default=None)


def check_target(name: str) -> str:
    if name not in TARGETS:
        raise ZayaError(f"kernel target must be one of {TARGETS}, got {name!r}")
    return name


@contextlib.contextmanager
def targeting(name: str | None):
    """Kernels traced inside are built for target `name` (None: leave the target as it is)."""
    if name is None:
        yield
        return
    token = _TARGET.set(check_target(name))
    try:
        yield
    finally:
        _TARGET.reset(token)


def target() -> str:
    """The kernel target: the enclosing `targeting(...)`, else this machine's."""
    return _TARGET.get() or machine_target()


def machine_target() -> str:
    """This machine's target: the default JAX backend, with GPUs told apart by vendor."""
    return device_target(jax.devices()[0])


def device_target(device) -> str:
    """'cpu', 'cuda', 'rocm' or 'tpu' for one JAX device."""
    if device.platform in ("cpu", "tpu"):
        return device.platform
    client = device.client
    names = f"{device.platform} {getattr(client, 'platform_name', '')} {getattr(client, 'platform_version', '')}"
    return "rocm" if "rocm" in names.lower() or "hip" in names.lower() else "cuda"


def platform() -> str:
    """'cpu', 'gpu' (CUDA or ROCm) or 'tpu': the target's platform family."""
    here = target()
    return "gpu" if here in GPU_TARGETS else here


def gpu_vendor() -> str | None:
    """'cuda', 'rocm' or None: the target's GPU vendor."""
    here = target()
    return here if here in GPU_TARGETS else None


def check_name(kernel: str, backend: str, where: str = "backend") -> None:
    """Raise ZayaError unless `backend` is 'auto' or a known backend of `kernel`."""
    choices = ("auto",) + BACKENDS[kernel]
    if backend not in choices:
        raise ZayaError(f"{where} must be one of {choices} for the {kernel} kernel, got {backend!r}")


def resolve(kernel: str, backend: str | None) -> str:
    """The concrete backend for `kernel` on the target: `backend` itself, or the default for None/'auto'."""
    backend = "auto" if backend is None else backend
    check_name(kernel, backend)
    here = target()
    if backend == "auto":
        return DEFAULTS[here][kernel]
    if backend == "pallas" and here == "tpu":
        raise ZayaError(f"the pallas {kernel} kernel uses the Triton lowering (GPUs, or CPU interpret "
                        "mode); on TPU use 'xla'")
    if backend == "cudnn" and here != "cuda":
        raise ZayaError(f"the cudnn attention backend needs an NVIDIA GPU (the target is {here}); "
                        "use 'pallas' or 'xla'")
    return backend


def interpret_mode(interpret: bool | None) -> bool:
    """Pallas interpret mode: as given, or on exactly when the target is no GPU (nothing to compile for)."""
    return target() not in GPU_TARGETS if interpret is None else bool(interpret)
