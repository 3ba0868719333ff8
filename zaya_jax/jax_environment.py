"""The start-up settings JAX reads from the environment before any zaya code runs: checked in words.

XLA parses `XLA_FLAGS` when JAX starts its first backend and aborts the process (a C++ fatal
error, no Python exception) on a flag it does not know. `check_xla_flags` finds such a flag first,
by starting JAX once in a child process with the same flags; a set of flags that started cleanly
is remembered (per JAX build, in the user's cache folder), so the check costs one child process per
new set, not one per run. `backend_failure` turns JAX's own error for a platform it cannot start
(`JAX_PLATFORMS=gpu` on a machine without one) into the sentence the CLI prints.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

from zaya_jax.errors import ZayaError

_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.+)")
_PROBE = "import jax; jax.devices('cpu')"


def check_xla_flags(environ=os.environ) -> None:
    """Refuse, in one line, an `XLA_FLAGS` that XLA would abort on."""
    flags = environ.get("XLA_FLAGS", "").strip()
    if not flags:
        return
    marker = _marker(flags)
    if marker and os.path.exists(marker):
        return
    env = dict(environ, JAX_PLATFORMS="cpu")
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return  # cannot tell here; JAX itself will say
    unknown = _UNKNOWN.search(probe.stderr)
    if unknown:
        raise ZayaError(f"XLA_FLAGS holds a flag this XLA does not know: {unknown.group(1).strip()}; remove it "
                        "(or check its spelling against your jaxlib's version)")
    if probe.returncode == 0 and marker:
        try:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            open(marker, "w").close()  # noqa: SIM115 — an empty marker file
        except OSError:
            pass


def _marker(flags: str) -> str | None:
    try:
        import jaxlib

        build = getattr(jaxlib, "__version__", "")
    except ImportError:
        return None
    digest = hashlib.sha256(f"{build}\0{flags}".encode()).hexdigest()[:32]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "zaya", "xla_flags_ok", digest)


def backend_failure(error: BaseException) -> str | None:
    """JAX's error for a platform it cannot start, as one sentence; None for any other error."""
    text = " ".join(str(error).split())
    if not isinstance(error, RuntimeError) or "Unable to initialize backend" not in text:
        return None
    platforms = os.environ.get("JAX_PLATFORMS", "")
    where = f"JAX_PLATFORMS={platforms!r}: " if platforms else ""
    return (f"{where}{text.split(' (set JAX_PLATFORMS')[0].rstrip('.')}; unset JAX_PLATFORMS to use what this machine has, or "
            "install the platform's JAX plugin")
