"""The XLA flags a config's kernel backends need (`registry.XLA_FLAGS`), set before JAX starts.

XLA reads `XLA_FLAGS` once, when JAX starts its backend (the first `jax.devices()`, array or
compile in the process), and the flags then hold for the whole process. So `require` runs before
anything starts JAX: experiment validation calls it ahead of `registry.resolve` (which asks JAX
for the devices), and `zaya_jax.load` calls it first. Before the start it appends the missing
flags to `os.environ["XLA_FLAGS"]`; after it, a missing flag is a one-sentence error that says
to set it in the environment instead.
"""

from __future__ import annotations

import os
from typing import Mapping

from zaya_jax import jax_compat
from zaya_jax.errors import ZayaError
from zaya_jax.kernels.registry import KERNEL_FIELDS, XLA_FLAGS


def backends_started() -> bool:
    """Whether JAX has started its backends (after which XLA_FLAGS and jax_platforms are fixed)."""
    return jax_compat.backends_started()


def needed(kernels) -> list[tuple[str, str]]:
    """(config field = backend, flag) for each XLA flag a configured backend needs.

    `kernels` is a ModelConfig or a mapping of its kernel fields ('moe_kernel': 'cudnn', ...).
    `auto` needs none: no target's default needs a flag.
    """
    if not isinstance(kernels, Mapping):
        kernels = {field: getattr(kernels, field) for field in KERNEL_FIELDS}
    out = []
    for field, backend in kernels.items():
        for flag in XLA_FLAGS.get((KERNEL_FIELDS[field], backend), "").split():
            out.append((f"model.{field}={backend}", flag))
    return out


def require(kernels, environ=None) -> list[str]:
    """Make sure the flags `kernels` need are in XLA_FLAGS; return them.

    Before JAX starts, appends each missing flag to `environ` (default `os.environ`). After it,
    raises ZayaError for a missing flag: XLA would not read it any more. A flag that XLA_FLAGS
    already sets to another value is an error either way.
    """
    environ = os.environ if environ is None else environ
    flags = []
    for choice, flag in needed(kernels):
        current = environ.get("XLA_FLAGS", "")
        name, value = flag.split("=", 1)
        given = [t.split("=", 1)[1] if "=" in t else "true" for t in current.split() if t.split("=", 1)[0] == name]
        if given and given[-1].lower() not in (value, "1"):
            raise ZayaError(f"{choice} needs {flag}, but XLA_FLAGS sets {name}={given[-1]}; remove that from XLA_FLAGS")
        if not given:
            if backends_started():
                raise ZayaError(f"{choice} needs XLA_FLAGS={flag}, which XLA reads only when JAX starts, and JAX "
                                f"has already started in this process; set XLA_FLAGS={flag} in the environment "
                                "before starting Python")
            environ["XLA_FLAGS"] = f"{current} {flag}".strip()
        flags.append(flag)
    return flags
