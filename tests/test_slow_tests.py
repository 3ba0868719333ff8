"""tools/slow_tests.py: the quick tier keeps one test of every file, then the fastest within the budget."""

import os
import sys

from paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import slow_tests  # noqa: E402

LOG = """\
============================= slowest durations ==============================
30.00s call     tests/test_a.py::test_slow
2.00s setup    tests/test_a.py::test_slow
1.00s call     tests/test_a.py::test_quick[x-1]
4.00s call     tests/test_b.py::test_only
3.00s call     tests/test_c.py::test_one
2.50s call     tests/test_c.py::test_two
0.50s teardown tests/test_c.py::test_two
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_durations_sum_setup_call_and_teardown_per_test(tmp_path):
    log = tmp_path / "durations.log"
    log.write_text(LOG)
    assert slow_tests.durations(str(log)) == {"tests/test_a.py::test_slow": 32.0, "tests/test_a.py::test_quick[x-1]": 1.0,
                                             "tests/test_b.py::test_only": 4.0, "tests/test_c.py::test_one": 3.0,
                                             "tests/test_c.py::test_two": 3.0}


def test_every_file_keeps_its_fastest_test_then_the_fastest_fit_the_budget():
    times = {"a::slow": 32.0, "a::quick": 1.0, "b::only": 4.0, "c::one": 3.0, "c::two": 3.5}
    # One per file first (a::quick, b::only, c::one: 8 s), then c::two fits a 12 s budget, a::slow does not.
    assert slow_tests.quick_tier(times, budget=12.0) == {"a::quick", "b::only", "c::one", "c::two"}
    # A budget smaller than one test a file still keeps one test of every file.
    assert slow_tests.quick_tier(times, budget=0.0) == {"a::quick", "b::only", "c::one"}


def test_a_log_without_durations_is_one_line_and_exit_2(tmp_path, capsys):
    log = tmp_path / "empty.log"
    log.write_text("collected 3 items\n3 passed\n")
    assert slow_tests.main([str(log)]) == 2
    assert capsys.readouterr().err.strip() == f"slow_tests: error: no durations in {log}; run pytest with --durations=0"


def test_several_logs_give_each_test_its_longest_time(tmp_path, monkeypatch):
    old, new = tmp_path / "jax010.log", tmp_path / "jax012.log"
    old.write_text(LOG)
    new.write_text("9.00s call     tests/test_c.py::test_one\n0.10s call     tests/test_b.py::test_only\n")
    out = tmp_path / "slow_tests.txt"
    monkeypatch.setattr(slow_tests, "OUT", str(out))
    assert slow_tests.main([str(new), str(old), "--budget", "12"]) == 0  # longest, not last
    # c::one now takes 9 s (its longest), so c::two (3 s) is c's quick test; a::quick, b::only (4 s)
    # and c::two sum to 8 s, and c::one no longer fits the 12 s budget.
    assert out.read_text().splitlines()[1:] == ["tests/test_a.py::test_slow", "tests/test_c.py::test_one"]


def test_a_test_no_log_timed_keeps_its_tier(tmp_path, monkeypatch):
    out = tmp_path / "slow_tests.txt"
    out.write_text("# listed\ntests/test_a.py::test_slow\ntests/test_d.py::test_untimed\n")
    quick_log = tmp_path / "quick.log"  # a quick tier's log: test_a.py::test_slow did not run
    quick_log.write_text("\n".join(line for line in LOG.splitlines() if "test_slow" not in line))
    monkeypatch.setattr(slow_tests, "OUT", str(out))
    assert slow_tests.main([str(quick_log), "--budget", "8"]) == 0
    # a::quick, b::only and c::one (8 s) are each file's fastest; c::two no longer fits; the two
    # listed tests no log timed stay slow.
    assert out.read_text().splitlines()[1:] == ["tests/test_a.py::test_slow", "tests/test_c.py::test_two",
                                                "tests/test_d.py::test_untimed"]
