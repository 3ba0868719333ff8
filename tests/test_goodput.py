"""The goodput ledger on hand-written event logs, the event log itself, and `zaya report`."""

import json

import pytest

from zaya_jax import cli
from zaya_jax.train.events import Attempt, EventLog, read_events
from zaya_jax.train.goodput import LOST, summarize


def _span(kind, end, sec, **fields):
    return {"event": kind, "time": end, "sec": sec, "process": 0, **fields}


def _point(kind, at, **fields):
    return {"event": kind, "time": at, "process": 0, **fields}


def _bucket_total(summary):
    return summary["productive_sec"] + sum(summary["lost_sec"].values())


def test_every_second_of_one_attempt_lands_in_one_bucket():
    events = [_point("start", 100.0, attempt=0), _span("startup", 103.0, 3.0), _span("init", 105.0, 2.0),
              _span("compile", 115.0, 10.0), _span("steps", 125.0, 10.0, first=0, last=10, bad=0),
              _span("checkpoint", 126.0, 1.0, step=10),
              _point("bad_step", 130.0, step=15),  # written inside the next span, before it closes: no time
              _span("steps", 137.0, 10.0, first=10, last=20, bad=2),  # 1 s untracked before it
              _span("model_save", 139.0, 2.0), _point("end", 139.0, step=20)]
    s = summarize(events)
    assert s["wall_sec"] == pytest.approx(39.0)
    assert _bucket_total(s) == pytest.approx(39.0)
    assert s["productive_sec"] == pytest.approx(18.0)  # 10 good steps + 8 of the second span's 10
    assert s["lost_sec"]["bad_steps"] == pytest.approx(2.0)
    assert s["lost_sec"]["untracked"] == pytest.approx(1.0)
    assert s["lost_sec"]["compile"] == pytest.approx(10.0)
    assert s["goodput"] == pytest.approx(18.0 / 39.0)
    assert s["finished"] and s["attempts"] == 1 and s["restarts"] == 0 and s["bad_steps"] == 1


def test_a_supervised_restart_discards_the_steps_after_the_checkpoint_and_costs_its_gap():
    events = [_point("start", 0.0, attempt=0), _span("steps", 10.0, 10.0, first=0, last=10, bad=0),
              _span("checkpoint", 11.0, 1.0, step=10), _span("steps", 21.0, 10.0, first=10, last=20, bad=0),
              # killed at about 21 s; the supervisor restarts the job at 30 s
              _point("start", 30.0, attempt=1, cause="process 1 was killed by SIGKILL (137)"),
              _span("restore", 31.0, 1.0, step=10), _span("steps", 41.0, 10.0, first=10, last=20, bad=0),
              _point("end", 41.0, step=20)]
    s = summarize(events)
    assert s["wall_sec"] == pytest.approx(41.0)
    assert _bucket_total(s) == pytest.approx(41.0)
    assert s["lost_sec"]["restart"] == pytest.approx(9.0)
    assert s["lost_sec"]["discarded"] == pytest.approx(10.0)  # steps 10..20 of the first attempt
    assert s["productive_sec"] == pytest.approx(20.0)
    assert s["restarts"] == 1 and s["attempts"] == 2


def test_a_rollback_discards_the_good_steps_after_its_checkpoint_and_keeps_the_bad_ones_as_bad():
    events = [_point("start", 0.0, attempt=0), _span("steps", 10.0, 10.0, first=0, last=10, bad=0),
              _span("checkpoint", 11.0, 1.0, step=10),
              _span("steps", 21.0, 10.0, first=10, last=20, bad=3),  # 7 good, then a streak of 3 bad
              _span("rollback", 22.0, 1.0, step=10, at_step=20), _point("end", 22.0, step=20)]
    s = summarize(events)
    assert s["lost_sec"]["bad_steps"] == pytest.approx(3.0)
    assert s["lost_sec"]["discarded"] == pytest.approx(7.0)
    assert s["lost_sec"]["restore"] == pytest.approx(1.0)
    assert s["productive_sec"] == pytest.approx(10.0) and s["rollbacks"] == 1
    assert _bucket_total(s) == pytest.approx(s["wall_sec"])


def test_a_hang_reported_by_two_processes_is_one_hang_and_no_second_is_counted_twice():
    events = [_point("start", 0.0, attempt=0), _span("steps", 10.0, 10.0, first=0, last=10, bad=0),
              {**_span("hang", 30.0, 20.0, what="a train step"), "process": 1},
              _span("hang", 30.5, 20.4, what="a train step"),
              _point("start", 40.0, attempt=1, cause="process 1 hung"), _span("restore", 41.0, 1.0, step=10),
              _point("end", 41.0, step=10)]
    s = summarize(events)
    assert s["hangs"] == 1
    assert s["lost_sec"]["hang"] == pytest.approx(20.5)
    assert _bucket_total(s) == pytest.approx(s["wall_sec"]) == pytest.approx(41.0)


def test_a_start_by_hand_after_a_clean_stop_is_idle_time_not_wall_time():
    events = [_point("start", 0.0, attempt=0), _span("steps", 10.0, 10.0, first=0, last=10, bad=0),
              _point("stop", 10.0, step=10, reason="SIGTERM"),
              _point("start", 1000.0, attempt=0), _span("restore", 1001.0, 1.0, step=10),
              _span("steps", 1011.0, 10.0, first=10, last=20, bad=0), _point("end", 1011.0, step=20)]
    s = summarize(events)
    assert s["idle_sec"] == pytest.approx(990.0)
    assert s["wall_sec"] == pytest.approx(21.0) and s["restarts"] == 0
    assert s["productive_sec"] == pytest.approx(20.0)


def test_the_event_log_appends_whole_lines_and_reads_back_in_time_order(tmp_path):
    log = EventLog(str(tmp_path), process=1)
    seen = []
    log.listeners.append(seen.append)
    with log.span("compile") as extra:
        extra["cache_hit"] = True
    log.write("start", at=1.0, attempt=0)
    with open(log.path, "a") as f:
        f.write('{"event": "steps", "ti')  # a process killed mid-line
    events = read_events(str(tmp_path))
    assert [e["event"] for e in events] == ["start", "compile"]
    assert events[1]["cache_hit"] is True and events[1]["process"] == 1 and events[1]["sec"] >= 0
    assert [e["event"] for e in seen] == ["compile", "start"]
    EventLog(str(tmp_path / "x"), enabled=False).write("start")  # another process's log: nothing on disk
    assert not (tmp_path / "x").exists()


def test_the_attempt_comes_from_the_supervisors_environment():
    env = {"ZAYA_ATTEMPT": "2", "ZAYA_RESTART_CAUSE": "process 1 hung", "ZAYA_FAILED_AT": "50.5",
           "ZAYA_LAUNCHED_AT": "40.0"}
    a = Attempt.from_environ(env, started_at=45.0)
    assert (a.number, a.cause, a.failed_at, a.started_at) == (2, "process 1 hung", 50.5, 40.0)
    assert Attempt.from_environ({}, started_at=45.0) == Attempt(0, "", None, 45.0)
    for name, text in (("ZAYA_ATTEMPT", "x"), ("ZAYA_ATTEMPT", "-1"), ("ZAYA_FAILED_AT", "nan"),
                       ("ZAYA_LAUNCHED_AT", "inf")):
        with pytest.raises(Exception, match=f"{name}='{text}' is not a finite number >= 0"):
            Attempt.from_environ({name: text}, started_at=1.0)


def test_zaya_report_prints_the_table_and_the_incidents(tmp_path, capsys):
    events = [_point("start", 0.0, attempt=0), _span("steps", 10.0, 10.0, first=0, last=10, bad=0),
              _point("bad_step", 10.0, step=4, loss=None, grad_norm=None, consecutive=1),
              _point("start", 20.0, attempt=1, cause="process 1 was killed by SIGKILL (137)"),
              _span("steps", 30.0, 10.0, first=10, last=20, bad=0), _point("end", 30.0, step=20)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "finished" in out and "goodput 66.7%: 20.0s productive of 30.0s wall" in out
    assert "restart 1: process 1 was killed by SIGKILL (137)" in out and "bad step 4" in out
    assert cli.main(["report", str(tmp_path), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["lost_sec"]) == set(LOST)


def test_zaya_report_on_a_directory_without_events_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "events.jsonl does not exist" in err


def test_a_startup_span_that_rounds_to_before_its_attempts_start_is_still_in_that_attempt(tmp_path):
    # time and sec are rounded to 1e-4 s: this startup began at the start stamp, but reads 1e-4 s earlier.
    events = [_span("startup", 103.0, 3.0001), _point("start", 100.0, attempt=0), _span("init", 105.0, 2.0),
              _span("steps", 115.0, 10.0, first=0, last=10, bad=0), _point("end", 115.0, step=10)]
    with open(tmp_path / "events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    s = summarize(read_events(str(tmp_path)))
    assert s["attempts"] == 1 and s["lost_sec"]["startup"] == pytest.approx(3.0)
    assert s["lost_sec"]["untracked"] == pytest.approx(0.0, abs=1e-3)


def test_what_a_failed_attempt_ran_after_its_last_span_is_discarded_not_restart_time():
    """Killed at 29 s (the supervisor saw it then) with steps 20..29 unlogged: those 8 s of steps are
    thrown away by the restart from step 20's checkpoint; only 29 → 35 s is the restart's."""
    events = [_point("start", 0.0, attempt=0), _span("steps", 20.0, 20.0, first=0, last=20, bad=0),
              _span("checkpoint", 21.0, 1.0, step=20),
              _point("start", 35.0, attempt=1, cause="process 1 was killed by SIGKILL (137)", failed_at=29.0),
              _span("restore", 36.0, 1.0, step=20), _span("steps", 46.0, 10.0, first=20, last=30, bad=0),
              _point("end", 46.0, step=30)]
    s = summarize(events)
    assert _bucket_total(s) == pytest.approx(46.0)
    assert s["lost_sec"]["discarded"] == pytest.approx(8.0)
    assert s["lost_sec"]["restart"] == pytest.approx(6.0)
    assert s["productive_sec"] == pytest.approx(30.0)


def test_waiting_for_the_other_processes_compile_is_its_own_bucket():
    events = [_point("start", 0.0, attempt=0), _span("compile", 3.2, 3.2, cache_hit=True),
              _span("compile_wait", 20.0, 16.8), _span("steps", 30.0, 10.0, first=0, last=10, bad=0),
              _point("end", 30.0, step=10)]
    s = summarize(events)
    assert (s["lost_sec"]["compile"], s["lost_sec"]["compile_wait"]) == pytest.approx((3.2, 16.8))


@pytest.mark.parametrize("damage, where", [
    (b"\xff\xfe\x00binary garbage\n", 2), (b"[1, 2, 3]\n", 2), (b'{"event": "steps", "sec": 1.0}\n', 2),
    (b"plain text from another program\n", 2), (b'{"event": "steps", "time": NaN, "sec": 1}\n', 2),
    (b'{"event": "steps", "time": 5.0, "sec": 1.0}\n', 2), (b'{"event": "start", "time": 1.0, "attempt": "x"}\n', 2),
], ids=["binary", "not an object", "no time", "plain text", "nan time", "steps without their range",
        "attempt not a number"])
def test_zaya_report_skips_and_counts_damaged_lines(tmp_path, capsys, damage, where):
    log = EventLog(str(tmp_path))
    log.write("start", at=0.0, attempt=0)
    with open(log.path, "ab") as f:
        f.write(damage)
    log.write("steps", at=10.0, sec=10.0, first=0, last=10, bad=0)
    log.write("end", at=10.0, step=10)
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"skipped 1 unreadable line(s) of events.jsonl (line {where})" in out
    assert cli.main(["report", "--json", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["unreadable_lines"] == [where] and summary["productive_sec"] == pytest.approx(10.0)


@pytest.mark.parametrize("content, needle", [
    (b"\xff\xfe\x00binary garbage\n", "has no readable event (1 damaged line(s))"),
    (b'{"event": "start"}\n[1]\n', "has no readable event (2 damaged line(s))"),
    (b"", "has no readable event; it is not the event log of a run"),
], ids=["binary", "no time, not an object", "empty"])
def test_zaya_report_on_a_log_with_nothing_readable_is_one_line_and_exit_2(tmp_path, capsys, content, needle):
    (tmp_path / "events.jsonl").write_bytes(content)
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zaya: error: ") and needle in err[0]


def test_zaya_report_on_an_event_log_that_is_a_directory_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "events.jsonl").mkdir()
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "events.jsonl is not a file" in capsys.readouterr().err
