"""JAX's internals behind one door: every reach resolves on the installed JAX, a moved one is a
one-line error naming the JAX version, and no other module reaches past JAX's public API."""

import importlib
import os
import re

import jax
import pytest

from zaya_jax import jax_compat
from zaya_jax.errors import ZayaError

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zaya_jax")
PRIVATE = re.compile(r"jax\._src|_src\.|experimental_orbax|/jax/compilation_cache")


def test_every_reach_resolves_on_the_installed_jax():
    found = jax_compat.reaches()
    assert callable(found["backends_started"]) and callable(found["reset_compilation_cache"])
    assert callable(found["triton_module_builder"]) and callable(found["cache_write"])
    assert hasattr(found["distributed_state"], "client")
    assert isinstance(jax_compat.backends_started(), bool)
    assert jax_compat.in_distributed_run() is False  # this process joined no job


def test_the_orbax_barrier_flag_is_set_where_orbax_reads_it():
    from absl import flags

    before = flags.FLAGS["experimental_orbax_use_distributed_barrier"].value if (
        "experimental_orbax_use_distributed_barrier" in flags.FLAGS) else None
    try:
        jax_compat.use_orbax_coordination_barriers()
        assert flags.FLAGS.experimental_orbax_use_distributed_barrier is True
    finally:
        if before is not None:
            flags.FLAGS.experimental_orbax_use_distributed_barrier = before


@pytest.mark.parametrize("reach, module", [(jax_compat.backends_started, "jax._src.xla_bridge"),
                                           (lambda: jax_compat.wait_at_barrier("x", 1), "jax._src.distributed"),
                                           (jax_compat.cache_entries_from_every_process, "jax._src.compiler")])
def test_a_moved_reach_is_one_line_naming_the_jax_version(monkeypatch, reach, module):
    real = importlib.import_module

    def moved(name, *args):
        if name == module:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", moved)
    with pytest.raises(ZayaError) as caught:
        reach()
    message = str(caught.value)
    assert f"in jax {jax.__version__}" in message and module in message and "\n" not in message


def test_no_other_module_reaches_past_the_public_api():
    offenders = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != jax_compat.__file__:
                for number, line in enumerate(open(path), start=1):
                    if PRIVATE.search(line):
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not offenders, "reach JAX's internals through zaya_jax/jax_compat.py:\n" + "\n".join(offenders)
