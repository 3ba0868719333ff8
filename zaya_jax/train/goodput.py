"""Goodput: a run's wall time split into productive step time and time lost, per cause.

The `Ledger` reads events (`train/events.py`) in time order and lays them on one timeline, from
the first attempt's start to the last event. Each second goes to exactly one bucket:

* `productive` — step time whose updates survive: steps neither skipped as bad nor discarded;
* lost: `startup` (process start, distributed runtime, program build), `init`, `restore` (and
  rollbacks: reading the checkpoint), `data` (the first batch and the held-out batches),
  `compile` (this process's: a step loaded from the compilation cache takes its load time),
  `compile_wait` (waiting for the job's other processes to finish theirs), `checkpoint` (the loop
  blocked on saves), `eval`, `model_save` (the final model), `bad_steps` (steps whose update was
  skipped), `discarded` (steps undone by a restart from an older checkpoint or by a rollback, and
  what a failed attempt ran after its last logged span until the supervisor saw it fail), `hang`
  (no progress, until the watchdog fired), `restart` (from the failure, or the failed attempt's
  last event when no supervisor saw it, to the next attempt's start: the teardown, the back-off), `untracked` (gaps inside an attempt that no event covers — kept small, and the
  measure of how complete this accounting is).

Time between a run that ended (finished, or saved and stopped) and a new start by a person or a
scheduler (attempt 0) is `idle`: not part of the run's wall time.
"""

from __future__ import annotations

import dataclasses

SPANS = ("startup", "init", "restore", "data", "compile", "compile_wait", "checkpoint", "eval", "model_save")
LOST = (*SPANS, "bad_steps", "discarded", "hang", "restart", "untracked")


@dataclasses.dataclass
class _Steps:
    first: int  # steps (first, last] ran in this span
    last: int
    sec: float
    bad: int  # of which this many were skipped (the last ones: bad steps come in streaks)


class Ledger:
    """Running totals; `add(event)` in time order, `summary()` at any point."""

    def __init__(self):
        self.lost = dict.fromkeys(LOST, 0.0)
        self.productive = 0.0
        self.idle = 0.0
        self.first_time: float | None = None
        self.end: float | None = None  # the timeline covered so far ends here
        self.counts = {"attempts": 0, "restarts": 0, "bad_steps": 0, "rollbacks": 0, "hangs": 0}
        self.finished = False
        self._steps: list[_Steps] = []
        self._ended = True  # the last attempt finished or stopped: a new start is not a restart
        self._hung = False  # this attempt's hang is counted (several processes may report it)

    def add(self, event: dict) -> None:
        kind, t = event["event"], float(event["time"])
        if kind == "start":
            return self._start(event, t)
        if self.end is None:  # events before any start (a log from an older version): skip
            return
        if "sec" not in event:  # a point: counts, but covers no time (a span around it does)
            return self._point(kind)
        began = max(t - float(event["sec"]), self.end)
        self.lost["untracked"] += max(began - self.end, 0.0)
        length = max(t - began, 0.0)
        self.end = max(self.end, t)
        if kind == "steps":
            self._add_steps(_Steps(event["first"], event["last"], length, event.get("bad", 0)))
        elif kind in ("restore", "rollback"):  # spans that also undo the steps after their checkpoint
            self._undo_after(int(event["step"]))
            self.lost["restore"] += length
            self.counts["rollbacks"] += kind == "rollback"
        elif kind in SPANS:
            self.lost[kind] += length
        elif kind == "hang":
            self.lost["hang"] += length
            self.counts["hangs"] += not self._hung
            self._hung = True

    def _point(self, kind: str) -> None:
        if kind == "bad_step":
            self.counts["bad_steps"] += 1
        elif kind in ("end", "stop"):
            self._ended = True
            self.finished = kind == "end"

    def _start(self, event: dict, t: float) -> None:
        self.counts["attempts"] += 1
        self.finished = False
        if self.first_time is None:
            self.first_time = self.end = t
        elif event.get("attempt", 0) > 0 or not self._ended:
            # Supervised restart, or a start after an attempt that never said it ended (a crash a
            # person restarted): the gap is the failure's cost. Up to the failure (the supervisor
            # saw it at `failed_at`) the failed attempt ran on past its last span — steps its
            # restart throws away — and from there it is the restart's own time.
            failed_at = event.get("failed_at")
            failed = min(max(float(failed_at), self.end), t) if _is_time(failed_at) else self.end
            self.lost["discarded"] += failed - self.end
            self.lost["restart"] += max(t - failed, 0.0)
            self.counts["restarts"] += 1
        else:
            self.idle += max(t - self.end, 0.0)
        self.end = max(self.end, t)
        self._ended = False
        self._hung = False

    def _add_steps(self, steps: _Steps) -> None:
        self._steps.append(steps)
        per = steps.sec / max(steps.last - steps.first, 1)
        self.productive += (steps.last - steps.first - steps.bad) * per
        self.lost["bad_steps"] += steps.bad * per

    def _undo_after(self, step: int) -> None:
        """A restore of `step`: the good steps after it, in every span so far, were undone."""
        for s in self._steps:
            if s.last <= step:
                continue
            per = s.sec / (s.last - s.first)
            kept = max(step - s.first, 0)
            good_cut = max((s.last - s.first - kept) - s.bad, 0)
            self.productive -= good_cut * per
            self.lost["discarded"] += good_cut * per
            s.bad = max(s.bad - (s.last - s.first - kept), 0)
            s.last, s.sec = s.first + kept, kept * per
        self._steps = [s for s in self._steps if s.last > s.first]

    @property
    def wall(self) -> float:
        return 0.0 if self.first_time is None else self.end - self.first_time - self.idle

    def summary(self) -> dict:
        wall = self.wall
        return {"wall_sec": wall, "productive_sec": self.productive,
                "goodput": self.productive / wall if wall > 0 else None,
                "lost_sec": dict(self.lost), "idle_sec": self.idle, "finished": self.finished, **self.counts}


def _is_time(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) < 1e12


def summarize(events: list[dict]) -> dict:
    ledger = Ledger()
    for event in events:
        ledger.add(event)
    return ledger.summary()


def table(summary: dict) -> list[str]:
    """The summary as lines of text: wall, productive, then every cause that cost time."""
    wall = summary["wall_sec"] or 1e-9
    lines = [f"goodput {100 * (summary['goodput'] or 0):.1f}%: {summary['productive_sec']:.1f}s productive "
             f"of {summary['wall_sec']:.1f}s wall ({summary['attempts']} attempt(s), {summary['restarts']} restart(s), "
             f"{summary['bad_steps']} bad step(s), {summary['rollbacks']} rollback(s), {summary['hangs']} hang(s))"]
    for cause, sec in sorted(summary["lost_sec"].items(), key=lambda kv: -kv[1]):
        if sec >= 0.05:
            lines.append(f"  {cause:<11} {sec:9.1f}s  {100 * sec / wall:5.1f}%")
    if summary["idle_sec"] >= 0.05:
        lines.append(f"  (idle between runs, not counted: {summary['idle_sec']:.1f}s)")
    return lines


def incidents(events: list[dict], limit: int = 20) -> list[str]:
    """One line per restart, hang, rollback, stop and bad step (the first `limit` of them)."""
    lines = []
    for e in events:
        kind = e["event"]
        if kind == "start" and e.get("attempt", 0) > 0:
            lines.append(f"restart {e['attempt']}: {e.get('cause') or 'cause unknown'}")
        elif kind == "hang":
            lines.append(f"hang: process {e.get('process', '?')} made no progress for {e.get('sec', 0):.0f}s in "
                         f"{e.get('what')}")
        elif kind == "rollback":
            lines.append(f"rollback: after step {e.get('at_step', '?')} to the checkpoint of step {e.get('step', '?')}")
        elif kind == "stop":
            lines.append(f"stop: after step {e.get('step', '?')} ({e.get('reason')})")
        elif kind == "bad_step":
            lines.append(f"bad step {e.get('step', '?')}: loss {e.get('loss')}, grad norm {e.get('grad_norm')} "
                         f"({e.get('consecutive')} in a row)")
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])
