"""Which implementation runs each hot-path kernel, and for which target: backend names, the
per-target defaults, and the kernel target itself.

Four kernels (`attention`, `grouped_matmul`, `rms_norm`, `linear_attention`) each have a
`reference` (plain jnp, the obviously-correct form every other backend is tested against), an
`xla` form (for the grouped matmul also `tiled`, XLA ops in the Pallas kernel's tile layout: the
CPU default; for linear attention the chunked form), and a `pallas` form (Triton lowering on CUDA
and ROCm, `interpret=True` on CPU). Vendor backends exist
on one GPU target only (`VENDOR_BACKENDS`): attention's `cudnn` (through
`jax.nn.dot_product_attention`, packed documents as a mask), and the grouped matmul's
`cudnn` and `hipblaslt` (XLA's `ragged_dot`, routed by an XLA flag to the vendor's grouped GEMM;
see `XLA_FLAGS`). `auto` picks the target's default below. Nothing here imports the kernels, so
the config can validate names cheaply.

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

KERNELS = ("attention", "grouped_matmul", "rms_norm", "linear_attention")
# The model config field that picks each kernel's backend (`ModelConfig.moe_kernel = "cudnn"`, ...).
KERNEL_FIELDS = {"attention_kernel": "attention", "moe_kernel": "grouped_matmul", "norm_kernel": "rms_norm",
                 "linear_kernel": "linear_attention"}

BACKENDS: dict[str, tuple[str, ...]] = {
    "attention": ("reference", "xla", "pallas", "cudnn"),
    "grouped_matmul": ("reference", "xla", "tiled", "pallas", "cudnn", "hipblaslt"),
    "rms_norm": ("reference", "xla", "pallas"),
    "linear_attention": ("reference", "xla", "pallas"),
}
TARGETS = ("cpu", "cuda", "rocm", "tpu")
GPU_TARGETS = ("cuda", "rocm")
_GPU_NAMES = {"cuda": "an NVIDIA GPU", "rocm": "an AMD GPU (ROCm)"}

# Backends that call one vendor's library, so exist on that target only: (kernel, backend) → target.
VENDOR_BACKENDS: dict[tuple[str, str], str] = {
    ("attention", "cudnn"): "cuda",
    ("grouped_matmul", "cudnn"): "cuda",
    ("grouped_matmul", "hipblaslt"): "rocm",
}

# The XLA flags a backend needs (space-separated): the one table of them (`kernels/xla_flags.py` sets them, the
# training banner names them). The `cudnn` and `hipblaslt` grouped matmuls compute exactly what
# `xla` does, through `jax.lax.ragged_dot`; what differs is how XLA's GPU compiler lowers that op.
# By default it expands it to a zero-padded dense batched matmul; these flags make it emit cuDNN's
# grouped GEMM (NVIDIA: the forward and the input gradient, per openxla/xla #40189; the weight
# gradient stays dense) or hipBLASLt's grouped GEMM (ROCm: bf16/fp16, "not fully optimized" per
# openxla/xla #38088). The choice is an XLA debug option, not an argument of the op: XLA reads
# XLA_FLAGS once, when JAX starts its backend, and it then holds for the whole process (every
# ragged_dot, including those called with backend='xla'). So the flag is the backend, and it must be
# in the environment before JAX starts; an unknown flag aborts the process, so every flag here is
# one this jaxlib (0.10.2) knows. XLA's rewriter takes hipBLASLt's grouped GEMM only where the
# cuBLASLt-named path is on as well (on ROCm it is hipBLASLt, for every GEMM of the program).
XLA_FLAGS: dict[tuple[str, str], str] = {
    ("grouped_matmul", "cudnn"): "--xla_gpu_experimental_use_ragged_dot_fusion=true",
    ("grouped_matmul", "hipblaslt"): "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true "
                                     "--xla_gpu_enable_cublaslt=true",
}

# What a backend is, where its name alone does not say (the training banner).
DESCRIPTIONS: dict[tuple[str, str], str] = {
    ("grouped_matmul", "cudnn"): "XLA ragged_dot → cuDNN grouped GEMM",
    ("grouped_matmul", "hipblaslt"): "XLA ragged_dot → hipBLASLt grouped GEMM",
}

# Why these defaults: on CPU, Pallas runs only through the (slow) interpreter, so XLA is the
# fast path; for the grouped matmul the `tiled` form, since XLA's CPU ragged_dot multiplies every
# row by every group's weight (G times the work; `kernels/tiled_grouped_matmul.py`). On GPUs,
# XLA's attention materialises [S, S] logits per head and XLA's ragged_dot
# becomes a dense padded batched matmul on NVIDIA (one expert's work per expert, repeated
# for all), so the Pallas kernels are the only scalable choice on both vendors. The vendor grouped
# GEMMs (`cudnn`, `hipblaslt`) are opt-in: untimed here, process-wide XLA flags, cuDNN's covers
# only the forward and input gradient, and XLA calls hipBLASLt's "not fully optimized".
# Linear attention's `xla` form is already linear in S (chunks), but XLA writes every chunk's
# [C, C] scores and states to memory; the Pallas kernel keeps the state on chip across the
# sequence. On TPU the chunked XLA form is the one we have (our Pallas kernels lower to Triton).
_PALLAS = {"attention": "pallas", "grouped_matmul": "pallas", "rms_norm": "pallas", "linear_attention": "pallas"}
DEFAULTS: dict[str, dict[str, str]] = {
    "cpu": {"attention": "xla", "grouped_matmul": "tiled", "rms_norm": "xla", "linear_attention": "xla"},
    "cuda": dict(_PALLAS),
    "rocm": dict(_PALLAS),
    "tpu": {"attention": "xla", "grouped_matmul": "xla", "rms_norm": "xla", "linear_attention": "xla"},
}

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("zaya_kernel_target", default=None)


def vendor_backend(kernel: str, target: str) -> str | None:
    """The backend of `kernel` that calls `target`'s vendor library (`VENDOR_BACKENDS`), if any."""
    return next((b for (k, b), t in VENDOR_BACKENDS.items() if k == kernel and t == target), None)


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
    # A compile-only device (`explore/deviceless.py`) says only "gpu": its kind names the vendor.
    amd = getattr(device, "device_kind", "").lower().startswith("amd")
    return "rocm" if "rocm" in names.lower() or "hip" in names.lower() or amd else "cuda"


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
    vendor = VENDOR_BACKENDS.get((kernel, backend))
    if vendor is not None and here != vendor:
        instead = [b for (k, b), t in VENDOR_BACKENDS.items() if k == kernel and t == here]
        instead += ["pallas", "xla"] if here != "tpu" else ["xla"]
        names = [f"'{b}'" for b in instead]
        raise ZayaError(f"the {backend} {kernel} backend needs {_GPU_NAMES[vendor]} (the target is {here}); use "
                        + (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]))
    return backend


def describe(kernel: str, backend: str) -> str:
    """A resolved backend as the banner names it: 'pallas', or 'cudnn (XLA ragged_dot → cuDNN grouped
    GEMM; --xla_gpu_experimental_use_ragged_dot_fusion=true)' where the name alone does not say."""
    notes = [n for n in (DESCRIPTIONS.get((kernel, backend)), XLA_FLAGS.get((kernel, backend))) if n]
    return f"{backend} ({'; '.join(notes)})" if notes else backend


def interpret_mode(interpret: bool | None) -> bool:
    """Pallas interpret mode: as given, or on exactly when the target is no GPU (nothing to compile for)."""
    return target() not in GPU_TARGETS if interpret is None else bool(interpret)
