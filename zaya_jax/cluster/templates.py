"""Cluster job files for ZAYA1-base: which template each kind is, the values they take, rendering.

The templates (`templates/`, package data) are `string.Template` files: `${name}` is a value,
`$$` a literal `$` (shell variables, Kubernetes' `$(VAR)`). Values are checked before they are
substituted, because they land unquoted in a shell script and a YAML file: numbers must be
positive, names DNS labels, paths free of spaces, quotes and `$`. A SLURM option rendered
without a value is commented out (`##SBATCH`), so the cluster's default applies.
"""

from __future__ import annotations

import re
import string
from importlib import resources

from zaya_jax.errors import ZayaError

TEMPLATES = {"slurm": "zaya1_base.sbatch", "k8s": "zaya1_base_jobset.yaml"}

# The ZAYA1 layout (128 nodes x 8 MI300X) and placeholders to edit; each template uses a subset.
DEFAULTS = {
    "nodes": 128,
    "gpus_per_node": 8,
    "config": "experiments/zaya1_base_phase1.py",
    "workdir": "/shared/runs/zaya1_base_phase1",  # on a filesystem every node shares
    "job_name": "zaya1-base-p1",
    "port": 8476,  # JAX's coordinator (pod 0); under SLURM JAX derives one from the job id
    "grace_s": 300,  # SIGTERM → checkpoint → exit: longer than one save plus one step
    "max_restarts": 5,  # the scheduler restarts a failed job this often (zaya_jax/exit_codes.py)
    "partition": "",  # SLURM: empty = the cluster's default
    "account": "",
    "time": "24:00:00",
    "cpus_per_task": 8,  # per GPU process: data loading threads; 8 x 8 fits any 8-GPU node
    "image": "registry.example.com/zaya-jax:latest",  # Kubernetes
    "gpu_resource": "amd.com/gpu",  # nvidia.com/gpu on NVIDIA
    "shared_claim": "zaya-shared",  # a ReadWriteMany PersistentVolumeClaim
    "shared_mount": "/shared",
}

_NUMBERS = {"nodes": (1, None), "gpus_per_node": (1, None), "grace_s": (1, None), "cpus_per_task": (1, None),
            "port": (1, 65535), "max_restarts": (0, None)}
_MAY_BE_EMPTY = {"partition", "account"}
_SAFE = re.compile(r"[A-Za-z0-9._/+:@%,=-]+")  # nothing a shell or YAML would reinterpret
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_EMPTY_SBATCH = re.compile(r"^#SBATCH (--[\w-]+)=$", re.MULTILINE)


def _template(kind: str) -> string.Template:
    if kind not in TEMPLATES:
        raise ZayaError(f"unknown template {kind!r}: choose one of {', '.join(TEMPLATES)}")
    text = resources.files("zaya_jax.cluster").joinpath("templates", TEMPLATES[kind]).read_text()
    return string.Template(text)


def names(kind: str) -> list[str]:
    """The values the `kind` template takes."""
    return sorted(set(_template(kind).get_identifiers()))


def render(kind: str, **values) -> str:
    """The `kind` job file with `values` in place of DEFAULTS; ZayaError on an unknown kind or value."""
    template = _template(kind)
    takes = names(kind)
    for name in values:
        if name not in takes:
            raise ZayaError(f"the {kind} template has no value {name!r}; it takes {', '.join(takes)}")
    merged = {name: DEFAULTS[name] for name in takes} | values
    checked = {name: _check(name, value) for name, value in merged.items()}
    if kind == "k8s":
        _check_k8s(checked)
    return _EMPTY_SBATCH.sub(r"##SBATCH \1=", template.substitute(checked))


def _check(name: str, value) -> str:
    if name in _NUMBERS:
        return str(_number(name, value, *_NUMBERS[name]))
    text = str(value)
    if not text and name in _MAY_BE_EMPTY:
        return text
    if name == "job_name" and not _DNS_LABEL.fullmatch(text):
        raise ZayaError(f"job_name must be lowercase letters, digits and '-' (a DNS label), got {text!r}")
    if not _SAFE.fullmatch(text):
        raise ZayaError(f"{name} must be non-empty, without spaces, quotes or '$' (it is written unquoted), "
                        f"got {text!r}")
    return text


def _number(name: str, value, low: int, high: int | None) -> int:
    text = str(value).strip()
    number = int(text) if re.fullmatch(r"-?[0-9]+", text) and not isinstance(value, bool) else None
    if number is None or number < low or (high is not None and number > high):
        bound = f"an integer from {low} to {high}" if high else "a positive integer"
        raise ZayaError(f"{name} must be {bound}, got {value!r}")
    return number


def _check_k8s(values: dict[str, str]) -> None:
    """What would otherwise fail only inside the cluster."""
    mount = values["shared_mount"].rstrip("/")
    if not values["workdir"].startswith(mount + "/"):
        raise ZayaError(f"the k8s workdir must lie on the shared volume mounted at {mount}, got "
                        f"{values['workdir']!r}; every pod writes its checkpoint shards there")
    # Pod hostnames are <jobset>-node-<index>-0 and must be DNS labels (at most 63 characters).
    last = f"{values['job_name']}-node-{int(values['nodes']) - 1}-0"
    if len(last) > 63:
        raise ZayaError(f"job_name is too long: pod hostnames such as {last!r} must have at most 63 characters")
