"""Bad steps: the guard's verdicts (non-finite, spikes over its window), its history, the train
step keeping the state of a skipped step bit for bit, and the fault drills that inject them."""


import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.drills import Drills, check_job, parse
from zaya_jax.errors import ZayaError
from zaya_jax.experiment import load_experiment
from zaya_jax.train import step_guard
from zaya_jax.train.program import build_program
from paths import TINY
from synthetic_batches import random_batch

SETTINGS = step_guard.GuardSettings(sigmas=3.0, window=4)


def _guard_after(values, settings=SETTINGS):
    guard = step_guard.init(settings)
    for loss, norm in values:
        bad = step_guard.is_bad(guard, jnp.float32(loss), jnp.float32(norm), settings)
        guard = step_guard.record(guard, jnp.float32(loss), jnp.float32(norm), bad)
    return guard


@pytest.mark.parametrize("loss,norm", [(np.nan, 1.0), (1.0, np.inf), (-np.inf, 1.0)])
def test_a_non_finite_loss_or_grad_norm_is_bad_from_the_first_step(loss, norm):
    guard = step_guard.init(SETTINGS)
    assert bool(step_guard.is_bad(guard, jnp.float32(loss), jnp.float32(norm), SETTINGS))


def test_a_spike_is_bad_only_once_the_window_is_full_and_only_upwards():
    calm = [(2.0, 1.0), (2.1, 1.1), (1.9, 0.9), (2.0, 1.0)]
    guard = _guard_after(calm[:3])
    assert not bool(step_guard.is_bad(guard, jnp.float32(50.0), jnp.float32(1.0), SETTINGS))  # 3 of 4 seen
    guard = _guard_after(calm)
    judge = lambda loss, norm: bool(step_guard.is_bad(guard, jnp.float32(loss), jnp.float32(norm), SETTINGS))
    assert judge(2.5, 1.0) and judge(2.0, 1.5)  # mean + 3 std is about 2.21 (loss) and 1.21 (norm)
    assert not judge(2.2, 1.2) and not judge(0.5, 0.1)  # inside the band, or a drop: not a spike
    off = step_guard.GuardSettings(sigmas=0.0, window=4)
    assert not bool(step_guard.is_bad(guard, jnp.float32(50.0), jnp.float32(50.0), off))


def test_good_steps_fill_the_ring_and_bad_ones_only_count():
    guard = _guard_after([(1.0, 1.0), (np.nan, 1.0), (np.nan, 1.0), (2.0, 2.0)])
    assert int(guard.seen) == 2 and int(guard.bad_total) == 2 and int(guard.consecutive) == 0
    np.testing.assert_array_equal(guard.history[:2], [[1.0, 1.0], [2.0, 2.0]])
    guard = _guard_after([(1.0, 1.0)] * 5 + [(np.nan, 1.0)] * 2)
    assert int(guard.seen) == 5 and int(guard.consecutive) == 2
    np.testing.assert_array_equal(guard.history, np.ones((4, 2)))  # the fifth went to slot 0


def _batch(nan=False):
    batch = random_batch(8, 32)
    if nan:
        batch["loss_mask"][3, 5] = np.nan  # one token of one row
    return batch


def test_the_train_step_keeps_the_whole_state_of_a_bad_step_and_counts_it():
    overrides = ["--config.train.global_batch_size=8", "--config.train.seq_len=32", "--config.model.num_hidden_layers=2",
                 "--config.train.scan_unroll=1",
                 "--config.optim.warmup_steps=0", "--config.mesh.data=1"]
    program = build_program(load_experiment(TINY, overrides), devices=jax.devices()[:1])
    step = program.jitted_train_step()
    before, metrics = step(program.init(), program.place_batch(_batch()))
    assert not bool(metrics["bad_step"]) and int(before.step) == 1
    kept = jax.device_get(before)  # donated below
    after, metrics = step(before, program.place_batch(_batch(nan=True)))
    assert bool(metrics["bad_step"]) and np.isnan(float(metrics["loss"]))
    assert int(metrics["bad_steps"]) == 1 and int(metrics["consecutive_bad_steps"]) == 1
    unchanged = jax.tree.map(np.array_equal, (kept.step, kept.params, kept.biases, kept.opt_state, kept.balance_state),
                             jax.device_get((after.step, after.params, after.biases, after.opt_state, after.balance_state)))
    assert all(jax.tree.leaves(unchanged))
    assert int(after.guard.bad_total) == 1 and int(after.guard.seen) == 1
    again, metrics = step(after, program.place_batch(_batch()))
    assert not bool(metrics["bad_step"]) and int(metrics["consecutive_bad_steps"]) == 0 and int(again.step) == 2
    assert not np.array_equal(jax.device_get(again.params["embedding"]), kept.params["embedding"])


def test_drills_parse_and_act_on_their_process_step_and_attempt_only():
    drills = parse("nan:process=1,step=3,steps=2; hang:step=5,sec=0 ;kill:process=2,step=9,attempt=1")
    assert [(d.kind, d.process, d.step, d.steps, d.attempt) for d in drills] == \
        [("nan", 1, 3, 2, 0), ("hang", 0, 5, 1, 0), ("kill", 2, 9, 1, 1)]
    mine = Drills(drills, process=1, attempt=0)
    batch = {"loss_mask": np.ones((2, 4), np.float32)}
    poisoned = [step for step in range(1, 7) if np.isnan(mine.apply(step, batch)["loss_mask"]).any()]
    assert poisoned == [3, 4] and not np.isnan(batch["loss_mask"]).any()  # the caller's batch untouched
    assert not Drills(drills, process=1, attempt=1).drills and not Drills(drills, process=0, attempt=1).drills
    assert [d.kind for d in Drills(drills, process=2, attempt=1).drills] == ["kill"]


@pytest.mark.parametrize("text,needle", [
    ("explode:step=1", "the kind must be one of hang, nan, kill, crash"),
    ("hang:when=3", "'when' is not a key of a hang drill; its keys are process, step, attempt, sec"),
    ("kill:step=3,sec=5", "'sec' is not a key of a kill drill; its keys are process, step, attempt"),
    ("hang:step=3,steps=2", "'steps' is not a key of a hang drill"),
    ("nan:step=x", "step='x' is not a number"),
    ("nan:step=0", "step and steps >= 1"),
    ("hang:process=-1", "process, attempt and sec must be finite and >= 0"),
    ("hang:sec=inf", "sec must be finite"),
    ("hang:sec=nan", "sec must be finite"),
])
def test_bad_drills_are_one_line_errors(text, needle):
    with pytest.raises(ZayaError, match=re.escape(needle)):
        parse(text)


@pytest.mark.parametrize("text, processes, steps, needle", [
    ("kill:process=2,step=3", 2, 10, "aims at process 2, and this job has 2 (0..1)"),
    ("crash:step=11", 2, 10, "acts at step 11, after the run's last (train.steps = 10)"),
])
def test_a_drill_that_cannot_fire_in_its_job_is_refused(text, processes, steps, needle):
    with pytest.raises(ZayaError, match=re.escape(needle)):
        check_job(parse(text), processes, steps)
    check_job(parse(text), processes + 5, steps + 5)  # the same drill fits a larger job


@pytest.mark.parametrize("override,needle", [
    ("fault.hang_timeout_sec=-1", "fault.hang_timeout_sec and fault.io_timeout_sec must be >= 0"),
    ("fault.spike_sigmas=-2", "fault.spike_sigmas must be >= 0"),
    ("fault.spike_window=0", "fault.spike_window must be >= 1"),
    ("fault.max_rollbacks=-1", "fault.max_consecutive_bad_steps and fault.max_rollbacks must be >= 0"),
    ("fault.on_bad_steps=ignore", "fault.on_bad_steps must be 'rollback' or 'stop', got 'ignore'"),
    ("fault.drill=explode:step=1", "the kind must be one of hang, nan, kill, crash"),
])
def test_bad_fault_settings_are_one_line_and_exit_2(tmp_path, capsys, override, needle):
    from zaya_jax.cli import main

    assert main(["train", f"--config={TINY}", f"--workdir={tmp_path}", f"--config.{override}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zaya: error: ") and needle in err[0]
