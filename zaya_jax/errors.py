"""User-facing errors: one exception type whose message is a complete, actionable sentence.

Anything a user can get wrong (a config value, a path, a checkpoint) raises `ZayaError`.
The CLI prints its message on one line and exits with status 2; library callers can catch it.
"""

from zaya_jax import exit_codes


class ZayaError(Exception):
    """A problem with user input. The message names the problem and the fix."""

    exit_code = exit_codes.BAD_INPUT
