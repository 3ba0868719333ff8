"""The exit-status contract of `zaya` commands: what a supervisor may do after each status.

`zaya launch --max-restarts`, the SLURM template and the Kubernetes template all act on it, so a
status means one thing everywhere:

* 0   finished.
* 1   crashed (an unexpected error, a traceback in the log): restart from the newest checkpoint.
* 2   bad input (config, data file, checkpoint path, flag, start-up setting): never restart,
      it would fail the same way.
* 3   hung: the watchdog saw no step progress for `fault.hang_timeout_sec` and dumped every
      thread's stack: restart.
* 4   stopped after `fault.max_consecutive_bad_steps` bad steps (`fault.on_bad_steps=stop`), or
      after `fault.max_rollbacks` rollbacks: never restart, a person decides.
* 5   storage: a save failed for want of space or permission (a full disk): never restart, it
      would fill the same disk; the previous checkpoint is kept, free space and start again.
* 128+N  ended by signal N. 143 (SIGTERM) and 130 (SIGINT) mean "saved a checkpoint and stopped"
      (preemption, the time limit, Ctrl-C): restart only when asked to. Others (137 = SIGKILL,
      134 = SIGABRT) are failures: restart.
"""

from __future__ import annotations

import signal

OK = 0
CRASHED = 1
BAD_INPUT = 2
HUNG = 3
BAD_STEPS = 4
STORAGE = 5
STOPPED = (128 + signal.SIGTERM, 128 + signal.SIGINT)

NEVER_RESTART = (BAD_INPUT, BAD_STEPS, STORAGE)


def restartable(code: int, restart_stopped: bool = False) -> bool:
    """Whether a supervisor should start the job again after it ended with `code`."""
    if code == OK or code in NEVER_RESTART:
        return False
    if code in STOPPED:
        return restart_stopped
    return True


def describe(code: int) -> str:
    """`code` in words, as the launcher logs it."""
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        name = signal.Signals(code - 128).name
        return f"saved and stopped on {name} ({code})" if code in STOPPED else f"was killed by {name} ({code})"
    words = {OK: "finished", CRASHED: "crashed", BAD_INPUT: "stopped on bad input",
             HUNG: "hung (no step progress; stacks dumped)", BAD_STEPS: "stopped on repeated bad steps",
             STORAGE: "could not write its checkpoint or metrics (storage full or not writable)"}
    return f"{words.get(code, 'exited')} (status {code})"
