"""Where the tests find the repository: its root, its experiments and the built-in default (tiny_cpu),
and its scripts (tools/, benchmarks/) as modules."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
TINY = os.path.join(EXPERIMENTS, "tiny_cpu.py")


def load_script(folder: str, name: str):
    """The script `folder/name.py` of the repository, imported as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
