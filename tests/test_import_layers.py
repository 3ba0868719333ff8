"""Layers point one way. The spine is cli → train → parallel → model → kernels; every other package
and top-level module of `zaya_jax` has its place in `LAYERS` too. A module imports only its own
layer and those after it (the model never imports a schedule; the kernels never import the model;
nothing below the CLI imports it), and a new package must be given a place here."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zaya_jax")
# Top to bottom; the units of one layer may import each other.
LAYERS = (
    ("__main__", "cli"),
    ("bench", "generation_command", "eval_command"),
    ("explore",),
    ("cluster",),
    ("train",),
    ("experiment",),
    ("api", "checkpoint", "generation", "harness"),
    ("parallel", "data"),
    ("model",),
    ("config", "cpu_host", "jax_environment"),
    ("kernels",),
    ("hardware", "jax_compat", "drills", "trees", "sizes", "storage"),
    ("errors",),
    ("exit_codes",),
)
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}
PACKAGE_ROOT = "__init__"  # `zaya_jax` itself: the public surface, above every layer


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "zaya_jax" or len(parts) < 2:
        return None
    name = parts[1]
    return name if os.path.isdir(os.path.join(ROOT, name)) or os.path.isfile(os.path.join(ROOT, name + ".py")) else None


def _imports(path: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _modules():
    for folder, _, files in os.walk(ROOT):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT).split(os.sep)[0].removesuffix(".py"), path


MODULES = sorted(_modules())


def test_every_unit_has_a_layer():
    units = {unit for unit, _ in MODULES} - {PACKAGE_ROOT}
    assert units <= set(LEVEL), f"give these a place in LAYERS: {sorted(units - set(LEVEL))}"


@pytest.mark.parametrize("unit, path", [m for m in MODULES if m[0] != PACKAGE_ROOT],
                         ids=lambda x: os.path.relpath(x, ROOT) if os.sep in x else x)
def test_no_module_imports_a_layer_above_its_own(unit, path):
    own = LEVEL[unit]
    upward = sorted({name for name in _imports(path)
                     if _unit(name) is not None and LEVEL.get(_unit(name), own) < own})
    assert not upward, f"{os.path.relpath(path, ROOT)} ({unit}) imports {upward}"


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from zaya_jax.parallel import attention_schedule\nimport zaya_jax.cli\nfrom zaya_jax import config\n")
    assert {_unit(name) for name in _imports(str(bad))} >= {"parallel", "cli", "config"}
    assert LEVEL["parallel"] < LEVEL["model"] < LEVEL["config"] < LEVEL["kernels"]
