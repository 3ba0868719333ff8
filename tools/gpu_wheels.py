"""Fill `.whl/` with the cp312 x86-64 wheels an offline GPU box needs to run zaya-jax, and only those.

Owns three things: the packages the project imports beyond a JAX GPU image (`ROOTS`), what such an
image is taken to have already (`ON_BOX`: jax/jaxlib with the CUDA or ROCm plugin, numpy, pytest,
triton, torch, and their own dependencies), and the dependency closure of the roots, read from
the Requires-Dist metadata of the packages installed in this environment (markers evaluated for
CPython 3.12 on x86-64 Linux, extras followed). Versions are pinned to this environment's, so the
box runs what the tests here ran, except where the box's JAX needs another (`FOR_BOX_JAX`: a box
on jax 0.11 gets flax 0.12.11) or `--pin` names one. Left out on purpose (`NOT_NEEDED`): pyarrow (imported only
lazily, for Parquet sources: `zaya_jax/data/sources.py`) and huggingface-hub (tokenizers needs it
only for `Tokenizer.from_pretrained`; zaya reads tokenizer.json from a path).

    python tools/gpu_wheels.py [--dest .whl] [--dry-run] [--box-freeze FILE] [--box-jax VERSION]
        [--jax-plugin rocm|cuda12] [--pin NAME==VERSION ...]

`--jax-plugin` also carries JAX's GPU plugin (`jax-rocm7-plugin` and `jax-rocm7-pjrt` for AMD,
the cuda12 pair for NVIDIA) at the box's jax version, for an image with JAX but not its plugin
(a ROCm PyTorch image, say); a box whose freeze lists them at that version keeps its own.

`--box-freeze` takes `python3 -m pip list --format=freeze` from the box: a dependency the box
already has at a version that meets the requirement is then not carried (the roots always are).
On the box, with the folder carried into the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("flax", "optax", "orbax-checkpoint", "grain", "ml-collections", "chex", "tensorboardx", "tokenizers",
         "array-record", "absl-py", "tqdm")
# A JAX GPU image: jax + plugin, numpy, pytest, triton, torch, and what those require.
ON_BOX = frozenset({
    "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
    "jax-rocm7-plugin", "jax-rocm7-pjrt", "ml-dtypes", "opt-einsum", "scipy", "numpy",
    "pytest", "iniconfig", "packaging", "pluggy", "pygments",
    "triton", "torch", "filelock", "typing-extensions", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
    "fsspec", "setuptools",
})
NOT_NEEDED = {
    "pyarrow": "imported only lazily, for Parquet sources (zaya_jax/data/sources.py); large",
    "huggingface-hub": "tokenizers uses it only for from_pretrained downloads; zaya reads tokenizer.json from a path",
}
# Versions that differ from this environment's for a box on another JAX (by its major.minor), as
# measured: flax 0.12.8 (jax 0.10's) imports jax.experimental.hijax.HiPrimitive, which jax 0.11.2
# lacks, so it fails at `from flax import nnx` on such a box; flax 0.12.11 runs there (an H200
# with jax 0.11.2, 2026-11-26). `--pin` overrides any of these.
FOR_BOX_JAX = {"0.11": {"flax": "0.12.11"}}
# JAX's GPU plugin, a pair of wheels versioned as jax itself: `--jax-plugin` carries them.
PLUGINS = {"rocm": ("jax-rocm7-plugin", "jax-rocm7-pjrt"), "cuda12": ("jax-cuda12-plugin", "jax-cuda12-pjrt")}
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
           "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site")


class UsageError(Exception):
    """A bad argument or input file: one line, exit status 2."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed(requires: Iterable[str], extras: Iterable[str] = ()) -> list[Requirement]:
    """The requirements that apply on the target (cp312 Linux x86-64) for the requested extras."""
    out = []
    for line in requires or ():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in ("", *extras)):
            out.append(req)
    return out


def closure(roots: Iterable[str], requires_of: Callable[[str], list[str]],
            skip: Callable[[Requirement], str | None]) -> tuple[dict[str, set[str]], dict[str, str]]:
    """Walk the requirements from `roots`: ({name: extras asked for}, {skipped name: why}).

    `requires_of(name)` gives the package's Requires-Dist lines; `skip(req)` a reason not to carry
    a dependency (None to carry it). Roots are always carried.
    """
    carried: dict[str, set[str]] = {}
    skipped: dict[str, str] = {}
    todo = [(canonical(r), set()) for r in roots]
    while todo:
        name, extras = todo.pop(0)
        if name in carried and extras <= carried[name]:
            continue
        carried[name] = carried.get(name, set()) | extras
        for req in needed(requires_of(name), carried[name]):
            dep = canonical(req.name)
            why = None if dep in carried else skip(req)
            if why:
                skipped.setdefault(dep, why)
            else:
                todo.append((dep, set(req.extras)))
    return carried, skipped


def box_skip(box: dict[str, str | None]) -> Callable[[Requirement], str | None]:
    """skip() for closure(): leave out what the box has (at a version meeting the spec) or never needs."""
    def skip(req: Requirement) -> str | None:
        name = canonical(req.name)
        if name in NOT_NEEDED:
            return NOT_NEEDED[name]
        if name not in box:
            return None
        version = box[name]
        if version is None:
            return "on the box"
        try:
            ok = req.specifier.contains(Version(version), prereleases=True)
        except InvalidVersion:
            ok = True
        return f"on the box ({version})" if ok else None
    return skip


def read_freeze(path: str) -> dict[str, str]:
    """`name==version` lines of a pip freeze → {canonical name: version}."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"cannot read --box-freeze {path}: {e.strerror or e}") from None
    box = {}
    for line in lines:
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==", 1)
            box[canonical(name.strip())] = version.strip()
    if not box:
        raise UsageError(f"--box-freeze {path} has no name==version lines (use pip list --format=freeze)")
    return box


def installed(name: str) -> tuple[str | None, list[str]]:
    """(version, Requires-Dist lines) of a package in this environment; (None, []) when absent."""
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None, []
    return dist.version, list(dist.requires or [])


def make_plan(box_freeze: str | None = None, box_jax: str | None = None, pins: Iterable[str] = (),
              plugin: str | None = None) -> tuple[list[tuple[str, str | None]], dict[str, str]]:
    """([(name, pinned version or None)], {skipped: why}) for this environment.

    Versions are this environment's, except where the box's JAX (`box_jax`, else the jax of
    `box_freeze`) needs others (`FOR_BOX_JAX`) and where `pins` ("name==version") say otherwise.
    `plugin` ('rocm', 'cuda12') adds JAX's plugin wheels at the box's jax version.
    """
    box: dict[str, str | None] = dict.fromkeys(ON_BOX)
    if box_freeze:
        box.update(read_freeze(box_freeze))
    carried, skipped = closure(ROOTS, lambda n: installed(n)[1], box_skip(box))
    versions = {name: installed(name)[0] for name in carried}
    versions.update(jax_pins(box_jax or box.get("jax")))
    if plugin:
        jax_version = box_jax or box.get("jax") or installed("jax")[0]
        for name in PLUGINS[plugin]:
            if box_freeze and box.get(name) == jax_version:
                skipped[name] = f"on the box ({jax_version})"
            else:
                versions[name] = jax_version
    for name, version in map(parse_pin, pins):
        if name not in versions:
            raise UsageError(f"--pin {name}=={version}: {name} is not among the carried wheels "
                             f"({', '.join(sorted(versions))})")
        versions[name] = version
    return sorted(versions.items()), skipped


def jax_pins(box_jax: str | None) -> dict[str, str]:
    """The versions a box running jax `box_jax` needs instead of this environment's."""
    if not box_jax:
        return {}
    return FOR_BOX_JAX.get(".".join(box_jax.split(".")[:2]), {})


def parse_pin(text: str) -> tuple[str, str]:
    name, sep, version = text.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise UsageError(f"--pin takes NAME==VERSION, got {text!r}")
    return canonical(name.strip()), version.strip()


def spec(name: str, version: str | None) -> str:
    if version is None:
        return name
    return f"{name}=={version.split('+')[0]}"  # a local tag (+cpu) names no PyPI file


def download(plan: list[tuple[str, str | None]], dest: str) -> None:
    """pip download exactly the planned wheels (no dependency resolution) into dest."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--disable-pip-version-check", "-q", "-d", dest]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    result = subprocess.run(cmd + [spec(n, v) for n, v in plan], capture_output=True, text=True)
    if result.returncode != 0:
        tail = [line for line in result.stderr.splitlines() if line.strip()][-3:]
        raise RuntimeError("pip download failed: " + " / ".join(tail))


def wheel_name(filename: str) -> str:
    return canonical(filename.split("-")[0])


def prune(dest: str, plan: list[tuple[str, str | None]]) -> list[str]:
    """Remove wheels in dest that are not in the plan (two versions of one package stop the install)."""
    keep = {n: v for n, v in plan}
    removed = []
    for f in sorted(os.listdir(dest)):
        if not f.endswith(".whl"):
            continue
        name, version = wheel_name(f), f.split("-")[1]
        pinned = keep.get(name, "")
        if name not in keep or (pinned and version != pinned.split("+")[0]):
            os.remove(os.path.join(dest, f))
            removed.append(f)
    return removed


def unmet(dest: str, skipped: dict[str, str]) -> list[str]:
    """Requirements of the downloaded wheels that neither the folder nor the box provides."""
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    have = {wheel_name(f) for f in wheels} | set(skipped) | ON_BOX
    missing = []
    for f in sorted(wheels):
        with zipfile.ZipFile(os.path.join(dest, f)) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                     if line.startswith("Requires-Dist:")]
        missing += [f"{f}: {r}" for r in needed(lines) if canonical(r.name) not in have]
    return missing


def folder_mib(dest: str) -> float:
    return sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest) if f.endswith(".whl")) / 2 ** 20


def print_plan(plan, skipped, out=None) -> None:
    out = out or sys.stdout
    print(f"carry {len(plan)} wheels: " + ", ".join(spec(n, v) for n, v in plan), file=out)
    for name, why in sorted(skipped.items()):
        print(f"  not carried: {name} ({why})", file=out)
    unpinned = [n for n, v in plan if v is None]
    if unpinned:
        print(f"  not installed here, so not pinned: {', '.join(unpinned)}", file=out)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv):
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=os.path.join(ROOT, ".whl"), help="wheel folder (default: .whl/)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; download nothing")
    parser.add_argument("--box-freeze", help="pip list --format=freeze of the box: skip what it already has")
    parser.add_argument("--box-jax", help="the box's jax version, where no --box-freeze gives it (0.11.2 ...): "
                        "picks the versions that run on it")
    parser.add_argument("--jax-plugin", choices=sorted(PLUGINS),
                        help="also carry JAX's GPU plugin wheels at the box's jax version")
    parser.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION",
                        help="carry this version instead of this environment's (repeatable)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        plan, skipped = make_plan(args.box_freeze, args.box_jax, args.pin, args.jax_plugin)
        if not args.dry_run:
            try:
                os.makedirs(args.dest, exist_ok=True)
            except OSError as e:
                raise UsageError(f"cannot create --dest {args.dest}: {e.strerror or e}") from None
    except UsageError as e:
        print(f"gpu_wheels: error: {e}", file=sys.stderr)
        return 2
    print_plan(plan, skipped)
    if args.dry_run:
        return 0
    try:
        download(plan, args.dest)
    except RuntimeError as e:
        print(f"gpu_wheels: error: {e}", file=sys.stderr)
        return 1
    for f in prune(args.dest, plan):
        print(f"  removed stale {f}")
    for line in unmet(args.dest, skipped):
        print(f"  warning: unmet requirement {line}")
    wheels = sorted(f for f in os.listdir(args.dest) if f.endswith(".whl"))
    print("\n".join(f"  {f}" for f in wheels))
    print(f"{len(wheels)} wheels, {folder_mib(args.dest):.1f} MiB in {args.dest}")
    print(f"on the box, from the repository root (carry .whl):\n  {INSTALL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
