"""The XLA flags every test process starts with: this pytest process and the runs it starts.

`--xla_backend_optimization_level=0` has LLVM compile XLA's generated CPU code without
optimisation: a `tiny_cpu` train step then compiles in ~9 s instead of ~14 s on 2 cores. The
tests' runs are a few steps each, so compiling is most of their time; the matmuls run in the same
precompiled libraries either way, and every run a test compares with another starts with these
flags.
"""

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's child process with `devices` fake CPU devices."""
    return f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={devices}"
