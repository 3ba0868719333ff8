"""Layers point one way: cli → train → parallel → model → kernels. A module imports only its own
layer and those after it (the model never imports a schedule; the kernels never import the model)."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zaya_jax")
LAYERS = ("cli", "train", "parallel", "model", "kernels")


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "zaya_jax" or len(parts) < 2:
        return None
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def _imports(path: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _modules():
    for layer in LAYERS:
        path = os.path.join(ROOT, layer + ".py")
        files = [path] if os.path.isfile(path) else [
            os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, layer)) for f in fs if f.endswith(".py")]
        yield from ((layer, f) for f in sorted(files))


@pytest.mark.parametrize("layer, path", list(_modules()), ids=lambda x: os.path.relpath(x, ROOT) if "/" in x else x)
def test_no_module_imports_a_layer_above_its_own(layer, path):
    own = LAYERS.index(layer)
    upward = sorted({name for name in _imports(path) if _layer(name) is not None and _layer(name) < own})
    assert not upward, f"{os.path.relpath(path, ROOT)} ({layer}) imports {upward}"


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from zaya_jax.parallel import attention_layout\nimport zaya_jax.cli\n")
    assert {_layer(name) for name in _imports(str(bad))} >= {LAYERS.index("parallel"), LAYERS.index("cli")}
