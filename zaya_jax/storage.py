"""Writes that fail for the storage's reasons (a full disk, a quota, a permission), said in words.

`storage_failure` tells such an error from any other (by its errno, or the words tensorstore and
Orbax quote); `guard(doing, path)` turns one into a `StorageError` (exit status 5: a supervisor does
not restart into the same full disk) naming what was being written, where, and the space left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

from zaya_jax.errors import StorageError

_STORAGE_WORDS = {"No space left on device": "no space left on device", "Disk quota exceeded": "disk quota exceeded",
                  "Permission denied": "permission denied", "Read-only file system": "read-only file system"}


def storage_failure(error: BaseException) -> str | None:
    """Why a write failed, in words, when it is the storage's doing (space, quota, permission)."""
    text = str(error)
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):
        return error.strerror.lower()
    return next((words for needle, words in _STORAGE_WORDS.items() if needle in text), None)


def free_space(path: str) -> str:
    """The space left on `path`'s filesystem (its nearest existing folder), e.g. '1.2 MiB'."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path or ".").free
    except OSError:
        return "unknown space"
    return f"{free / 2 ** 20:.1f} MiB" if free < 2 ** 30 else f"{free / 2 ** 30:.1f} GiB"


@contextlib.contextmanager
def guard(doing: str, path: str, then=None):
    """Inside, a storage failure becomes one `StorageError` line: what was `doing` (e.g. 'writing the
    final model to DIR'), why, the space left on `path`'s filesystem, and `then()` (what is kept)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 — OSError, and the ValueErrors Orbax and tensorstore wrap them in
        reason = storage_failure(e)
        if reason is None:
            raise
        kept = f"{then()}; " if then else ""
        raise StorageError(f"{doing} failed: {reason} ({free_space(path)} free); {kept}free space "
                           "(or choose another --workdir) and start the run again") from None
