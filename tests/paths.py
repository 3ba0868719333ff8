"""Where the tests find the repository: its root, its experiments and the built-in default (tiny_cpu)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
TINY = os.path.join(EXPERIMENTS, "tiny_cpu.py")
