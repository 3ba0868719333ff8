"""The XLA flags every test process starts with: this pytest process and the runs it starts.

The tests' runs are a few steps each, so compiling is most of their time; the matmuls run in the
same precompiled libraries whatever these flags say, and every run a test compares with another
starts with the same flags.

- `--xla_backend_optimization_level=0`: LLVM compiles XLA's generated CPU code without
  optimisation (a `tiny_cpu` train step compiles in about half the time).
- `--xla_cpu_use_fusion_emitters=false` (jaxlib 0.10 only; later XLA has no other emitters):
  fusions are emitted element by element instead of through the MLIR fusion pipeline, which
  halves what is left of the compile again.
"""

from importlib.metadata import version


def jaxlib_minor() -> tuple[int, int]:
    major, minor = version("jaxlib").split(".")[:2]
    return int(major), int(minor)


TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if jaxlib_minor() < (0, 11):
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int, base: str = TEST_XLA_FLAGS) -> str:
    """XLA_FLAGS for a test's child process with `devices` fake CPU devices (and the `base` flags)."""
    return f"{base} --xla_force_host_platform_device_count={devices}".strip()


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is importable here (deviceless GPU compiles then work; CI has none)."""
    import importlib.util

    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins at all
        return False
