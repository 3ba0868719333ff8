"""User-facing errors: one exception type whose message is a complete, actionable sentence.

Anything a user can get wrong (a config value, a path, a checkpoint) raises `ZayaError`.
The CLI prints its message on one line and exits with status 2; library callers can catch it.
"""

from zaya_jax import exit_codes


class ZayaError(Exception):
    """A problem with user input. The message names the problem and the fix."""

    exit_code = exit_codes.BAD_INPUT

    def __init__(self, message: str = "", *, every_process: bool = False):
        super().__init__(message)
        # Raised by every process of a job at once (a check on data they all share): they can
        # leave together through JAX's shutdown barrier, so none sees the coordinator vanish.
        self.every_process = every_process
