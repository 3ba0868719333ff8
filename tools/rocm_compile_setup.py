"""Set up XLA's ROCm compiler on a machine without an AMD GPU, for compiling only.

    python tools/rocm_compile_setup.py [--dir DIR]

Installs JAX's ROCm plugin wheels of the installed JAX's version (`jax-rocm7-pjrt`,
`jax-rocm7-plugin`) into DIR with `pip --target` (never into the environment, where JAX would try
to start them), then builds stand-ins for the ROCm runtime libraries the plugin links against,
from its own undefined symbols (`zaya_jax/explore/rocm_standin.py`; gcc and binutils), and checks
the result by compiling a bf16 matmul and a Pallas kernel for an MI300X in a fresh process. After
it, `zaya mesh --validate --gpu-target benchmarks/gpu_targets/mi300x.txtpb` and
`tools/gpu_census.py --gpu-target ...mi300x.txtpb` compile for AMD GPUs here.

DIR defaults to `~/.cache/zaya-jax/rocm-compile-jax<version>` (or `ZAYA_ROCM_COMPILE_DIR`), where
those commands look. Nothing here can run a program: the stand-ins abort if anything but the
compiler calls them. Bad input or a failed step is one line `rocm_compile_setup: error: ...`, exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

# gpu_check's bad-input convention (one line, exit 2) and its writable-folder check.
from gpu_check import UsageError, _Parser, check_writable  # noqa: E402
TARGET = os.path.join(ROOT, "benchmarks", "gpu_targets", "mi300x.txtpb")
WHEELS = ("jax-rocm7-pjrt", "jax-rocm7-plugin")

# Run in a process of its own: the plugin registers only where JAX has not started.
CHECK = """
import sys, time
start = time.perf_counter()
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from zaya_jax.explore import deviceless
target = sys.argv[1]
deviceless.use_cpu_host()
[device] = deviceless.gpu_devices(deviceless.read_target(target), 1, 1, target)
on = jax.sharding.SingleDeviceSharding(device)
a = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=on)
jax.jit(lambda x, y: x @ y).trace(a, a).lower().compile()
def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
kernel = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
                        compiler_params=pltriton.CompilerParams())
jax.jit(kernel).trace(a).lower().compile()
print(f"{device.device_kind}: a bf16 matmul and a Pallas kernel compile ({time.perf_counter() - start:.1f} s)")
"""


def main(argv=None) -> int:
    from zaya_jax.errors import ZayaError
    from zaya_jax.explore import rocm_standin

    try:
        p = _Parser(description=__doc__.split("\n")[0], allow_abbrev=False)
        p.add_argument("--dir", default=None, help="where to set up (default: the directory zaya mesh looks in)")
        args = p.parse_args(argv)
        setup = os.path.abspath(args.dir or rocm_standin.setup_dir())
        check_writable(setup, "--dir")
        install(setup)
        start = time.perf_counter()
        made = rocm_standin.build([os.path.join(setup, rocm_standin.PLUGIN_LIBRARY)],
                                  os.path.join(setup, rocm_standin.STANDIN_DIR))
        print(f"rocm_compile_setup: {len(made)} stand-in libraries in {time.perf_counter() - start:.1f} s: "
              + ", ".join(os.path.basename(m) for m in made))
        print("rocm_compile_setup: " + check(setup))
    except (UsageError, ZayaError) as e:
        print(f"rocm_compile_setup: error: {e}", file=sys.stderr)
        return 2
    print(f"rocm_compile_setup: ready in {setup}")
    return 0


def install(setup: str) -> None:
    """The plugin wheels of this JAX's version, into `setup` (not the environment)."""
    import jax

    specs = [f"{name}=={jax.__version__}" for name in WHEELS]
    print(f"rocm_compile_setup: installing {' '.join(specs)} into {setup}", flush=True)
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
                          "--target", setup, *specs], capture_output=True, text=True)
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise UsageError(f"could not install {' '.join(specs)} ({last}); the ROCm compile set-up needs the "
                         "plugin of this JAX's version from the package index (AMD publishes it later than JAX: "
                         "`pip index versions jax-rocm7-plugin` lists them; compile in a venv with one of those "
                         "jax versions)")


def check(setup: str) -> str:
    env = {**os.environ, "ZAYA_ROCM_COMPILE_DIR": setup, "JAX_PLATFORMS": ""}
    run = subprocess.run([sys.executable, "-c", CHECK, TARGET], capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    if run.returncode or not lines:
        tail = [line for line in run.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        raise UsageError(f"the set-up does not compile for {os.path.basename(TARGET)}: {tail[0]}")
    return lines[-1]


if __name__ == "__main__":
    raise SystemExit(main())
