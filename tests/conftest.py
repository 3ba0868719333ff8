"""Test setup: CPU only; 8 fake devices for the multi-device tests (set before jax is imported);
one persistent compilation cache for the whole test run.

The cache is shared by every pytest-xdist worker and every run a test starts (they inherit the
environment, and the trainer's default cache is `JAX_COMPILATION_CACHE_DIR` when that is set), so
a program that several tests compile (the same step resumed, restarted, or trained again under
another name) is compiled once. It lives for one `pytest` invocation: the process that made it
removes it at the end.

The quick tier (`-m "not slow"`) leaves out the tests marked `slow` in their source and those
listed in `tests/slow_tests.txt` (the measured slowest; `tools/slow_tests.py` makes the list).
"""

import os
import shutil
import tempfile

import pytest
from xla_test_flags import TEST_XLA_FLAGS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
if TEST_XLA_FLAGS not in flags:
    flags += " " + TEST_XLA_FLAGS
os.environ["XLA_FLAGS"] = flags.strip()

_CACHE_MADE_HERE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE_MADE_HERE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zaya-tests-compile-cache-")
    # The tests' compiles are short (their XLA flags halve them); most are worth keeping.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_unconfigure(config):
    if _CACHE_MADE_HERE:
        shutil.rmtree(_CACHE_MADE_HERE, ignore_errors=True)


def _listed_slow() -> set[str]:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")
    with open(path) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    slow = _listed_slow()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
