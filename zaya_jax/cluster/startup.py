"""Start-up of JAX's distributed runtime: the one call a command makes before it touches a device.

`zaya train` and `zaya bench collectives` call `start(settings)` first. A process is one of
several when it has explicit settings (flags, or the environment variables in `ENV`, which
`zaya launch` and the Kubernetes template set) or runs under a cluster JAX detects by itself
(SLURM with several tasks, Open MPI, a Kubernetes Indexed Job with the `kubernetes` package).
Then the runtime is initialised with the configured timeouts, CPU collectives go through gloo,
and every process learns every other's node (host name, or `ZAYA_NODE`) through the runtime's
key-value store: the `Topology` the mesh is laid on. Alone, nothing is initialised.

Every failure is one sentence (`ZayaError`): an unreachable coordinator after the timeout, an
address already in use, a process id outside the process count.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

from zaya_jax import jax_compat
from zaya_jax.errors import ZayaError, quoted
from zaya_jax.parallel.topology import Topology

# The explicit settings, as JAX names them (JAX itself reads the first and the last).
ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID", "local_device_ids": "JAX_LOCAL_DEVICE_IDS"}
NODE_ENV = "ZAYA_NODE"  # this process's node name when host names do not tell nodes apart
_HOSTS_KEY = "zaya/node/"


@dataclasses.dataclass(frozen=True)
class Settings:
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout_s: int = 300  # connecting to the coordinator, and the start-up barrier
    heartbeat_timeout_s: int = 100  # a process silent this long is declared dead; the others stop

    @property
    def explicit(self) -> bool:
        return any(v is not None for v in (self.coordinator_address, self.num_processes, self.process_id))


def add_flags(parser) -> None:
    """The explicit settings as flags (each falls back to its environment variable)."""
    group = parser.add_argument_group("multi-process start-up (default: JAX's cluster auto-detection)")
    group.add_argument("--coordinator-address", metavar="HOST:PORT", help=f"process 0's address (env {ENV['coordinator_address']})")
    group.add_argument("--num-processes", metavar="N", help=f"processes in the job (env {ENV['num_processes']})")
    group.add_argument("--process-id", metavar="I", help=f"this process, 0..N-1 (env {ENV['process_id']})")
    group.add_argument("--local-device-ids", metavar="IDS", help=f"this process's GPUs, e.g. 0,1 (env {ENV['local_device_ids']})")


def settings_from(args, environ=os.environ, initialization_timeout_s: int = 300,
                  heartbeat_timeout_s: int = 100) -> Settings:
    """Flags first, then the environment; every value parsed here, with one-line errors."""
    def raw(name):
        value = getattr(args, name, None)
        return value if value is not None else environ.get(ENV[name]) or None

    address = raw("coordinator_address")
    if address is not None:
        check_address(address, f"--coordinator-address or {ENV['coordinator_address']}")
    num = _int(raw("num_processes"), "num_processes", low=1)
    pid = _int(raw("process_id"), "process_id", low=0)
    if num is not None and pid is not None and pid >= num:
        raise ZayaError(f"process id {pid} is not below the process count {num}; ids run 0..{num - 1} "
                        f"(--process-id / {ENV['process_id']})")
    for key, value in (("initialization_timeout_s", initialization_timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if int(value) < 1:
            raise ZayaError(f"distributed.{key} must be at least 1 second, got {value}")
    ids = raw("local_device_ids")
    return Settings(address, num, pid, _ids(ids) if ids is not None else None,
                    int(initialization_timeout_s), int(heartbeat_timeout_s))


def check_address(address: str, where: str) -> None:
    """HOST:PORT with a port a socket can have (1..65535); one line naming `where` it came from."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ZayaError(f"coordinator address {address!r} is not HOST:PORT with a port in 1..65535 ({where}); "
                        "e.g. node001:8476")


def _check_can_host(address: str) -> None:
    """Process 0 hosts the coordinator: its host must name this machine and its port be free.
    JAX aborts the process (a C++ check failure) when either is not so: find out first."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    try:
        family, kind, proto, _, bound = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ZayaError(f"process 0 cannot host the coordinator at {address}: the host {host!r} does not resolve "
                        f"({e.strerror or e}); give this machine's name or address "
                        f"(--coordinator-address / {ENV['coordinator_address']})") from None
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(bound)
    except OSError as e:
        raise ZayaError(f"process 0 cannot host the coordinator at {address}: {e.strerror or e} (is {host!r} this "
                        "machine, and the port free?); give process 0's own address and a free port "
                        f"(--coordinator-address / {ENV['coordinator_address']})") from None


def _int(text, name: str, low: int) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        flag = "--" + name.replace("_", "-")
        raise ZayaError(f"{flag} / {ENV[name]} must be an integer >= {low}, got {text!r}")
    return value


def _ids(text) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        ids = ()
    if not ids or min(ids) < 0:
        raise ZayaError(f"--local-device-ids / {ENV['local_device_ids']} must be device numbers like 0 or 0,1,2,3, "
                        f"got {text!r}")
    return ids


def detected_cluster(environ=os.environ) -> str | None:
    """The cluster JAX's auto-detection will find with several processes, if any."""
    if int(environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_STEP_NODELIST" in environ:
        return "SLURM"
    if int(environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if "KUBERNETES_SERVICE_HOST" in environ and "JOB_COMPLETION_INDEX" in environ:
        return "Kubernetes"
    return None


def start(settings: Settings, environ=os.environ) -> Topology:
    """Initialise the runtime if this is one of several processes; the topology either way."""
    import jax

    cluster = detected_cluster(environ)
    if not settings.explicit and cluster is None:
        return Topology()
    if getattr(jax.distributed, "is_initialized", lambda: False)():
        return _exchange_nodes(environ, settings)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk through gloo
    where = settings.coordinator_address or f"the coordinator {cluster} points to"
    if settings.coordinator_address and settings.process_id == 0:
        _check_can_host(settings.coordinator_address)
    elif settings.coordinator_address and settings.process_id is not None:
        # JAX aborts the process (a C++ check failure) when it cannot register: find out first.
        _wait_for_coordinator(settings.coordinator_address, settings.initialization_timeout_s)
    try:
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address, num_processes=settings.num_processes,
            process_id=settings.process_id,
            local_device_ids=list(settings.local_device_ids) if settings.local_device_ids else None,
            initialization_timeout=settings.initialization_timeout_s,
            heartbeat_timeout_seconds=settings.heartbeat_timeout_s)
    except Exception as e:  # noqa: BLE001 — JAX raises RuntimeError, ValueError or its own errors here
        raise ZayaError(_start_failure(e, where, settings)) from None
    return _exchange_nodes(environ, settings)


def _wait_for_coordinator(address: str, timeout_s: int) -> None:
    """Return once process 0's port accepts connections; one sentence after `timeout_s`."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            reason = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ZayaError(f"could not reach the coordinator at {address} within distributed.initialization_timeout_s "
                            f"({timeout_s}s): {reason}; check that process 0 runs and listens there "
                            f"(--coordinator-address / {ENV['coordinator_address']})")
        time.sleep(0.5)


def _start_failure(error: Exception, where: str, settings: Settings) -> str:
    text = " ".join(str(error).split())
    if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower() or "Barrier" in text:
        return (f"could not reach {where} within distributed.initialization_timeout_s "
                f"({settings.initialization_timeout_s}s), or not every process joined; check that process 0 runs, "
                "that the address is reachable, and that every process was given the same process count")
    if "already in use" in text.lower() or "Failed to add port" in text or "bind" in text.lower():
        return f"process 0 cannot listen on {where}: the port is in use; choose another port"
    first = text[:240] + ("..." if len(text) > 240 else "")
    return f"could not start JAX's distributed runtime with {where}: {first}"


def _exchange_nodes(environ, settings: Settings) -> Topology:
    """Every process's node name, through the runtime's key-value store (one round trip each)."""
    import jax

    me, count = jax.process_index(), jax.process_count()
    name = environ.get(NODE_ENV) or socket.gethostname()
    timeout_ms = settings.initialization_timeout_s * 1000
    try:
        jax_compat.key_value_set(f"{_HOSTS_KEY}{me}", f"{settings.num_processes or count} {name}")
        jax_compat.wait_at_barrier("zaya_nodes", timeout_ms)
        entries = dict(jax_compat.key_value_dir_get(_HOSTS_KEY))
    except jax_compat.JaxInternalsMoved:
        raise
    except Exception as e:  # noqa: BLE001
        raise ZayaError(f"the {count} processes did not all report their node within "
                        f"distributed.initialization_timeout_s ({settings.initialization_timeout_s}s): "
                        f"{quoted(e)}") from None
    reports = [entries.get(f"{_HOSTS_KEY}{p}") for p in range(count)]
    if any(r is None for r in reports):
        raise ZayaError(f"only {sum(r is not None for r in reports)} of {count} processes reported their node")
    counts = [int(r.split(" ", 1)[0]) for r in reports]
    odd = next((p for p, n in enumerate(counts) if n != count), None)
    if odd is not None:
        raise ZayaError(f"the processes disagree on the process count: process {odd} was given {counts[odd]}, the "
                        f"coordinator {count}; give every process the same --num-processes / {ENV['num_processes']}",
                        every_process=True)
    return Topology.from_hosts([r.split(" ", 1)[1] for r in reports])
