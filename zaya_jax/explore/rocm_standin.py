"""XLA's ROCm compiler without an AMD GPU: JAX's ROCm plugin over stand-in runtime libraries.

JAX's ROCm plugin (`jax-rocm7-pjrt` / `jax-rocm7-plugin` of the installed JAX's version) holds
XLA's whole ROCm compiler, but its shared object links against ROCm's runtime (`libamdhip64`,
`librocblas`, `libhipblaslt`, `libMIOpen`, `librccl`, ...), which no package registry here ships,
and its `initialize()` refuses to register without an AMD GPU. `build(plugin, out)` makes, for each
ROCm library the plugin names, a stand-in that exports exactly the symbols the plugin takes from it
(read off its undefined symbols, with their version nodes): the kernel registrations its static
constructors make and the profiler hook it installs return quietly; every other entry point says it
was called on a compile-only runtime and aborts. `register(setup)` loads the stand-ins by their
sonames, so the plugin's own links resolve to them, and registers the plugin for compiling only
(JAX itself stays on the CPU: no ROCm client is ever made). A GPU target config whose
`platform_name` is "ROCM" (`benchmarks/gpu_targets/mi300x.txtpb`) then gives compile-only AMD
devices (`explore/deviceless.py`).

The set-up lives in one directory (`setup_dir()`: the plugin's wheels installed with
`pip --target`, the stand-ins beside them), made by `python tools/rocm_compile_setup.py`. GEMMs
compile to XLA's own Triton GEMMs there (no hipBLASLt to autotune against): such a compile tells
the kernels, the program's structure and its memory, not GEMM speed.
"""

from __future__ import annotations

import collections
import ctypes
import glob
import os
import re
import subprocess

from zaya_jax.errors import ZayaError

SETUP_COMMAND = "python tools/rocm_compile_setup.py"
PLUGIN_LIBRARY = os.path.join("jax_plugins", "xla_rocm7", "xla_rocm_plugin.so")
STANDIN_DIR = "standin"
# A symbol's library by its version node, then by its name; the rest are the C++ runtime's or Python's.
_BY_VERSION = ((r"hip_", "libamdhip64"), (r"MIOPEN", "libMIOpen"))
_BY_NAME = ((r"(hip[A-Z_]|__hip|hsa)", "libamdhip64"), (r"rocblas", "librocblas"),
            (r"(hipblasLt|_ZN\w*hipblaslt|_ZNK\w*hipblaslt)", "libhipblaslt"), (r"miopen", "libMIOpen"),
            (r"(nccl|rccl|pnccl)", "librccl"), (r"(rsmi|amdsmi)", "librocm_smi64"), (r"hipfft", "libhipfft"),
            (r"rocprofiler", "librocprofiler-sdk"), (r"hipblas", "libhipblas"), (r"hipsparse", "libhipsparse"),
            (r"hipsolver", "libhipsolver"), (r"rocsolver", "librocsolver"))
# Called as the plugin loads (its kernels' registration, its profiler hook): these must return 0.
_QUIET = ("__hipRegister", "__hipUnregister", "rocprofiler_")
_SYSTEM = re.compile(r"lib(c|m|rt|dl|pthread|stdc\+\+|gcc_s)\.so|ld-linux")


def setup_dir() -> str:
    """Where the set-up for this JAX lives: `ZAYA_ROCM_COMPILE_DIR`, else the user's cache."""
    import jax

    default = os.path.join(os.path.expanduser("~"), ".cache", "zaya-jax", f"rocm-compile-jax{jax.__version__}")
    return os.environ.get("ZAYA_ROCM_COMPILE_DIR") or default


def library_of(symbol: str, version: str) -> str | None:
    """The ROCm library (soname stem) an undefined symbol of the plugin comes from; None: not ROCm's."""
    for pattern, lib in _BY_VERSION:
        if version and re.match(pattern, version):
            return lib
    for pattern, lib in _BY_NAME:
        if re.match(pattern, symbol):
            return lib
    return None


def undefined_symbols(shared_object: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(the libraries it needs, its strong undefined symbols as (name, version node))."""
    dynamic = _run(["readelf", "-d", shared_object])
    needed = re.findall(r"\(NEEDED\).*\[([^\]]+)\]", dynamic)
    symbols = []
    for line in _run(["nm", "-D", "--undefined-only", shared_object]).splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[-2] != "U":
            continue
        name, _, version = parts[-1].partition("@")
        symbols.append((name, version.lstrip("@")))
    return needed, symbols


def build(shared_objects: list[str], out: str) -> list[str]:
    """Write a stand-in for every ROCm library `shared_objects` need into `out`; returns their paths."""
    needed, wanted = set(), collections.defaultdict(dict)
    for so in shared_objects:
        libs, symbols = undefined_symbols(so)
        needed.update(lib for lib in libs if not _SYSTEM.search(lib))
        for name, version in symbols:
            lib = library_of(name, version)
            if lib is not None and not re.match(r"GLIBC|CXXABI|GLIBCXX|GCC_", version):
                wanted[lib][name] = version
    os.makedirs(out, exist_ok=True)
    made = []
    for soname in sorted(needed):
        stem = soname.split(".so")[0]
        made.append(_compile(soname, wanted.get(stem, {}), out))
    return made


def _compile(soname: str, symbols: dict[str, str], out: str) -> str:
    lines = ["#include <stdio.h>", "#include <stdlib.h>",
             "static void refuse(const char *name) {",
             f'  fprintf(stderr, "zaya: %s called on the stand-in {soname}, which only lets XLA compile for ROCm '
             'without an AMD GPU: run on a ROCm machine\\n", name);', "  abort();", "}"]
    for i, name in enumerate(sorted(symbols)):
        body = "return 0;" if name.startswith(_QUIET) else f'refuse("{name}"); return 1;'
        lines += [f'int standin_{i}(void) __asm__("{name}");', f"int standin_{i}(void) {{ {body} }}"]
    source = os.path.join(out, soname + ".c")
    with open(source, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    nodes = collections.defaultdict(list)
    for name, version in symbols.items():
        if version:
            nodes[version].append(name)
    command = ["gcc", "-shared", "-fPIC", "-o", os.path.join(out, soname), source, f"-Wl,-soname,{soname}"]
    if nodes:
        script = os.path.join(out, soname + ".map")
        with open(script, "w", encoding="utf-8") as f:
            f.writelines(f"{v} {{ global: {' '.join(n + ';' for n in sorted(names))} }};\n"
                         for v, names in sorted(nodes.items()))
        command.append(f"-Wl,--version-script={script}")
    _run(command)
    return os.path.join(out, soname)


def register(setup: str | None = None) -> None:
    """Load the stand-ins and register the plugin's compiler as JAX's `rocm` platform (compile only)."""
    from zaya_jax.jax_compat import register_gpu_plugin

    setup = setup or setup_dir()
    plugin = os.path.join(setup, PLUGIN_LIBRARY)
    standins = sorted(p for p in glob.glob(os.path.join(setup, STANDIN_DIR, "lib*.so*")) if not p.endswith((".c", ".map")))
    if not os.path.exists(plugin) or not standins:
        raise ZayaError(f"a ROCM --gpu-target needs the compile-only ROCm set-up in {setup}, which is not there: "
                        f"run {SETUP_COMMAND}")
    for path in standins:  # by soname: the plugin's NEEDED entries resolve to these (loading twice is a no-op)
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    register_gpu_plugin("rocm", plugin, "ROCM")


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ZayaError(f"the ROCm compile set-up needs `{command[0]}` (binutils and gcc); install them") from None
    if done.returncode:
        raise ZayaError(f"`{' '.join(command[:3])} ...` failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return done.stdout
