"""Which implementation runs each hot-path kernel: the backend names, the per-platform defaults.

Three kernels (`attention`, `grouped_matmul`, `rms_norm`) each have a `reference` (plain jnp,
the obviously-correct form every other backend is tested against), an `xla` form, and a
`pallas` form (Triton lowering on CUDA and ROCm, `interpret=True` on CPU). Attention also has
`cudnn` (NVIDIA only, through `jax.nn.dot_product_attention`). `auto` picks the platform
default below. Nothing here imports the kernels, so the config can validate names cheaply.
"""

from __future__ import annotations

import jax

from zaya_jax.errors import ZayaError

KERNELS = ("attention", "grouped_matmul", "rms_norm")
BACKENDS: dict[str, tuple[str, ...]] = {
    "attention": ("reference", "xla", "pallas", "cudnn"),
    "grouped_matmul": ("reference", "xla", "pallas"),
    "rms_norm": ("reference", "xla", "pallas"),
}

# Why these defaults: on CPU, Pallas runs only through the (slow) interpreter, so XLA is the
# fast path. On GPUs, XLA's attention materialises [S, S] logits per head and XLA's ragged_dot
# becomes a dense padded batched matmul on NVIDIA (one expert's work per expert, repeated
# for all), so the Pallas kernels are the only scalable choice on both vendors.
DEFAULTS: dict[str, dict[str, str]] = {
    "cpu": {"attention": "xla", "grouped_matmul": "xla", "rms_norm": "xla"},
    "gpu": {"attention": "pallas", "grouped_matmul": "pallas", "rms_norm": "pallas"},
    "tpu": {"attention": "xla", "grouped_matmul": "xla", "rms_norm": "xla"},
}


def platform() -> str:
    """'cpu', 'gpu' (CUDA or ROCm) or 'tpu' for the default JAX backend."""
    name = jax.default_backend()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def gpu_vendor() -> str | None:
    """'cuda', 'rocm' or None: the default backend's GPU vendor."""
    if platform() != "gpu":
        return None
    client = jax.devices()[0].client
    names = f"{getattr(client, 'platform_name', '')} {getattr(client, 'platform_version', '')}".lower()
    return "rocm" if "rocm" in names or "hip" in names else "cuda"


def check_name(kernel: str, backend: str, where: str = "backend") -> None:
    """Raise ZayaError unless `backend` is 'auto' or a known backend of `kernel`."""
    choices = ("auto",) + BACKENDS[kernel]
    if backend not in choices:
        raise ZayaError(f"{where} must be one of {choices} for the {kernel} kernel, got {backend!r}")


def resolve(kernel: str, backend: str | None) -> str:
    """The concrete backend for `kernel`: `backend` itself, or the platform default for None/'auto'."""
    backend = "auto" if backend is None else backend
    check_name(kernel, backend)
    here = platform()
    if backend == "auto":
        return DEFAULTS.get(here, DEFAULTS["cpu"])[kernel]
    if backend == "pallas" and here == "tpu":
        raise ZayaError(f"the pallas {kernel} kernel uses the Triton lowering (GPUs, or CPU interpret "
                        "mode); on TPU use 'xla'")
    if backend == "cudnn" and gpu_vendor() != "cuda":
        raise ZayaError(f"the cudnn attention backend needs an NVIDIA GPU (this platform is {here}"
                        f"{'/' + gpu_vendor() if gpu_vendor() else ''}); use 'pallas' or 'xla'")
    return backend


def interpret_mode(interpret: bool | None) -> bool:
    """Pallas interpret mode: as given, or on exactly when there is no GPU to compile for."""
    return platform() != "gpu" if interpret is None else bool(interpret)
