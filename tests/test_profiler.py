"""The profiler window (`train.profile_steps`): a trace of exactly the window's steps under the
workdir, nothing without it, and named scopes that make the trace and the HLO read like the model."""

import glob
import gzip
import io
import json
import os
import re

import jax
import pytest

from zaya_jax.errors import ZayaError
from zaya_jax.experiment import load_experiment
from zaya_jax.experiment.validate import profile_window
from zaya_jax.train.events import read_events
from zaya_jax.train.loop import train
from zaya_jax.train.program import build_program
from paths import TINY

SMALL = ["--config.train.steps=5", "--config.train.seq_len=32", "--config.train.global_batch_size=4",
         "--config.model.num_hidden_layers=2",
         "--config.train.scan_unroll=1", "--config.eval.batches=0", "--config.train.progress=False",
         "--config.mesh.data=1"]


def _traced_steps(workdir) -> list[int]:
    """The train steps the trace's step annotations name (the Perfetto/TensorBoard JSON it writes)."""
    trace, = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "*.trace.json.gz"))
    events = json.load(gzip.open(trace))["traceEvents"]
    return sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")


def test_the_trace_holds_the_windows_steps_and_no_others(tmp_path):
    exp = load_experiment(TINY, [*SMALL, "--config.train.profile_steps=2:4"])
    train(exp, str(tmp_path), devices=jax.devices()[:1], out=io.StringIO())
    assert _traced_steps(tmp_path) == [2, 3]
    assert glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))  # TensorBoard's
    marks = [(e["event"], e["step"]) for e in read_events(str(tmp_path)) if e["event"].startswith("profile")]
    assert marks == [("profile_start", 2), ("profile_stop", 3)]


def test_a_window_past_the_runs_end_stops_with_the_run_and_no_window_writes_nothing(tmp_path):
    exp = load_experiment(TINY, [*SMALL, "--config.train.profile_steps=4:9"])
    train(exp, str(tmp_path / "late"), devices=jax.devices()[:1], out=io.StringIO())
    assert _traced_steps(tmp_path / "late") == [4, 5]
    train(load_experiment(TINY, SMALL), str(tmp_path / "none"), devices=jax.devices()[:1], out=io.StringIO())
    assert not (tmp_path / "none" / "profile").exists()


@pytest.mark.parametrize("text", ["5", "3:3", "0:2", "a:b", "2:1"])
def test_a_malformed_window_is_refused_in_words(text):
    with pytest.raises(ZayaError, match="train.profile_steps must be START:STOP with 1 <= START < STOP"):
        profile_window(text)


def test_the_step_hlo_names_the_blocks_sub_layers_and_the_loss():
    program = build_program(load_experiment(TINY, SMALL), jax.devices()[:1])
    hlo = program.lower_train_step().as_text(debug_info=True)
    for scope in ("block/attention", "block/moe/router", "block/moe/experts", "dispatch", "combine", "loss"):
        assert re.search(rf"\b{scope}\)?/", hlo), scope  # under autodiff: "jvp(loss)/..."
