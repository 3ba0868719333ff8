"""The one door to what JAX and Orbax do not publish: every reach past their public APIs is here.

- whether JAX has started its backends (after which XLA_FLAGS are fixed): `backends_started`;
- the distributed runtime's client (barriers and key-value store without devices):
  `in_distributed_run`, `wait_at_barrier`, `key_value_set`, `key_value_dir_get`;
- Orbax's absl flag that makes it synchronise through that runtime: `use_orbax_coordination_barriers`;
- the monitoring event JAX records for a compile served from the persistent cache: `CACHE_HIT_EVENT`,
  the reset of JAX's cache choice: `reset_compilation_cache`, and its cache writer, which writes from
  process 0 only: `cache_entries_from_every_process`;
- Pallas's Triton module builder, wrapped so that every module it builds is verified as Triton will
  verify it on the GPU: `verifying_triton_modules`;
- JAX's registration of a PJRT plugin by its library path, with its GPU client options, for a plugin
  whose own `initialize()` refuses without its GPU (the compile-only ROCm set-up):
  `register_gpu_plugin`.

Each reach resolves when it is first used. Where an upgrade moved what it reaches for, the caller
gets a one-line `ZayaError` naming the JAX version and what moved, never an AttributeError from
deep inside; `tests/test_jax_compat.py` resolves every reach on the installed JAX, so an upgrade
that breaks one fails a test. Nothing here imports JAX at import time (the CLI imports this
module before it decides whether JAX is needed at all).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

from zaya_jax.errors import ZayaError

CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class JaxInternalsMoved(ZayaError):
    """An internal of JAX or Orbax that zaya-jax reaches for is not where it was."""


def _moved(what: str, detail: str) -> JaxInternalsMoved:
    import jax

    return JaxInternalsMoved(f"{what} is not where zaya-jax looks for it in jax {jax.__version__} ({detail}); "
                             "install a jax version pyproject.toml supports")


# Each reach: (module, attribute, what it is, for the error when it moved).
_BACKENDS_STARTED = ("jax._src.xla_bridge", "backends_are_initialized", "the 'backends started' query")
_DISTRIBUTED_STATE = ("jax._src.distributed", "global_state", "the distributed runtime's state")
_CACHE_RESET = ("jax.experimental.compilation_cache.compilation_cache", "reset_cache", "the compilation cache reset")
_CACHE_WRITE = ("jax._src.compiler", "_cache_write", "the persistent compilation cache's writer")
_TRITON_MODULE = ("jax._src.pallas.triton.lowering", "lower_jaxpr_to_triton_module", "Pallas's Triton module builder")
_REGISTER_PLUGIN = ("jax._src.xla_bridge", "register_plugin", "PJRT plugin registration")
_BACKEND_FACTORIES = ("jax._src.xla_bridge", "_backend_factories", "the registered backend factories")
_XLA_CLIENT = ("jax._src.xla_bridge", "xla_client", "XLA's client module")


def _private(module: str, attribute: str, what: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise _moved(what, f"{module}.{attribute}: {e}") from None


def backends_started() -> bool:
    """Whether JAX has started its backends (there is no public query)."""
    return _private(*_BACKENDS_STARTED)()


def _client():
    state = _private(*_DISTRIBUTED_STATE)
    if not hasattr(state, "client"):
        raise _moved("the distributed runtime's client", "global_state has no 'client'")
    return state.client


def in_distributed_run() -> bool:
    """Whether this process joined a `jax.distributed` job (without importing JAX if nothing has)."""
    if _DISTRIBUTED_STATE[0] not in sys.modules:
        return False
    return _client() is not None


def wait_at_barrier(name: str, timeout_ms: int) -> None:
    """Return once every process has waited at `name` (the coordination service, no device collective)."""
    _client().wait_at_barrier(name, timeout_ms)


def key_value_set(key: str, value: str) -> None:
    _client().key_value_set(key, value)


def key_value_dir_get(prefix: str) -> list[tuple[str, str]]:
    return _client().key_value_dir_get(prefix)


def use_orbax_coordination_barriers() -> None:
    """Make Orbax synchronise processes through the coordination service (an absl flag of its own)."""
    import orbax.checkpoint  # noqa: F401  defines the flag
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # zaya parses its own command line; absl's flags keep their defaults
    if "experimental_orbax_use_distributed_barrier" not in flags.FLAGS:
        raise _moved("Orbax's distributed-barrier flag", "no absl flag experimental_orbax_use_distributed_barrier")
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def reset_compilation_cache() -> None:
    """Forget JAX's choice of persistent cache (made at a process's first compile)."""
    _private(*_CACHE_RESET)()


class TritonWouldReject(ZayaError):
    """A Pallas kernel lowered to a Triton module that Triton's verifier rejects."""


@contextlib.contextmanager
def verifying_triton_modules():
    """Verify every Triton module Pallas builds inside the block, as Triton does when it compiles one.

    JAX builds the module in Python and hands it on unverified (jaxlib 0.10 and 0.12 to XLA, which
    parses it on the GPU), so a module Triton rejects otherwise lowers cleanly on a machine without
    one. A rejected module raises `TritonWouldReject` naming the kernel and Triton's first error.
    """
    import importlib

    module = importlib.import_module(_TRITON_MODULE[0])
    build = _private(*_TRITON_MODULE)

    def verified(jaxpr, *args, **kwargs):
        result = build(jaxpr, *args, **kwargs)
        if not hasattr(result, "module"):
            raise _moved("the Triton module of Pallas's lowering result", f"{type(result).__name__} has no 'module'")
        try:
            result.module.operation.verify()
        except Exception as e:  # jaxlib's MLIRError; its text lists each diagnostic
            raise TritonWouldReject(f"Triton would reject Pallas kernel {jaxpr.debug_info.func_name}: "
                                    f"{_first_diagnostic(e)}") from None
        return result

    setattr(module, _TRITON_MODULE[1], verified)
    try:
        yield
    finally:
        setattr(module, _TRITON_MODULE[1], build)


def cache_entries_from_every_process() -> None:
    """Let every process write its compiled programs to the persistent cache, not process 0 alone.

    JAX writes from process 0 only, so that processes compiling the same key do not contend for one
    file. On CPU the keys differ by process (each process's CPU topology fingerprint is its own), so
    without this the other processes never find an entry and compile again at every start and
    restart. Only the writer's check sees process 0; nothing else does."""
    write = _private(*_CACHE_WRITE)
    if getattr(write, "zaya_every_process", False):
        return
    state = _private(*_DISTRIBUTED_STATE)
    if not hasattr(state, "process_id"):
        raise _moved("the distributed runtime's process id", "global_state has no 'process_id'")

    def every_process(*args, **kwargs):
        own, state.process_id = state.process_id, 0
        try:
            return write(*args, **kwargs)
        finally:
            state.process_id = own

    every_process.zaya_every_process = True
    setattr(sys.modules[_CACHE_WRITE[0]], _CACHE_WRITE[1], every_process)


def _first_diagnostic(e: Exception) -> str:
    """'op failed to verify ...' with the kernel source line, from an MLIR verification error's text."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip().startswith("error:")]
    if not lines:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = re.search(r'"([^"]+\.py)":(\d+)', lines[0])
    message = lines[0].split("): ", 1)[-1] if "): " in lines[0] else lines[0][len("error:"):].strip()
    return f"{message} ({os.path.basename(where[1])}:{where[2]})" if where else message


def _gpu_options():
    client = _private(*_XLA_CLIENT)
    if not hasattr(client, "generate_pjrt_gpu_plugin_options"):
        raise _moved("the GPU plugin's client options", "xla_client has no 'generate_pjrt_gpu_plugin_options'")
    return client.generate_pjrt_gpu_plugin_options


def register_gpu_plugin(name: str, library_path: str, platform_name: str) -> None:
    """Register the PJRT GPU plugin at `library_path` as JAX's platform `name` (once per process)."""
    if name in _private(*_BACKEND_FACTORIES):
        return
    options = _gpu_options()()
    options["platform_name"] = platform_name
    _private(*_REGISTER_PLUGIN)(name, priority=500, library_path=library_path, options=options)


def reaches() -> dict:
    """Every reach resolved on the installed JAX (for tests/test_jax_compat.py): name → what it found."""
    import jax

    return {
        "backends_started": _private(*_BACKENDS_STARTED),
        "distributed_state": _private(*_DISTRIBUTED_STATE),
        "reset_compilation_cache": _private(*_CACHE_RESET),
        "cache_write": _private(*_CACHE_WRITE),
        "triton_module_builder": _private(*_TRITON_MODULE),
        "register_plugin": _private(*_REGISTER_PLUGIN),
        "backend_factories": _private(*_BACKEND_FACTORIES),
        "gpu_plugin_options": _gpu_options(),
        "jax": jax.__version__,
    }
