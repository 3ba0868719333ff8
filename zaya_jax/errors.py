"""User-facing errors: one exception type whose message is a complete, actionable sentence.

Anything a user can get wrong (a config value, a path, a checkpoint) raises `ZayaError`.
The CLI prints its message on one line and exits with status 2; library callers can catch it.
"""

import contextlib
import re

from zaya_jax import exit_codes


class ZayaError(Exception):
    """A problem with user input. The message names the problem and the fix."""

    exit_code = exit_codes.BAD_INPUT

    def __init__(self, message: str = "", *, every_process: bool = False):
        super().__init__(message)
        # Raised by every process of a job at once (a check on data they all share): they can
        # leave together through JAX's shutdown barrier, so none sees the coordinator vanish.
        self.every_process = every_process


class StorageError(ZayaError):
    """A write the run needs failed for want of space or permission: restarting would fail the same way."""

    exit_code = exit_codes.STORAGE


_INTERNAL_REPR = re.compile(r"<(?:bound method|function|built-in method|[\w.]+ object)\b[^<>]*>|<[^<>]*\bat 0x[0-9a-fA-F]+>")


def quoted(error: BaseException, *, first_line: bool = False, limit: int = 200) -> str:
    """Another library's error, for quoting inside a one-line ZayaError: its message on one line
    (only its first line, if asked), cut to `limit` characters; its type's name if it has none.
    Python reprs of internal objects (`<bound method ... at 0x...>`) say nothing to a reader: dropped."""
    text, before = str(error), None
    while text != before:  # reprs nest: the innermost go first
        text, before = _INTERNAL_REPR.sub("", text), text
    text = text.strip()
    if first_line and text:
        text = text.splitlines()[0]
    text = " ".join(text.split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
