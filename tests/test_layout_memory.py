"""tools/layout_memory.py: compiles the study model per layout and writes its table; bad flags are one line."""

import json
import os
import subprocess
import sys
from paths import ROOT

TOOL = os.path.join(ROOT, "tools", "layout_memory.py")


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_small_study_writes_the_table(tmp_path):
    out = tmp_path / "mem"
    result = _run("--seq-len", "128", "--layers", "1", "--hidden", "512", "--layouts", "sp,tsp", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {r["layout"]: r for r in json.loads((tmp_path / "mem.json").read_text())["rows"]}
    # Same activations split 8 ways, but SP keeps every weight and its optimizer state whole.
    assert rows["tsp"]["arguments"] < rows["sp"]["arguments"] / 4
    assert "| tsp | tsp 8 |" in (tmp_path / "mem.md").read_text()


def test_unknown_layout_is_one_line():
    result = _run("--layouts", "tp,zigzag")
    assert result.returncode == 2
    assert result.stderr.strip() == "layout_memory: error: unknown layout zigzag; choose from tp, sp, tp2_sp4, tp4_sp2, tsp"


def test_bad_sizes_are_one_line():
    result = _run("--hidden", "100")
    assert result.returncode == 2
    assert result.stderr.strip() == ("layout_memory: error: --seq-len must be >= 64, --layers >= 1 and --hidden a "
                                     "multiple of 64")
