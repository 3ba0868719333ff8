"""The run's persistent XLA compilation cache: where it lives, and whether a compile came from it.

`train.compile_cache` is `workdir` (the default: `WORKDIR/compile_cache`, so a restarted or
resumed run loads its compiled step instead of compiling it again; or the directory JAX's own
`JAX_COMPILATION_CACHE_DIR` names, when that is set, so a cache a cluster shares keeps working),
`off`, or a directory that several runs share. JAX decides at a process's first compile whether
it uses a cache, so `use` resets JAX's cache state and points it at the run's directory before
the run compiles anything. In a job of several processes on CPU, where JAX's keys differ by process,
every process writes its own entries (`jax_compat.cache_entries_from_every_process`): JAX writes
from process 0 only, and the others would compile again at every start and restart.
`Hits` counts the compiles served from the cache (JAX's cache-hit monitoring event).
"""

from __future__ import annotations

import os

import jax

from zaya_jax import jax_compat
from zaya_jax.errors import ZayaError

ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own setting; it takes the place of the workdir's cache


def directory(setting: str, workdir: str) -> str | None:
    """The cache directory `train.compile_cache` names for this run (None: off)."""
    if setting == "off":
        return None
    if setting == "workdir":
        return os.path.abspath(os.environ.get(ENV) or os.path.join(workdir, "compile_cache"))
    return os.path.abspath(setting)


def use(setting: str, workdir: str, every_process: bool = False) -> str | None:
    """Point JAX's persistent compilation cache at the run's directory (created here); return it.
    `every_process`: each process writes its own entries (a multi-process job on CPU)."""
    path = directory(setting, workdir)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ZayaError(f"train.compile_cache: cannot create {path} ({e.strerror}); "
                            "name a writable directory, or use 'workdir' or 'off'") from None
    jax_compat.reset_compilation_cache()  # an earlier compile in this process fixed JAX's choice
    jax.config.update("jax_compilation_cache_dir", path)
    if path is not None and every_process:
        jax_compat.cache_entries_from_every_process()
    return path


class Hits:
    """Context manager counting the compiles inside it that the persistent cache served."""

    def __init__(self):
        self.count = 0

    def _listen(self, event: str, **kwargs) -> None:
        if event == jax_compat.CACHE_HIT_EVENT:
            self.count += 1

    def __enter__(self) -> "Hits":
        jax.monitoring.register_event_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._listen)
