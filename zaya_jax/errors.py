"""User-facing errors: one exception type whose message is a complete, actionable sentence.

Anything a user can get wrong (a config value, a path, a checkpoint) raises `ZayaError`.
The CLI prints its message on one line and exits with status 2; library callers can catch it.
"""

import contextlib

from zaya_jax import exit_codes


class ZayaError(Exception):
    """A problem with user input. The message names the problem and the fix."""

    exit_code = exit_codes.BAD_INPUT

    def __init__(self, message: str = "", *, every_process: bool = False):
        super().__init__(message)
        # Raised by every process of a job at once (a check on data they all share): they can
        # leave together through JAX's shutdown barrier, so none sees the coordinator vanish.
        self.every_process = every_process


@contextlib.contextmanager
def raised_by_every_process():
    """Checks inside look only at what every process of a job shares (the config, the global
    devices), so an error in one is an error in all: mark it so they leave together."""
    try:
        yield
    except ZayaError as e:
        if e.every_process:
            raise
        raise ZayaError(str(e), every_process=True) from None
