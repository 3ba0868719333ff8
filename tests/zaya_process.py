"""Running `zaya` as a user does, in a child process with the tests' environment: CPU only, the
tests' XLA flags, as many fake devices as asked, and none of the variables a launcher hands its
processes (coordinator, process count and id, attempt, node) that whoever started pytest may hold,
nor the CPU thread count this process set for its own devices (the run sizes its own: `cpu_host`)."""

import os
import subprocess
import sys

from paths import ROOT
from zaya_jax.cpu_host import THREAD_COUNT_ENV
from zaya_jax.train.events import ATTEMPT_ENV
from xla_test_flags import TEST_XLA_FLAGS, xla_flags

JOB_VARIABLES = ("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS", "ZAYA_NODE", *ATTEMPT_ENV.values())


def zaya_env(devices: int | None = 1, flags: str = TEST_XLA_FLAGS, **extra: str) -> dict:
    """The child's environment; `devices=None` leaves the device count to the run (its config's
    `train.cpu_devices`, or `zaya launch --cpu-devices`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(JOB_VARIABLES) and k not in THREAD_COUNT_ENV}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags if devices is None else xla_flags(devices, flags))
    return {**env, **extra}


def zaya_argv(*args: str, module: tuple[str, ...] = ("-m", "zaya_jax")) -> list[str]:
    """`zaya ARGS` as a command line; `module` replaces `-m zaya_jax` (a wrapper script, say)."""
    return [sys.executable, *module, *args]


def zaya(*args: str, devices: int | None = 1, flags: str = TEST_XLA_FLAGS, env: dict | None = None,
         timeout: float = 600, module: tuple[str, ...] = ("-m", "zaya_jax")) -> subprocess.CompletedProcess:
    """Run `zaya ARGS` to its end from the repository root; stdout and stderr captured as text."""
    return subprocess.run(zaya_argv(*args, module=module), capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=env if env is not None else zaya_env(devices, flags))


def zaya_started(*args: str, env: dict) -> subprocess.Popen:
    """`zaya ARGS` started and left running (stdout and stderr piped as text)."""
    return subprocess.Popen(zaya_argv(*args), env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def python_probe(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -c CODE` in a fresh interpreter (what a new process imports or loads), from the
    repository root with the test process's environment on CPU; output captured as text."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
