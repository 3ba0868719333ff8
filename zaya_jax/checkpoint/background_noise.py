"""Orbax's background noise after a failure the run already reports in words.

A failed checkpoint write (a full disk, a damaged file read back) makes Orbax's background threads
log their own traceback, and tensorstore's callbacks then find asyncio's loop closed and print one
traceback each — before and after the one line the CLI prints; a damaged checkpoint read back also
leaves the reads that failed beside the one Orbax reported as futures whose error no one asked for,
which asyncio logs when it collects them (or not, as the collector runs). `quiet_background_failures()`
drops exactly those: absl records of a storage failure, `RuntimeError('Event loop is closed')`
reaching the hooks that print errors no thread handles, and asyncio's records of a tensorstore
error never retrieved.
"""

from __future__ import annotations

import logging
import sys

from zaya_jax.storage import storage_failure


class _QuietStorageFailures(logging.Filter):
    """Orbax's background threads report a failed write as a logged traceback, and tensorstore's
    callbacks then find asyncio's loop closed and print one traceback each: the run says the
    failure once, in words (`RunCheckpoints._storage_errors`), so these are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and storage_failure(record.exc_info[1])) and \
            not ("raised an exception" in record.getMessage() and storage_failure(Exception(record.getMessage())))


class _QuietTensorstoreFutures(logging.Filter):
    """asyncio's "Future exception was never retrieved" for a tensorstore read or write: the read
    that failed first is the one reported, in words; the others failed with it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not ("exception was never retrieved" in record.getMessage() and _is_tensorstore_error(error))


def _is_tensorstore_error(error: BaseException | None) -> bool:
    return isinstance(error, ValueError) and "tensorstore_spec=" in str(error)


def _is_closed_loop(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def quiet_background_failures() -> None:
    """Install the filters above (once): on absl's and asyncio's loggers, and on the hooks that print
    an error no thread handles (tensorstore's callbacks raise into them)."""
    if getattr(sys.excepthook, "zaya_quiet", False):
        return
    logging.getLogger("absl").addFilter(_QuietStorageFailures())
    logging.getLogger("asyncio").addFilter(_QuietTensorstoreFutures())
    previous_except, previous_unraisable = sys.excepthook, sys.unraisablehook

    def excepthook(kind, error, trace):
        if not _is_closed_loop(error):
            previous_except(kind, error, trace)

    def unraisablehook(unraisable):
        if not _is_closed_loop(unraisable.exc_value):
            previous_unraisable(unraisable)

    excepthook.zaya_quiet = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
