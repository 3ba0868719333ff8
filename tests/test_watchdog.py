"""The hang watchdog: fires after its limit without progress, never while beats or an allowance
keep it quiet, and says where every thread was."""

import threading
import time

from zaya_jax import exit_codes
from zaya_jax.train.watchdog import Watchdog


def _watch(timeout, body):
    exits, hangs = [], []
    with Watchdog(timeout, lambda idle, what, limit: hangs.append((idle, what, limit)), process=3,
                  exit=exits.append) as dog:
        body(dog)
    return exits, hangs


def test_no_progress_past_the_limit_dumps_every_stack_and_exits_3(capsys):
    def stuck_in_a_step(dog):
        time.sleep(0.8)

    exits, hangs = _watch(0.3, stuck_in_a_step)
    assert exits == [exit_codes.HUNG]
    (idle, what, limit), = hangs
    assert 0.3 < idle < 0.8 and what == "a train step" and limit == 0.3
    err = capsys.readouterr().err
    assert "process 3 made no progress for" in err and "exiting with status 3" in err
    assert "Thread MainThread (most recent call last)" in err and "stuck_in_a_step" in err  # where it hung


def test_beats_keep_it_quiet():
    def stepping(dog):
        for _ in range(8):
            time.sleep(0.1)
            dog.beat()

    assert _watch(0.3, stepping) == ([], [])


def test_an_allowance_replaces_the_step_limit_inside_its_block_only():
    def slow_save_then_stuck(dog):
        with dog.allow(2.0, "saving a checkpoint"):
            time.sleep(0.6)  # past the step limit, inside the save's
        with dog.allow(0, "compiling"):  # 0: no limit
            time.sleep(0.6)
        time.sleep(0.8)  # back to steps: this one is a hang

    exits, hangs = _watch(0.3, slow_save_then_stuck)
    assert exits == [exit_codes.HUNG] and [what for _, what, _ in hangs] == ["a train step"]


def test_a_hang_inside_an_allowance_is_named_by_it():
    def stuck_reading(dog):
        with dog.allow(0.3, "reading the checkpoint"):
            time.sleep(0.8)

    exits, hangs = _watch(5.0, stuck_reading)
    assert exits == [exit_codes.HUNG] and hangs[0][1:] == ("reading the checkpoint", 0.3)


def test_it_stops_with_its_block_and_leaves_no_thread():
    _watch(0.2, lambda dog: None)
    time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name == "zaya-watchdog"]
