"""Test setup: CPU only; 8 fake devices for the multi-device tests (set before jax is imported)."""

import os

from xla_test_flags import TEST_XLA_FLAGS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
if TEST_XLA_FLAGS not in flags:
    flags += " " + TEST_XLA_FLAGS
os.environ["XLA_FLAGS"] = flags.strip()
