"""Test setup: CPU only; 8 fake devices for the multi-device tests (set before jax starts) and the
CPU threads their collectives need (`cpu_host.threads_for_devices`); one persistent compilation
cache for the whole test run.

The cache is shared by every pytest-xdist worker and every run a test starts (they inherit the
environment, and the trainer's default cache is `JAX_COMPILATION_CACHE_DIR` when that is set), so
a program that several tests compile (the same step resumed, restarted, or trained again under
another name) is compiled once. It lives for one `pytest` invocation: the process that made it
removes it at the end.

Under pytest-xdist (`-n 2`, the default `load` distribution), tests that share a module-scoped
fixture (a trained run, a compiled reference) go to one worker as one unit, so the fixture is made
once per run, not once per worker (xdist's own `loadgroup` cannot do this on pytest 9.2, whose
items no longer take a renamed node id).

The quick tier (`-m "not slow"`) leaves out the tests marked `slow` in their source and those
listed in `tests/slow_tests.txt` (the measured slowest; `tools/slow_tests.py` makes the list).
"""

import json
import logging
import os
import shutil
import tempfile

import pytest
from xla_test_flags import TEST_XLA_FLAGS

from zaya_jax import cpu_host

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
if TEST_XLA_FLAGS not in flags:
    flags += " " + TEST_XLA_FLAGS
os.environ["XLA_FLAGS"] = flags.strip()
cpu_host.threads_for_flagged_devices()  # as `zaya` does: XLA:CPU's collectives need the threads

_CACHE_MADE_HERE = None
_GROUPS_MADE_HERE = None
if "ZAYA_TEST_GROUPS" not in os.environ:  # the controller (the workers inherit it): where they write the groups
    _GROUPS_MADE_HERE = os.environ["ZAYA_TEST_GROUPS"] = tempfile.mkdtemp(prefix="zaya-test-groups-")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE_MADE_HERE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zaya-tests-compile-cache-")
    # The tests' compiles are short (their XLA flags halve them); most are worth keeping.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_unconfigure(config):
    for made in (_CACHE_MADE_HERE, _GROUPS_MADE_HERE):
        if made:
            shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def compiles(caplog):
    """The names of the programs XLA compiles inside the `with` block it returns (`.names`)."""
    import jax

    class Counter:
        def __enter__(self):
            caplog.clear()
            self._log = jax.log_compiles(True)
            self._log.__enter__()
            return self

        def __exit__(self, *exc):
            self._log.__exit__(*exc)
            self.names = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("Compiling")]

    caplog.set_level(logging.WARNING)
    return Counter()


def _listed_slow() -> set[str]:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")
    with open(path) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    slow = _listed_slow()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _write_groups(_module_fixture_groups(items))


def _module_fixture_groups(items) -> dict[str, str]:
    """{test id: group} joining the tests that share a module-scoped fixture, directly or through
    another such fixture."""
    parent: dict = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    first = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        names = [(item.module.__name__, name) for name in item.fixturenames
                 if info and info.name2fixturedefs.get(name) and info.name2fixturedefs[name][-1].scope == "module"]
        for other in names[1:]:
            parent[root(other)] = root(names[0])
        if names:
            first[item.nodeid] = names[0]
    return {nodeid: "{}:{}".format(*root(name)) for nodeid, name in first.items()}


def _groups_path() -> str:
    return os.path.join(os.environ["ZAYA_TEST_GROUPS"], "groups.json")


def _write_groups(groups: dict[str, str]) -> None:
    """Each worker writes the same map (collection is identical); the controller reads it once
    every worker has collected."""
    tmp = f"{_groups_path()}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(groups, f)
    os.replace(tmp, _groups_path())


def pytest_xdist_make_scheduler(config, log):
    """xdist's load distribution, with each module-fixture group dealt as one unit."""
    if config.getvalue("dist") != "load":
        return None  # a distribution asked for by name is left alone
    from xdist.scheduler import LoadScopeScheduling

    class FixtureGroupScheduling(LoadScopeScheduling):
        groups = None

        def _split_scope(self, nodeid):
            if self.groups is None:
                with open(_groups_path()) as f:
                    self.groups = json.load(f)
            return self.groups.get(nodeid, nodeid)

    return FixtureGroupScheduling(config, log)
