"""`zaya mesh`: parse the question, rank the layouts, print the table, write JSON / plot, validate."""

from __future__ import annotations

import argparse
import sys

from zaya_jax.errors import ZayaError

MAX_VALIDATE_DEVICES = 64  # fake CPU devices compile slowly; beyond this, validate one node instead

EPILOG = """\
config overrides: any --config.KEY=VALUE of `zaya train`, e.g. --config.train.remat=full
  --config.train.grad_accum_steps=8 --config.model.compute_dtype=bfloat16.

Hardware profiles (zaya_jax/hardware.py, with sources): mi300x, mi325x, mi355x, h100, h200, cpu.
--calibrate=benchmarks/gpu_<device>.json (tools/gpu_check.py's report from that device) replaces the
  profile's GEMM efficiency by the measured share of the peak of each kernel the run uses, prices the
  elementwise work and Muon's Newton-Schulz from the report's profiled step, and scales compute by the
  measured train step's residual (docs/mesh_explorer.md, "Calibrating").
--collectives=FILE replaces the modelled link bandwidths by measured ones: a JSON list of
  {"tier": "intra"|"inter", "op": "all_gather"|"reduce_scatter"|"all_reduce"|"all_to_all"|"permute",
   "group": 8, "bytes": 1048576, "busbw_gb_per_s": 250.0} records (busbw as nccl-tests/rccl-tests print it).

The JSON (--json) is a list, one object per layout: layout, fits, predicted {param_bytes, grad_bytes,
optimizer_bytes, activation_bytes, total_bytes, step_time_s, mfu, ...}, and with --validate
xla {argument_bytes, temp_bytes, ..., with --terms terms {parameters, gradients, ...}}. --validate compiles the real train step of the shown layouts
that fit, from abstract shapes, on nodes x gpus-per-node fake CPU devices (at most 64); run under
`zaya launch` or srun (a multi-process job) it compiles on the job's own devices instead; with
--gpu-target FILE (an XLA GPU target config, e.g. benchmarks/gpu_targets/h100_sxm.txtpb) it compiles
for nodes x gpus-per-node of those GPUs on this machine, without them, with XLA's GPU compiler (needs
JAX's CUDA plugin beside this jax: pip install "jax[cuda12]==<its version>"; no GPU or driver)."""


def add_parser(jobs) -> None:
    p = jobs.add_parser(
        "mesh", help="rank mesh layouts of a model on a cluster: predicted memory and step time",
        description="Enumerate every layout of the model over data, fsdp, expert, tsp, tensor and sequence on "
                    "NODES x GPUS devices, predict per-device memory and step time, and rank those that fit (tight: "
                    "they fit as predicted but not at the largest underestimate measured; --validate them).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE", help="experiment file, e.g. experiments/zaya1_base_phase1.py")
    p.add_argument("--hardware", required=True, metavar="NAME", help="mi300x | mi325x | mi355x | h100 | h200 | cpu")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--seq", type=int, metavar="TOKENS", help="sequence length (default: the config's train.seq_len)")
    p.add_argument("--global-batch", type=int, metavar="SEQUENCES",
                   help="sequences per optimizer step (default: the config's train.global_batch_size)")
    p.add_argument("--top", type=int, default=10, help="layouts to show and validate (default 10; 0 = all)")
    p.add_argument("--json", metavar="FILE", help="write every layout's prediction here")
    p.add_argument("--plot", metavar="FILE.png", help="memory vs step time scatter (needs matplotlib)")
    p.add_argument("--collectives", metavar="FILE", help="measured bus bandwidths (JSON records, see below)")
    p.add_argument("--host", metavar="FILE", help="this machine's measured matmul rate and memory bandwidth "
                   "(zaya bench host) in place of the profile's")
    p.add_argument("--calibrate", metavar="GPU_CHECK.json",
                   help="measured kernel efficiencies, a profiled step and a step residual from tools/gpu_check.py's report")
    p.add_argument("--validate", action="store_true", help="compile the shown layouts that fit and report XLA's bytes")
    p.add_argument("--terms", action="store_true",
                   help="with --validate: each memory term predicted against XLA's buffers at the step's peak")
    p.add_argument("--gpu-target", metavar="FILE", help="with --validate: compile for the GPUs this XLA target config "
                   "describes, here, without them (see below)")


def _check_numbers(args) -> None:
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node), ("--seq", args.seq),
                        ("--global-batch", args.global_batch)):
        if value is not None and value < 1:
            raise ZayaError(f"{flag} must be a positive integer, got {value}")
    if args.terms and not args.validate:
        raise ZayaError("--terms compares the prediction with XLA's compiled step; add --validate")
    if args.gpu_target and not args.validate:
        raise ZayaError("--gpu-target is the compiler --validate compiles with; add --validate")
    if args.gpu_target:
        from zaya_jax import hardware
        from zaya_jax.explore import deviceless

        platform = deviceless.target_platform(deviceless.read_target(args.gpu_target))
        if hardware.profile(args.hardware).target != platform:
            vendor = {"cuda": "NVIDIA", "rocm": "AMD"}[platform]
            same = " | ".join(name for name, p in hardware.PROFILES.items() if p.target == platform)
            raise ZayaError(f"--gpu-target {args.gpu_target} describes an {vendor} GPU; --hardware {args.hardware} "
                            f"is not one ({same})")
    if args.top < 0:
        raise ZayaError(f"--top must be 0 (all) or a positive count, got {args.top}")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ZayaError(f"--plot writes a PNG; name the file *.png, got {args.plot}")
    from zaya_jax.explore.report import check_writable

    for path in (args.json, args.plot):
        if path:
            check_writable(path)


def _validation_devices(args):
    """The devices --validate compiles on: in a multi-process job (`zaya launch`, SLURM) the job's
    own, laid out node by node; alone, nodes x gpus-per-node fake CPU devices (None: JAX's)."""
    from zaya_jax.cluster import startup

    n = args.nodes * args.gpus_per_node
    topology = startup.start(startup.settings_from(args))  # alone, it starts nothing (no JAX backend)
    if args.gpu_target:
        if topology.process_count > 1:
            raise ZayaError("--gpu-target compiles without the GPUs, in one process; run zaya mesh alone, "
                            "not under zaya launch or srun")
        return _deviceless_devices(args)
    if topology.process_count == 1:
        if n > MAX_VALIDATE_DEVICES:
            raise ZayaError(f"--validate compiles on {n} fake CPU devices here; ask for at most "
                            f"{MAX_VALIDATE_DEVICES} (e.g. --nodes=1): a node has the same per-device shapes")
        _fake_devices(n)
        return None
    import jax

    devices = topology.order(jax.devices())
    if len(devices) != n:
        raise ZayaError(f"--validate in this {topology.process_count}-process job compiles on its {len(devices)} "
                        f"devices; ask for --nodes x --gpus-per-node = {len(devices)}")
    return devices


def _deviceless_devices(args) -> list:
    """The --gpu-target's GPUs, nodes x gpus-per-node, for --hardware's own device."""
    from zaya_jax import hardware
    from zaya_jax.explore import deviceless

    config = deviceless.read_target(args.gpu_target)
    deviceless.use_cpu_host()
    devices = deviceless.gpu_devices(config, args.nodes, args.gpus_per_node, args.gpu_target)
    found = hardware.detect(devices[0])
    if found is None or found.name != args.hardware:
        raise ZayaError(f"--gpu-target {args.gpu_target} describes {devices[0].device_kind} "
                        f"({found.name if found else 'no hardware profile'}), not --hardware {args.hardware}")
    return devices


def _is_process_zero() -> bool:
    import jax

    return jax.process_index() == 0


def _fake_devices(n: int) -> None:
    """Compile on n CPU devices, if JAX has not started its backends yet (else the caller's own
    XLA_FLAGS decide, and `validate` says when they are too few)."""
    import jax

    from zaya_jax.kernels.xla_flags import backends_started

    if not backends_started():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", max(n, getattr(jax.config, "jax_num_cpu_devices", 1)))


def mesh_command(args, overrides: list[str]) -> int:
    _check_numbers(args)
    from zaya_jax import hardware
    from zaya_jax.experiment import load_experiment
    from zaya_jax.explore import report
    from zaya_jax.explore.against_xla import compiled_overrides
    from zaya_jax.explore.collectives import Network, load_curves
    from zaya_jax.explore.explorer import explore, fits_nowhere_message
    from zaya_jax.explore.placement import describe
    from zaya_jax.explore.workload import Workload
    from zaya_jax.kernels.registry import device_target

    devices = _validation_devices(args) if args.validate else None
    hw = hardware.profile(args.hardware)
    curves = load_curves(args.collectives) if args.collectives else None
    overrides = list(overrides)
    if args.seq:
        overrides += [f"--config.train.seq_len={args.seq}", f"--config.model.max_position_embeddings={args.seq}"]
    if args.global_batch:
        overrides.append(f"--config.train.global_batch_size={args.global_batch}")
    # Validated, the prediction is made for the kernels the validation compiles.
    # Fake CPU devices, or the job's own or --gpu-target's: the kernels `compile_layout` builds for them.
    on_cpu = devices is None or device_target(devices[0]) == "cpu"
    exp = load_experiment(args.config, compiled_overrides(overrides, on_cpu) if args.validate else overrides)
    if args.host:
        hw = hardware.measured(hw, args.host, exp.model.compute_dtype)
    question = Workload.from_experiment(exp, hw, args.nodes, args.gpus_per_node)
    calibrated = None
    if args.calibrate:
        from zaya_jax.explore.calibration import calibrate

        question, calibrated = calibrate(question, args.calibrate)
    predictions = explore(question, Network(hw, curves))
    shown = predictions[: args.top or None]
    fitting = [p for p in predictions if p.fits]
    xla = None
    if args.validate:
        from zaya_jax.explore.against_xla import validate

        targets = [p.layout for p in shown if p.fits]
        xla = validate(args.config, overrides, targets, progress=lambda m: print(m, file=sys.stderr, flush=True),
                       devices=devices, terms=args.terms)
        if devices is not None and not _is_process_zero():
            return 0  # every process compiled; process 0 reports
    print(report.header(question, len(shown), len(predictions), len(fitting), sum(p.tight for p in fitting)))
    if calibrated:
        print(calibrated.summary())
    print(report.table(shown, xla))
    if xla is not None and devices is None and (note := report.compiler_note(_jax_version())):
        print(note)
    if args.gpu_target:
        print(f"XLA: compiled for {len(devices)} {devices[0].device_kind} without them (--gpu-target "
              f"{args.gpu_target}): XLA's GPU compiler and kernels, nothing run")
    if args.terms:
        print("\nMemory per device by term, predicted against XLA's buffers at the step's peak:")
        print(report.terms_table(shown, xla))
    if args.json:
        report.write_json(args.json, predictions, xla)
        print(f"wrote {args.json} ({len(predictions)} layouts)")
    if args.plot:
        report.write_plot(args.plot, predictions, question)
        print(f"wrote {args.plot}")
    if not fitting:
        raise ZayaError(fits_nowhere_message(question, predictions))
    print(f"best: {describe(fitting[0].layout)} (set it with --config.mesh.AXIS=SIZE for each axis shown"
          f"{report.tight_note(fitting[0], question)})")
    return 0


def _jax_version() -> str:
    import jax

    return jax.__version__
