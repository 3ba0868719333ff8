"""XLA's GPU compiler without the GPUs: compile-only devices of a GPU an XLA target config describes.

JAX compiles for devices it does not have (`jax.experimental.topologies`). With JAX's CUDA plugin
installed beside the same jax (no GPU and no driver are used), an XLA GPU target config (the
device's limits, compute capability, kind and HBM; `benchmarks/gpu_targets/h100_sxm.txtpb` is an
H100 SXM's) gives nodes x gpus-per-node devices whose programs are XLA's GPU build: its passes, the
Pallas kernels through Triton and ptxas, its buffer assignment and memory analysis. Nothing runs.
A target whose `platform_name` is ROCM (`mi300x.txtpb`) compiles with XLA's ROCm compiler instead,
the Pallas kernels to AMDGPU code, through the set-up `explore/rocm_standin.py` describes.
`zaya mesh --validate --gpu-target` and `benchmarks/explorer_drawn_shapes.py` compile on them.
"""

from __future__ import annotations

from zaya_jax.errors import ZayaError

PLUGIN = 'pip install "jax[cuda12]==<this jax\'s version>" (no GPU or driver is needed)'


def read_target(path: str) -> str:
    """The text of an XLA GPU target config (a text proto)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ZayaError(f"--gpu-target {path}: {e.strerror}") from None


def gpu_devices(config: str, nodes: int, gpus_per_node: int, path: str) -> list:
    """nodes x gpus_per_node compile-only CUDA devices of the GPU `config` describes, node by node.

    JAX's backends must not have started on a GPU: the CUDA plugin registers its compiler without
    looking for a driver only while JAX runs on the CPU (`use_cpu_host`)."""
    from jax.experimental import topologies

    platform = target_platform(config)
    if platform == "rocm":
        from zaya_jax.explore import rocm_standin

        rocm_standin.register()
    try:
        topology = topologies.get_topology_desc(platform=platform, target_config=config,
                                                topology=f"1x{nodes}x{gpus_per_node}")
    except NotImplementedError:
        raise ZayaError(f"--gpu-target needs JAX's CUDA plugin for this jax: {PLUGIN}") from None
    except Exception as e:  # XLA's parse or topology error: its first line says which
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ZayaError(f"--gpu-target {path}: XLA refused it as a GPU target config ({first})") from None
    return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def target_platform(config: str) -> str:
    """'rocm' for a target config whose `platform_name` is ROCM (an AMD GPU), else 'cuda'."""
    import re

    named = re.search(r'^\s*platform_name:\s*"(\w+)"', config, re.MULTILINE)
    return "rocm" if named and named.group(1).upper() == "ROCM" else "cuda"


def use_cpu_host() -> None:
    """Run JAX itself on the CPU (before its backends start), so the CUDA plugin only compiles."""
    import os

    import jax

    from zaya_jax.kernels.xla_flags import backends_started

    if backends_started():
        if jax.default_backend() != "cpu":
            raise ZayaError("--gpu-target compiles without a GPU; this process already runs JAX on "
                            f"{jax.default_backend()}: run zaya mesh in a process of its own")
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
