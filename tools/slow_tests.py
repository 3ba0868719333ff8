"""Choose the quick test tier from measured durations; write the others to tests/slow_tests.txt.

Run the full suite with `--durations=0` (two workers, as CI does), then:

    python -m pytest -q -n 2 tests --durations=0 > /tmp/durations.log
    python tools/slow_tests.py /tmp/durations.log

Several logs (say the full suite on jax 0.10 and the quick tier on jax 0.12, whose compiles are
slower) give each test the longest time it took in any of them. A test's time is its setup,
call and teardown together. The quick tier keeps the fastest test of
every test file (so it still touches every module), then the fastest of the rest while their
summed time stays within `--budget` seconds (two workers share it, so the tier takes about half
of it, plus about 45 s of start-up and uneven shares). `tests/conftest.py` marks every test
listed in the file `slow`, like the tests that carry the mark in their source; `-m "not slow"`
then runs the quick tier. A new test is quick until the list is made again. A test no log timed
keeps its tier: a log of the quick tier alone (say on jax 0.12) re-chooses the quick tier and
leaves the slow one as listed.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "slow_tests.txt")
LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(tests/\S.*?)\s*$")


def durations(log: str) -> dict[str, float]:
    """Seconds per test node id, from pytest's `--durations=0` table."""
    times: dict[str, float] = collections.defaultdict(float)
    with open(log) as f:
        for line in f:
            match = LINE.match(line)
            if match:
                times[match.group(2)] += float(match.group(1))
    return dict(times)


def quick_tier(times: dict[str, float], budget: float) -> set[str]:
    """The fastest test of each file, then the fastest others while the sum stays within budget."""
    by_file: dict[str, list[str]] = collections.defaultdict(list)
    for node in times:
        by_file[node.split("::")[0]].append(node)
    quick = {min(nodes, key=times.get) for nodes in by_file.values()}
    spent = sum(times[n] for n in quick)
    for node in sorted(set(times) - quick, key=times.get):
        if spent + times[node] > budget:
            break
        quick.add(node)
        spent += times[node]
    return quick


def listed_slow() -> set[str]:
    """The tests `OUT` lists now."""
    if not os.path.exists(OUT):
        return set()
    with open(OUT) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", metavar="log", help="the output of a `pytest --durations=0` run")
    parser.add_argument("--budget", type=float, default=340.0,
                        help="seconds of test time the quick tier may sum to (default 340: on jax 0.12, "
                             "which compiles slower, such a tier ran in 3:38 on 2 workers; one of 417 s, 4:14)")
    args = parser.parse_args(argv)
    times: dict[str, float] = {}
    for log in args.logs:
        measured = durations(log)
        if not measured:
            print(f"slow_tests: error: no durations in {log}; run pytest with --durations=0", file=sys.stderr)
            return 2
        for node, seconds in measured.items():
            times[node] = max(seconds, times.get(node, 0.0))
    quick = quick_tier(times, args.budget)
    untimed = listed_slow() - set(times)  # no log ran them: they stay slow
    slow = sorted((set(times) - quick) | untimed)
    with open(OUT, "w") as f:
        f.write("# Tests the quick tier leaves out (marked slow by tests/conftest.py); made by tools/slow_tests.py.\n")
        f.writelines(node + "\n" for node in slow)
    quick_s, slow_s = sum(times[n] for n in quick), sum(times.get(n, 0.0) for n in slow)
    print(f"{'tier':<6} {'tests':>6} {'seconds':>9}")
    print(f"{'quick':<6} {len(quick):>6} {quick_s:>9.0f}")
    print(f"{'slow':<6} {len(slow):>6} {slow_s:>9.0f}  ({len(untimed)} untimed, kept slow)")
    print(f"wrote {os.path.relpath(OUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
