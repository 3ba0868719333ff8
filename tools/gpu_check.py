"""One command that turns a lent GPU into numbers: a timed ZAYA1-width train step, the kernel benchmark, a profiled step (and, asked, the kernel tests).

    python tools/gpu_check.py [--parts step,bench,profile[,tests]] [--budget-s 540] [--out-dir benchmarks]
        [--layers N] [--seq-len 4096] [--batch 4] [--micro-batches M] [--steps 5] [--platform cuda|rocm|cpu]
        [--allow-cpu] [--config.KEY=VALUE ...]
    python tools/gpu_check.py --gpu-target benchmarks/gpu_targets/mi300x.txtpb   # the dry run, no GPU

Owns the time budget, the train-step timing and the report; it owns no kernels, tests or model
code. Each part runs in its own subprocess with its own share of what is left of `--budget-s`,
so a crash, a hang or an out-of-memory in one never stops the others and each has the GPU's
memory to itself:

* `step`: the normal stack (`experiments/zaya1_base_phase1.py` + overrides → `build_program` →
  AOT-compiled `jitted_train_step`) at ZAYA1-base width (hidden 2048, 16 experts, 8 query : 2 KV
  heads of 128, vocab 262,272), bf16, remat `full`, on one device, `--batch` sequences of
  `--seq-len` per step in `--micro-batches` (default one sequence each), on random tokens. Compile
  time, the first step, then up to `--steps` timed steps: tokens/s, MFU (`train/flops.py` against
  `hardware.py`'s peak) and peak memory; then the step's halves compiled and timed apart
  (`Program.jitted_gradient_step`, `jitted_update_step`) for the forward+backward MFU and the
  node-equivalent MFU (the update at its share of an 8-GPU node). Without `--layers`, the layer
  count is the most that fits 85% of the device by a memory estimate from the abstract train state
  (and that compiles in the budget at a guessed 6 s per layer); if XLA's compiled memory or the run
  says it does not fit, it steps down while the budget lasts. `--config.KEY=VALUE` overrides reach
  this part only.
* `bench`: `tools/bench_kernels.py --size zaya1` (`small` on CPU); its JSON rows.
* `profile`: `tools/profile_step.py` on the step's shape at `PROFILE_LAYERS` layers (the model
  sized down on CPU): the step's device time by model part and kind of op (matmuls, fp32 matmuls,
  kernels, elementwise work, copies), which `zaya mesh --calibrate` prices the elementwise work and
  Muon's Newton–Schulz from; its JSON beside the report (`gpu_step_profile_<device>.json`).
* `tests` (only when asked): `python -m pytest -q tests/test_kernels_*.py` with JAX_PLATFORMS set
  to the GPU platform (up to 8 pytest-xdist workers where it is installed): pass/fail counts and
  one line per failure.

`--gpu-target FILE` is the dry run (`tools/gpu_dry_run.py`), for a GPU this machine does not have
(an XLA target config; AMD ones through `tools/rocm_compile_setup.py`): the step is compiled, not
timed (XLA's peak against the target's HBM, stepping down as an out-of-memory would), and every
kernel benchmark case is compiled, the vendor grouped GEMM with its flags; the report is
`gpu_<device>_dry_run`, never a real run's.

It writes `OUT_DIR/gpu_<device>.json` and `.md` (device: `h100`, `mi300x`, ... from
`hardware.py`, else a slug of the device kind) after every part. Bad input is one line
`gpu_check: error: ...` and exit status 2; otherwise the exit status is 0 when every part passed.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# In order of value: the timed step (its three MFUs), the kernels against the vendors' and Newton–Schulz
# fp32 against bf16, the profile. The kernel tests only when asked: they outran the budget on all
# three H200 runs, and the suite belongs on a machine of its own.
PARTS = ("step", "bench", "profile", "tests")
DEFAULT_PARTS = ("step", "bench", "profile")
DRY_RUN_PARTS = ("step", "bench")  # what --gpu-target compiles; the profile and the tests need the GPU
SHARES = {"step": 0.45, "bench": 0.30, "profile": 0.25, "tests": 0.30}  # of the budget left when the part starts
PROFILE_LAYERS = 4  # few layers compile fast; the step's per-layer parts scale with them
EXPERIMENT = os.path.join(ROOT, "experiments", "zaya1_base_phase1.py")
PLATFORMS = ("cuda", "rocm", "cpu")
RESERVE_S = 10.0  # kept back for stopping a part that overruns and for writing the report
RESULT_TAG = "GPU_CHECK_RESULT "
GIB = 1024 ** 3
NODE_GPUS = 8  # the node the node-equivalent MFU spreads the update over
# A guess, not a measurement: the step's layers are unrolled, so its compile time grows with them;
# without --layers the layer count is also capped to what compiles in the step's budget at this rate.
COMPILE_S_PER_LAYER = 6.0


class UsageError(Exception):
    """Bad input: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


# ---- arguments -------------------------------------------------------------------------------
def parse_args(argv):
    p = _Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks"), help="report folder (default benchmarks/)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget for everything (default 540)")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma-separated subset of {','.join(PARTS)} (default {','.join(DEFAULT_PARTS)})")
    p.add_argument("--layers", type=int, help="layers of the timed model (default: as many as fit)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4, ZAYA1's 16,384 tokens per GPU)")
    p.add_argument("--micro-batches", type=int, help="micro-batches the step takes them in (default: one sequence each)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the first (default 5)")
    p.add_argument("--platform", choices=PLATFORMS, help="JAX platform (default: what JAX finds)")
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU (checks the tool, not a GPU)")
    p.add_argument("--gpu-target", metavar="FILE", help="dry run: compile the step and the kernel benchmark for "
                   "the GPU this XLA target config describes, here, without it (e.g. "
                   "benchmarks/gpu_targets/mi300x.txtpb); nothing runs")
    p.add_argument("--worker", choices=("step",), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # the worker's, in time.time() seconds
    args, extra = p.parse_known_args(argv)
    from zaya_jax.errors import ZayaError
    from zaya_jax.experiment.load import parse_override_args
    try:
        parse_override_args(extra)
    except ZayaError as e:
        raise UsageError(str(e)) from None
    args.overrides = extra
    return args


def check_args(args) -> list[str]:
    """The chosen parts, after checking every argument that needs no device."""
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown or not parts:
        what = f"unknown part {unknown[0]!r}" if unknown else "no part given"
        raise UsageError(f"--parts: {what} (choose from {','.join(PARTS)})")
    if args.gpu_target:
        needs_gpu = [x for x in parts if x in ("profile", "tests")]
        if args.parts == ",".join(DEFAULT_PARTS):
            parts = list(DRY_RUN_PARTS)
        elif needs_gpu:
            raise UsageError(f"--gpu-target compiles and runs nothing; --parts {needs_gpu[0]} needs the GPU "
                             f"(a dry run has {','.join(DRY_RUN_PARTS)})")
        if args.platform or args.allow_cpu:
            raise UsageError("--gpu-target names the GPU; leave out --platform and --allow-cpu")
        if not os.path.isfile(args.gpu_target):
            raise UsageError(f"--gpu-target {args.gpu_target}: no such file (an XLA GPU target config, e.g. "
                             "benchmarks/gpu_targets/mi300x.txtpb)")
    if args.budget_s < 60:
        raise UsageError(f"--budget-s must be at least 60 (got {args.budget_s:g}): the parts need time to compile")
    for name in ("layers", "seq_len", "batch", "steps", "micro_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
    if args.micro_batches and args.batch % args.micro_batches:
        raise UsageError(f"--batch {args.batch} must be a multiple of --micro-batches {args.micro_batches}")
    check_writable(args.out_dir)
    return [x for x in PARTS if x in parts]


def check_writable(folder: str, flag: str = "--out-dir") -> None:
    """`folder` exists (or can be made) and takes a file: found before minutes of compiling."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".zaya_probe_{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"{flag} {folder} is not writable: {e.strerror or e}") from None


# ---- subprocesses ----------------------------------------------------------------------------
def child_env(platform: str | None, **extra) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)
    if platform:
        env["JAX_PLATFORMS"] = platform
    return env


def run_child(cmd: list[str], env: dict, timeout: float, echo=None) -> dict:
    """Run cmd in its own process group; kill the group at `timeout`. Output lines, rc, seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if echo and echo(lines[-1]):
                print(f"  {lines[-1]}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except (subprocess.TimeoutExpired, ProcessLookupError):
                continue
    reader.join(5)
    return {"rc": proc.returncode, "lines": lines, "seconds": round(time.monotonic() - start, 1),
            "timed_out": timed_out}


def tagged_result(lines: list[str]) -> dict | None:
    for line in reversed(lines):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return None


def last_words(lines: list[str], n: int = 1) -> str:
    text = [x.strip() for x in lines if x.strip()]
    return " / ".join(text[-n:])[:300] if text else "no output"


# ---- the device ------------------------------------------------------------------------------
PROBE = r"""
import importlib.metadata, json, platform, jax
d = jax.devices()[0]
version = str(getattr(d.client, "platform_version", "")).lower()
target = d.platform if d.platform in ("cpu", "tpu") else ("rocm" if "rocm" in version or "hip" in version else "cuda")
print(%r + json.dumps({"device_kind": d.device_kind, "platform": d.platform, "target": target,
    "device_count": jax.device_count(), "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
    "python": platform.python_version()}))
""" % RESULT_TAG


def probe(platform: str | None, allow_cpu: bool) -> dict:
    env = child_env(platform, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    run = run_child([sys.executable, "-c", PROBE], env, 180)
    found = tagged_result(run["lines"])
    if found is None:
        hint = f" (is JAX's {platform} plugin installed?)" if platform in ("cuda", "rocm") else ""
        raise UsageError(f"JAX could not start platform {platform or '(auto)'}{hint}: {last_words(run['lines'])}")
    if found["target"] == "cpu" and not allow_cpu:
        raise UsageError("JAX found no GPU (platform cpu); pass --platform=cuda or --platform=rocm on a GPU "
                         "machine, or --allow-cpu to check the tool on CPU")
    found["slug"] = device_slug(found["device_kind"], found["target"])
    return found


def dry_run_probe(path: str) -> dict:
    """The compile-only device of --gpu-target, from a subprocess (`tools/gpu_dry_run.py`)."""
    import gpu_dry_run

    code = gpu_dry_run.PROBE % (os.path.join(ROOT, "tools"), RESULT_TAG)
    run = run_child([sys.executable, "-c", code, path], child_env("cpu"), 300)
    try:
        found = gpu_dry_run.probe_result(run["lines"], RESULT_TAG)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if found is None:
        raise UsageError(f"--gpu-target {path}: no compile-only device ({last_words(run['lines'])})")
    found["slug"] = device_slug(found["device_kind"], found["target"]) + "_dry_run"  # never a real run's report
    return found


def device_slug(kind: str, target: str) -> str:
    """'h100', 'mi300x', ... for known devices (hardware.py), else the device kind in lower_snake_case."""
    if target == "cpu":
        return "cpu"
    from zaya_jax.hardware import profile_for_kind
    known = profile_for_kind(kind)
    return known.name if known else (re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown")


# ---- the parts -------------------------------------------------------------------------------
def run_tests(ctx: dict, budget: float) -> dict:
    files = sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests", "test_kernels_*.py")))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *test_workers(), *files]
    # Workers share the device: each takes memory as it needs it, not 75% up front.
    run = run_child(cmd, child_env(ctx["target"], XLA_PYTHON_CLIENT_PREALLOCATE="false"), budget)
    out = {"seconds": run["seconds"], "files": files, **pytest_counts(run["lines"])}
    out["failures"] = [x[:240] for x in run["lines"] if x.startswith(("FAILED ", "ERROR "))][:12]
    if run["timed_out"]:
        return {**out, "status": "timeout", "error": f"timed out after {budget:.0f} s"}
    if run["rc"] == 0:
        return {**out, "status": "ok"}
    if run["rc"] == 1:
        return {**out, "status": "failed", "error": f"{out.get('failed', 0)} failed, {out.get('errors', 0)} errors"}
    return {**out, "status": "error", "error": f"pytest exit status {run['rc']}: {last_words(run['lines'])}"}


def test_workers() -> list[str]:
    """pytest-xdist workers where it is installed: the kernel tests are compile-bound (about 6 s each on an
    H200 run serially), and a GPU box has the cores to compile several at once."""
    if importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]


def pytest_counts(lines: list[str]) -> dict:
    """Counts from pytest's summary line, or from its progress dots when it never got there."""
    for line in reversed(lines):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b", line)
        if found and re.search(r" in [\d.]+s", line):
            counts = {("errors" if k.startswith("error") else k): int(n) for n, k in found}
            return {"summary": line.strip("= "), **counts}
    dots = "".join(x.split(" [")[0] for x in lines if re.fullmatch(r"[.FEsxX]+(\s+\[\s*\d+%\])?", x.strip()))
    return {"summary": "no summary (stopped early)", "passed": dots.count("."), "failed": dots.count("F"),
            "errors": dots.count("E"), "skipped": dots.count("s")}


def run_bench(ctx: dict, budget: float) -> dict:
    size = "small" if ctx["target"] == "cpu" else "zaya1"
    # Named, the platform lets the kernel benchmark set the vendor grouped GEMM's XLA flags before JAX starts.
    where = ["--gpu-target", ctx["gpu_target"]] if ctx["gpu_target"] else ["--platform", ctx["target"]]
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_kernels.py"), "--size", size, "--iters", "10",
           *where, "--out", ctx["out_dir"]]
    run = run_child(cmd, child_env(ctx["jax_platform"]), budget, echo=lambda x: x.endswith("...") or "compiled" in x)
    stem = re.sub(r"[^a-z0-9]+", "_", ctx["device_kind"].lower()).strip("_") + ("_compiled" if ctx["gpu_target"] else "")
    path = os.path.join(ctx["out_dir"], f"kernels_{size}_{stem}.json")
    out = {"seconds": run["seconds"], "size": size}
    failed = json_part_failure(run, budget, path)
    if failed:
        return {**out, **failed}
    with open(path) as f:
        rows = json.load(f)["rows"]
    failed = [r for r in rows if "error" in r]
    out.update(json=shown_path(path), rows=rows)
    if failed:
        r = failed[0]
        return {**out, "status": "failed", "error": f"{len(failed)} of {len(rows)} measurements failed, first "
                f"{r['kernel']}/{r['backend']}/{r['pass']}: {r['error'][:160]}"}
    return {**out, "status": "ok"}


def json_part_failure(run: dict, budget: float, path: str) -> dict | None:
    """The status of a part whose subprocess writes its results to `path`, if it did not."""
    if run["timed_out"]:
        return {"status": "timeout", "error": f"timed out after {budget:.0f} s"}
    if run["rc"] != 0 or not os.path.isfile(path):
        return {"status": "error", "error": f"exit status {run['rc']}: {last_words(run['lines'])}"}
    return None


def shown_path(path: str) -> str:
    """Relative to the repository when inside it, else absolute."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return os.path.abspath(path) if rel.startswith("..") else rel


def run_profile(ctx: dict, budget: float) -> dict:
    """`tools/profile_step.py` in a subprocess; its rows (ms per step by part and kind) and the
    profiled shape, which calibration needs to price the same step."""
    args = ctx["args"]
    path = os.path.join(ctx["out_dir"], f"gpu_step_profile_{ctx['slug']}.json")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "profile_step.py"), f"--layers={PROFILE_LAYERS}",
           f"--seq-len={args.seq_len}", f"--batch={args.batch}", f"--out={path}"]
    run = run_child(cmd + (["--allow-cpu"] if ctx["target"] == "cpu" else []), child_env(ctx["target"]), budget)
    out = {"seconds": run["seconds"]}
    failed = json_part_failure(run, budget, path)
    if failed:
        return {**out, **failed}
    with open(path) as f:
        profiled = json.load(f)
    keep = ("layers", "seq_len", "batch", "micro_batches", "model", "kernels", "remat", "step_s", "rows",
            "unmatched_ms_per_step", "muon_ns_dtype")
    return {**out, "status": "ok", "json": shown_path(path), **{k: profiled.get(k) for k in keep}}


def run_step(ctx: dict, budget: float) -> dict:
    """The step worker in a subprocess; without --layers, fewer layers after each out-of-memory."""
    args, deadline, attempts = ctx["args"], time.monotonic() + budget, []
    layers = args.layers or 0  # 0: the worker picks from its memory estimate
    env = child_env(ctx["jax_platform"], XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                                                    "0.92"))
    while True:
        left = deadline - time.monotonic()
        cmd = [sys.executable, os.path.abspath(__file__), "--worker=step", f"--layers={layers}",
               f"--seq-len={args.seq_len}", f"--batch={args.batch}", f"--steps={args.steps}",
               *([f"--micro-batches={args.micro_batches}"] if args.micro_batches else []),
               f"--deadline={time.time() + left - 5:.1f}",
               *([f"--gpu-target={args.gpu_target}"] if args.gpu_target else []), *args.overrides]
        run = run_child(cmd, env, left, echo=lambda x: x.startswith("gpu_check: step"))
        res = tagged_result(run["lines"]) or {}
        if run["timed_out"]:
            res = {**res, "status": "timeout", "error": f"timed out after {left:.0f} s ({last_words(run['lines'])})"}
        elif res.get("status", "incomplete") == "incomplete":  # died without a verdict: an abort, a crash
            said = "\n".join(run["lines"][-50:]).lower()
            oom = "resource_exhausted" in said or "out of memory" in said
            res = {"layers": layers, **res, "status": "oom" if oom else "error",
                   "error": f"worker exit status {run['rc']}: {last_words(run['lines'], 2)}"}
        attempts.append({"layers": res.get("layers", layers), "status": res["status"], "seconds": run["seconds"]})
        smaller = fewer_layers(res) if not args.layers else None
        if res["status"] != "oom" or smaller is None or deadline - time.monotonic() < 60:
            return {**res, "status": "failed" if res["status"] == "oom" else res["status"], "attempts": attempts,
                    "seconds": round(budget - (deadline - time.monotonic()), 1)}
        print(f"gpu_check: step: {res['layers']} layers do not fit ({res.get('error', '')}); trying {smaller}",
              flush=True)
        layers = smaller


def fewer_layers(res: dict) -> int | None:
    """The next layer count after an out-of-memory at res['layers'], None when there is none."""
    layers = res.get("layers") or 0
    if layers <= 1:
        return None
    need, limit = res.get("needed_bytes"), res.get("limit_bytes")
    guess = int(layers * limit / need * 0.95) if need and limit else int(layers * 0.75)
    return max(1, min(layers - 1, guess))


# ---- the step worker (runs in the subprocess) -------------------------------------------------
def say(text: str) -> None:
    print(f"gpu_check: step: {text}", flush=True)


def emit(result: dict) -> int:
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


def step_overrides(layers: int, seq_len: int, batch: int, micro_batches: int | None = None) -> list[str]:
    """The step's shape: `batch` sequences of `seq_len`, in `micro_batches` (default one sequence each)."""
    return [f"--config.model.num_hidden_layers={layers}", f"--config.train.seq_len={seq_len}",
            f"--config.train.global_batch_size={batch}", f"--config.train.grad_accum_steps={micro_batches or batch}",
            "--config.mesh.data=1", "--config.mesh.fsdp=1"]


def tree_bytes(tree) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def memory_estimate(args, layers: int) -> int:
    """Bytes a step at `layers` needs: train state + gradients (accumulated and one micro-batch's)
    + remat-saved block inputs + the working set of one block and one loss chunk."""
    from zaya_jax.experiment import load_experiment
    from zaya_jax.train.program import build_program
    import jax
    exp = load_experiment(EXPERIMENT, step_overrides(layers, args.seq_len, args.batch, args.micro_batches) + args.overrides)
    program = build_program(exp, devices=jax.devices()[:1])
    state = program.abstract_state()
    m, c = exp.model, exp.config.train
    tokens = c.seq_len * (c.global_batch_size // c.grad_accum_steps)
    saved = layers * tokens * m.hidden_size * 4
    working = tokens * (3 * 4 * min(c.loss_vocab_chunk, m.vocab_size) + 64 * m.hidden_size) + GIB
    return tree_bytes(state) + 2 * tree_bytes(state.params) + saved + working


def fit_layers(args, limit: int, max_layers: int = 40, headroom: float = 0.85) -> int:
    one, two = memory_estimate(args, 1), memory_estimate(args, 2)
    per_layer, fixed = two - one, 2 * one - two
    return max(1, min(max_layers, int((headroom * limit - fixed) // per_layer)))


def memory_limit(device) -> int:
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.5)  # CPU: half the host


def synthetic_batch(program, seed: int = 0) -> dict:
    """Random tokens, one document per row, every token a target: the keys of program.abstract_batch()."""
    import numpy as np
    c = program.exp.config.train
    rows, seq, vocab = c.global_batch_size, c.seq_len, program.modeldef.cfg.vocab_size
    tokens = np.random.default_rng(seed).integers(0, vocab, (rows, seq + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((rows, seq), np.int32),
             "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
             "loss_mask": np.ones((rows, seq), np.float32)}
    assert set(batch) == set(program.abstract_batch()), sorted(program.abstract_batch())
    return program.place_batch(batch)


def is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "resource_exhausted" in text or "out of memory" in text or "resourceexhausted" in text


def step_worker(args) -> int:
    deadline = time.monotonic() + ((args.deadline - time.time()) if args.deadline else 600)
    layers, limit = args.layers, None
    try:
        from zaya_jax.experiment import load_experiment
        # Loaded before JAX starts: a kernel backend that needs an XLA flag (moe_kernel=cudnn) sets it
        # here, as `zaya train` does, while XLA will still read it.
        load_experiment(EXPERIMENT, step_overrides(layers or 1, args.seq_len, args.batch, args.micro_batches) + args.overrides)
        if args.gpu_target:
            return emit(dry_run_step(args, layers))
        import jax
        device = jax.devices()[0]
        limit = memory_limit(device)
        if not layers:
            fit = fit_layers(args, limit)
            in_time = max(1, int((deadline - time.monotonic() - 60) / COMPILE_S_PER_LAYER))
            layers = min(fit, in_time)
            say(f"{fit} layers fit 85% of {limit / GIB:.1f} GiB by estimate, about {in_time} compile in the "
                f"budget: {layers} layers")
        return emit(time_step(args, layers, device, limit, deadline))
    except Exception as e:  # noqa: BLE001 - reported, one line, to the parent
        status = "oom" if is_oom(e) else "error"
        return emit({"status": status, "layers": layers, "limit_bytes": limit,
                     "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:240] if str(e).strip() else ''}"})


def dry_run_step(args, layers: int | None) -> dict:
    """The step compiled for --gpu-target instead of timed; without --layers, as many as fit by estimate."""
    import gpu_dry_run

    [device] = gpu_dry_run.devices(args.gpu_target)  # JAX on the CPU, the target's compiler registered
    limit = gpu_dry_run.target_memory(open(args.gpu_target, encoding="utf-8").read())
    if not layers:
        layers = fit_layers(args, limit)
        say(f"{layers} layers fit 85% of {limit / GIB:.1f} GiB by estimate")
    overrides = step_overrides(layers, args.seq_len, args.batch, args.micro_batches) + args.overrides
    return gpu_dry_run.step_compile(device, limit, layers, EXPERIMENT, overrides)


def time_step(args, layers: int, device, limit: int, deadline: float) -> dict:
    import jax
    import numpy as np
    from zaya_jax.experiment import load_experiment
    from zaya_jax.hardware import detect, profile
    from zaya_jax.train.flops import mfu, training_flops_per_token
    from zaya_jax.train.muon import ns_dtype
    from zaya_jax.train.program import build_program

    exp = load_experiment(EXPERIMENT, step_overrides(layers, args.seq_len, args.batch, args.micro_batches) + args.overrides)
    program = build_program(exp, devices=[device])
    m, c = exp.model, exp.config.train
    out = {"layers": layers, "seq_len": c.seq_len, "batch": c.global_batch_size, "micro_batches": c.grad_accum_steps,
           "model": {k: getattr(m, k) for k in ("hidden_size", "num_hidden_layers", "num_experts",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim",
                                                 "moe_intermediate_size", "vocab_size", "compute_dtype")},
           "kernels": program.kernels(), "muon_ns_dtype": ns_dtype(exp.config.optim.muon_ns_dtype, program.target),
           "remat": c.remat, "params": int(sum(x.size for x in jax.tree.leaves(program.abstract_state().params))),
           "limit_bytes": limit}
    say(f"compiling {layers} layers, {c.global_batch_size} × {c.seq_len} tokens per step")
    compiled, out["compile_phases_s"] = program.compile_train_step_phases()  # trace, lower, XLA compile
    out["compile_s"] = round(sum(out["compile_phases_s"].values()), 2)
    mem = compiled.memory_analysis()
    if mem is not None:
        need = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes)
        out["compiled_bytes"] = int(need)
        if device.platform != "cpu" and need > limit:
            return {**out, "status": "oom", "needed_bytes": int(need),
                    "error": f"XLA needs {need / GIB:.1f} GiB of {limit / GIB:.1f} GiB"}
    emit({**out, "status": "incomplete"})  # what the parent reports if the budget ends before the steps do
    say(f"compiled in {out['compile_s']:.1f} s; initialising")
    t = time.perf_counter()
    state = jax.block_until_ready(program.init())
    batch = synthetic_batch(program)
    out["init_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, batch))
    out["first_step_s"] = round(time.perf_counter() - t, 3)
    out["first_loss"] = float(metrics["loss"])
    n = int(max(1, min(args.steps, (deadline - time.monotonic() - 5) // max(out["first_step_s"], 1e-3))))
    emit({**out, "status": "incomplete"})
    say(f"first step {out['first_step_s']:.2f} s (loss {out['first_loss']:.3f}); timing {n} steps")
    times = []
    for _ in range(n):
        t = time.perf_counter()
        state, metrics = jax.block_until_ready(compiled(state, batch))
        times.append(time.perf_counter() - t)
    out["step_times_s"] = [round(x, 4) for x in times]
    out["step_s"] = float(np.median(times))
    out["last_loss"] = float(metrics["loss"])
    out["tokens_per_s"] = c.global_batch_size * c.seq_len / out["step_s"]
    stats = device.memory_stats() or {}
    out["peak_bytes"] = stats.get("peak_bytes_in_use")
    hw = detect(device) if c.hardware == "auto" else profile(c.hardware)
    flops = training_flops_per_token(m, c.seq_len)
    out.update(flops_per_token=flops.total, hardware=hw.name if hw else None,
               peak_tflops=hw.peak_bf16_tflops if hw else None, nominal_peak=bool(hw and hw.nominal))
    out["tflops_per_s"] = flops.total * out["tokens_per_s"] / 1e12
    out["mfu"] = mfu(flops.total, out["tokens_per_s"], 1, hw.peak_bf16_tflops) if hw else None
    if deadline - time.monotonic() > 30:
        out.update(split_timing(program, state, batch, n, deadline))
        tokens = c.global_batch_size * c.seq_len
        if hw and out.get("update_s"):
            # The gradient step alone, and with the update at its share of an 8-GPU node (distributed
            # Muon and ZeRO-1 spread it over the node's devices): fair single-GPU figures for a cluster.
            out["mfu_forward_backward"] = mfu(flops.total, tokens / out["gradient_s"], 1, hw.peak_bf16_tflops)
            node = out["gradient_s"] + out["update_s"] / NODE_GPUS
            out["mfu_node_equivalent"] = mfu(flops.total, tokens / node, 1, hw.peak_bf16_tflops)
    if not np.isfinite(out["last_loss"]):
        return {**out, "status": "failed", "error": f"non-finite loss {out['last_loss']}"}
    return {**out, "status": "ok"}


def split_timing(program, state, batch, n: int, deadline: float) -> dict:
    """The train step's two halves compiled and timed apart (median of `n` each, after one warm-up):
    the gradient step (forward, backward, reduction) and the update (Muon/AdamW, balancer, guard)."""
    import jax
    import numpy as np

    gradient, update = program.jitted_gradient_step(), program.jitted_update_step()
    say("timing the gradient step and the update apart")
    grads, sums = jax.block_until_ready(gradient(state.params, state.biases, batch))
    state, _ = jax.block_until_ready(update(state, grads, sums, batch))
    grad_times, update_times = [], []
    for _ in range(n):
        if deadline - time.monotonic() < 10:
            break
        grads = sums = None  # one gradient set at a time
        t = time.perf_counter()
        grads, sums = jax.block_until_ready(gradient(state.params, state.biases, batch))
        grad_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        state, _ = jax.block_until_ready(update(state, grads, sums, batch))
        update_times.append(time.perf_counter() - t)
    if not grad_times:
        return {}
    return {"gradient_s": float(np.median(grad_times)), "update_s": float(np.median(update_times)),
            "gradient_times_s": [round(x, 4) for x in grad_times], "update_times_s": [round(x, 4) for x in update_times]}


# ---- the report ------------------------------------------------------------------------------
def _gib(x) -> str:
    return f"{x / GIB:.1f} GiB" if x else "–"


def part_line(name: str, part: dict) -> str:
    """One-line outcome of a part for the summary table."""
    if part["status"] == "skipped":
        return "not run"
    if name == "tests":
        counts = ", ".join(f"{part[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if part.get(k))
        return counts or part.get("summary", "")
    if name == "bench" and "rows" in part and all("compiled_s" in r or "error" in r for r in part["rows"]):
        return f"{len(part['rows'])} kernels compiled ({part['size']} shapes, nothing run): {part.get('json', '')}"
    if name == "bench" and "rows" in part:
        return f"{len(part['rows'])} measurements ({part['size']} shapes): {part.get('json', '')}"
    if name == "profile" and "rows" in part:
        kinds = collections.Counter()
        for row in part["rows"]:
            kinds[row["kind"]] += row["ms_per_step"]
        return (f"{part['layers']} layers, {1e3 * part['step_s']:.0f} ms a step: "
                + ", ".join(f"{k} {v:.0f} ms" for k, v in kinds.most_common()) + f" ({part.get('json', '')})")
    if name == "step" and part.get("dry_run") and part["status"] == "ok":
        import gpu_dry_run
        return gpu_dry_run.report_line(part)
    if name == "step" and "tokens_per_s" in part:
        mfu = f"MFU {100 * part['mfu']:.1f}%" + (" (nominal CPU peak)" if part.get("nominal_peak") else "") \
            if part.get("mfu") is not None else "MFU – (unknown device)"
        return (f"{part['layers']} layers: {part['tokens_per_s']:,.0f} tokens/s, {mfu}, "
                f"peak {_gib(part.get('peak_bytes'))}, compile {part['compile_s']:.0f} s")
    return part.get("error", "")


def report_markdown(result: dict) -> str:
    """The report as Markdown: a summary row per part, one line per failure, then the details."""
    d = result["device"]
    lines = [f"# GPU check: {d['device_kind']}", "",
             f"jax {result['jax']} / jaxlib {result['jaxlib']}, platform {d['target']}, {d['device_count']} device(s), "
             f"Python {result['python']}; {result['started']}, budget {result['budget_s']:.0f} s, "
             f"took {result['total_s']:.0f} s. Written by `tools/gpu_check.py`.", "",
             "| part | status | seconds | result |", "|---|---|---:|---|"]
    parts = result["parts"]
    for name, part in parts.items():
        secs = f"{part['seconds']:.0f}" if part.get("seconds") is not None else "–"
        lines.append(f"| {name} | {part['status']} | {secs} | {part_line(name, part).replace('|', '/')} |")
    problems = [(n, p) for n, p in parts.items() if p["status"] not in ("ok", "skipped")]
    if problems:
        lines += ["", "## What failed", ""] + [f"- {n}: {p['status']}: {p.get('error', '')}" for n, p in problems]
    failures = parts.get("tests", {}).get("failures") or []
    if failures:
        lines += ["", "Kernel test failures:", ""] + [f"- `{x}`" for x in failures]
    lines += step_section(parts.get("step", {})) + bench_section(parts.get("bench", {}))
    return "\n".join(lines) + "\n"


def step_section(step: dict) -> list[str]:
    if "tokens_per_s" not in step:
        return []
    m = step["model"]
    rows = [("model", f"hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_experts']} experts, "
                      f"{m['num_attention_heads']}:{m['num_key_value_heads']} heads × {m['head_dim']}, "
                      f"vocab {m['vocab_size']}, {step['params'] / 1e9:.2f} B params"),
            ("compute", f"{m['compute_dtype']}, remat {step['remat']}, kernels "
                        + ", ".join(f"{k} {v}" for k, v in step.get("kernels", {}).items())),
            ("tokens per step", f"{step['batch']} × {step['seq_len']} ({step['micro_batches']} micro-batches)"),
            ("compile", f"{step['compile_s']:.1f} s (init {step['init_s']:.1f} s, "
                        f"first step {step['first_step_s']:.2f} s)"),
            ("step time", f"{step['step_s']:.3f} s (median of {len(step['step_times_s'])})"),
            ("tokens/s", f"{step['tokens_per_s']:,.0f}"),
            ("model TFLOP/s", f"{step['tflops_per_s']:.3g} ({step['flops_per_token'] / 1e9:.3g} GFLOP/token)"),
            ("MFU, end to end on one device", (f"{100 * step['mfu']:.1f}% of {step['peak_tflops']} TFLOP/s ({step['hardware']}"
                     f"{', nominal' if step.get('nominal_peak') else ''})") if step.get("mfu") is not None else "–"),
            ("MFU, forward + backward", _split_line(step, "mfu_forward_backward", "gradient_s")),
            ("MFU, node-equivalent (update / 8)", _split_line(step, "mfu_node_equivalent", "update_s")),
            ("peak memory", f"{_gib(step.get('peak_bytes'))} of {_gib(step.get('limit_bytes'))}"),
            ("loss", f"{step['first_loss']:.3f} → {step['last_loss']:.3f}"),
            ("attempts", ", ".join(f"{a['layers']} layers: {a['status']}" for a in step.get("attempts", [])))]
    return ["", "## Train step", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def _split_line(step: dict, key: str, seconds: str) -> str:
    if step.get(key) is None:
        return "–"
    return f"{100 * step[key]:.1f}% ({seconds.replace('_s', '')} {step[seconds]:.3f} s)"


def bench_section(bench: dict) -> list[str]:
    rows = bench.get("rows") or []
    if not rows:
        return []
    lines = ["", f"## Kernels ({bench['size']} shapes)", "",
             "| kernel | variant | backend | pass | ms | TFLOP/s | GB/s | baseline ÷ this |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['kernel']} | {r['variant']} | {r['backend']} | {r['pass']} |"
        if "compiled_s" in r:
            lines.append(f"{head} compiled in {r['compiled_s']:.1f} s (dry run) | | | |")
            continue
        if "seconds" not in r:
            lines.append(f"{head} failed: {r.get('error', '')[:120].replace('|', '/')} | | | |")
            continue
        ratio = f"{r['baseline_time_over_this']:.2f} vs {r['baseline']}" if "baseline_time_over_this" in r else "–"
        lines.append(f"{head} {1e3 * r['seconds']:.3f} | {r.get('tflops', 0):.3g} | {r.get('gb_per_s', 0):.3g} | "
                     f"{ratio} |")
    return lines


def write_report(result: dict, out_dir: str) -> str:
    stem = os.path.join(out_dir, f"gpu_{result['device']['slug']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    with open(stem + ".md", "w") as f:
        f.write(report_markdown(result))
    return stem


# ---- main ------------------------------------------------------------------------------------
RUNNERS = {"tests": run_tests, "bench": run_bench, "profile": run_profile, "step": run_step}


def part_budget(name: str, todo: list[str], left: float) -> float:
    return left * SHARES[name] / sum(SHARES[x] for x in todo)


def main(argv=None) -> int:
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.monotonic()
    try:
        args = parse_args(argv)
        if args.worker == "step":
            return step_worker(args)
        parts = check_args(args)
        if args.gpu_target:
            print(f"gpu_check: dry run, compiling for {args.gpu_target} without the GPU", flush=True)
            device = dry_run_probe(args.gpu_target)
        else:
            print(f"gpu_check: starting JAX ({args.platform or 'its own platform choice'})", flush=True)
            device = probe(args.platform, args.allow_cpu)
    except UsageError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    print(f"gpu_check: {device['device_kind']} ({device['target']}), jax {device['jax']}; parts {','.join(parts)}, "
          f"budget {args.budget_s:.0f} s", flush=True)
    ctx = {"args": args, "target": device["target"], "device_kind": device["device_kind"], "slug": device["slug"],
           "out_dir": args.out_dir, "gpu_target": args.gpu_target,
           "jax_platform": "cpu" if args.gpu_target else device["target"]}  # a dry run's JAX stays on the CPU
    result = {"tool": "tools/gpu_check.py", "started": started, "budget_s": args.budget_s,
              "jax": device.pop("jax"), "jaxlib": device.pop("jaxlib"), "python": device.pop("python"),
              "device": device, "parts": {p: {"status": "skipped"} for p in PARTS}, "total_s": 0.0}
    for i, name in enumerate(parts):
        left = args.budget_s - (time.monotonic() - t0) - RESERVE_S
        budget = part_budget(name, parts[i:], left)
        print(f"gpu_check: [{i + 1}/{len(parts)}] {name} (budget {budget:.0f} s)", flush=True)
        try:
            part = RUNNERS[name](ctx, budget) if budget >= 10 else {"status": "timeout", "error": "no time left"}
        except Exception as e:  # noqa: BLE001 - one part's bug must not stop the others
            part = {"status": "error", "error": f"{type(e).__name__}: {e}"[:300]}
        part["budget_s"] = round(budget, 1)
        result["parts"][name] = part
        result["total_s"] = round(time.monotonic() - t0, 1)
        stem = write_report(result, args.out_dir)
        line, why = part_line(name, part), part.get("error", "")
        print(f"gpu_check: {name}: {part['status']}: {line}" + (f" ({why})" if why and why != line else ""), flush=True)
    print(f"gpu_check: wrote {stem}.json and {stem}.md ({result['total_s']:.0f} s)", flush=True)
    return 0 if all(result["parts"][p]["status"] == "ok" for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
