"""The `zaya` command line (also `python -m zaya_jax`): one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import os
import sys
import time

from zaya_jax.errors import ZayaError, raised_by_every_process
from zaya_jax.sizes import parse_size


def _process_started_at() -> float:
    """Wall time this process started (Linux: from /proc, before the interpreter and imports ran);
    elsewhere, now. The startup span of the event log begins here."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
        return started if abs(started - time.time()) < 3600 else time.time()
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _size(text: str) -> int:
    value = parse_size(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 1073741824 "
                                         "(a positive number of bytes)")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse with every refusal as one `zaya: error: ...` line and exit status 2, as every other
    refusal of the CLI (argparse's own prints its usage block first); its subcommands' parsers are
    of this class too (argparse makes them with the parent's class)."""

    def error(self, message: str):
        command = self.prog.removeprefix("zaya").strip()
        print(f"zaya: error: {command + ': ' if command else ''}{message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="zaya", description="zaya-jax: the ZAYA1 training stack on JAX. Each subcommand has its own --help.")
    jobs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    convert = jobs.add_parser("convert", help="convert checkpoints between Hugging Face and zaya-jax (Orbax)")
    direction = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    from_hf = direction.add_parser("from-hf", help="HF safetensors directory → zaya-jax Orbax checkpoint")
    from_hf.add_argument("--hf", required=True, metavar="DIR", help="HF directory with config.json and *.safetensors")
    from_hf.add_argument("--out", required=True, metavar="CKPT", help="new checkpoint directory (must not exist)")
    to_hf = direction.add_parser("to-hf", help="zaya-jax Orbax checkpoint → HF safetensors directory")
    to_hf.add_argument("--ckpt", required=True, metavar="CKPT", help="checkpoint written by zaya-jax")
    to_hf.add_argument("--out", required=True, metavar="DIR", help="new output directory (must not exist or be empty)")
    to_hf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="tensor dtype (default float32)")
    to_hf.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE",
                       help="split into model-0000k-of-0000n.safetensors files above this size (default 5GB)")
    for p in (from_hf, to_hf):
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_train(jobs)
    from zaya_jax.explore.command import add_parser as add_mesh

    add_mesh(jobs)
    from zaya_jax.cluster.launcher import add_parser as add_launch

    add_launch(jobs)
    from zaya_jax.cluster.template_command import add_parser as add_template

    add_template(jobs)
    from zaya_jax.bench.command import add_parser as add_bench

    add_bench(jobs)
    from zaya_jax.generation_command import add_parser as add_generate

    add_generate(jobs)
    from zaya_jax.eval_command import add_parser as add_eval

    add_eval(jobs)
    report = jobs.add_parser("report", help="a run's goodput: productive step time, time lost per cause, incidents",
                             description="Read WORKDIR/events.jsonl (every attempt of a run) and print its goodput.")
    report.add_argument("workdir", metavar="WORKDIR", help="the --workdir of a zaya train run")
    report.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return parser


TRAIN_EPILOG = """\
config overrides (absl / ml_collections config_flags style), any number of:
  --config.KEY=VALUE      e.g. --config.train.steps=100 --config.mesh.fsdp=8
                          --config.model.compute_dtype=bfloat16 --config.data.source=corpus.jsonl
                          --config.model.attention_kernel=pallas (also moe_kernel, norm_kernel:
                          auto | reference | xla | pallas; moe_kernel also cudnn on NVIDIA,
                          hipblaslt on ROCm: XLA's ragged_dot on the vendor's grouped GEMM)
  Keys: train.* eval.* checkpoint.* model.* (HF ZayaConfig names) mesh.* data.* optim.* distributed.* fault.*;
  see zaya_jax/experiment/schema.py for every key and its default.

layouts: mesh.data, mesh.fsdp, mesh.expert, mesh.tsp, mesh.tensor, mesh.sequence (1 = unused,
  one may be -1 = the devices left), e.g. --config.mesh.tsp=4 --config.mesh.data=2;
  ready-made ones in experiments/layouts/. Fake CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8

outputs in WORKDIR: metrics.jsonl (one JSON object per logged step), tensorboard/ (event files),
model/ (the trained model: zaya_jax.load or zaya convert to-hf), checkpoints/ (the full train state:
every checkpoint.every_steps, at the end and on SIGTERM/SIGINT; rerun the same command to resume).

several processes: zaya launch -n N [--cpu-devices K] -- train ..., srun (SLURM), or the flags above;
  process 0 writes the outputs, every process its checkpoint shards (docs/clusters.md).

faults: events.jsonl (zaya report WORKDIR: goodput), a hang watchdog, bad steps skipped and rolled back;
  exit status 0 done, 1 crashed, 2 bad input, 3 hung, 4 repeated bad steps, 143 saved on SIGTERM
  (docs/faults.md; zaya launch --max-restarts restarts on 1, 3 and signals)."""


def _add_train(jobs) -> None:
    train = jobs.add_parser(
        "train", help="train a ZAYA1 model from an experiment config",
        description="Train a ZAYA1 model from an experiment config on all devices of this process, or of the "
                    "job when it is one of several processes.",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", required=True, metavar="FILE", help="experiment file, e.g. experiments/tiny_cpu.py")
    train.add_argument("--workdir", required=True, metavar="DIR", help="where metrics, logs and checkpoints go")
    from zaya_jax.cluster.startup import add_flags

    add_flags(train)


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    """Config first (the runtime's timeouts are in it), then the host allocator and the runtime,
    then everything that asks for devices: validation resolves kernels against them."""
    import jax

    from zaya_jax import cpu_host
    from zaya_jax.cluster import startup
    from zaya_jax.experiment.load import load_values, unflatten
    from zaya_jax.experiment.validate import validate
    from zaya_jax.train.events import Attempt

    attempt = Attempt.from_environ(os.environ, _process_started_at())
    values, source = load_values(args.config, extra)
    cpu_host.prepare(values["train.cpu_devices"])  # before JAX's CPU client starts its threads
    topology = startup.start(startup.settings_from(
        args, initialization_timeout_s=values["distributed.initialization_timeout_s"],
        heartbeat_timeout_s=values["distributed.heartbeat_timeout_s"]))
    with raised_by_every_process():  # the same config on every process of a job
        exp = validate(unflatten(values), source=source)
    from zaya_jax.train.loop import train  # after the config: a refused one answers without it

    summary = train(exp, args.workdir, devices=topology.order(jax.devices()), topology=topology, attempt=attempt)
    return summary["exit_code"]  # stopped early: tell the supervisor how (zaya_jax/exit_codes.py)


def _report(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from zaya_jax.train import goodput
    from zaya_jax.train.events import read_log

    if extra:
        raise ZayaError(f"unrecognized arguments: {' '.join(extra)}")
    events, skipped = read_log(args.workdir)
    summary = goodput.summarize(events) | {"unreadable_lines": skipped}
    if args.json:
        print(json.dumps(summary))
        return 0
    state = "finished" if summary["finished"] else "not finished (running, stopped or failed)"
    print(f"zaya report: {os.path.abspath(args.workdir)}: {state}")
    if skipped:
        shown = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
        print(f"  warning: skipped {len(skipped)} unreadable line(s) of events.jsonl (line {shown}); the times "
              "below leave them out")
    for line in goodput.table(summary) + goodput.incidents(events):
        print(f"  {line}")
    return 0


def _mesh(args: argparse.Namespace, extra: list[str]) -> int:
    from zaya_jax.explore.command import mesh_command

    return mesh_command(args, extra)


def _bench(args: argparse.Namespace, extra: list[str]) -> int:
    from zaya_jax.bench.command import bench_command, host_command
    from zaya_jax.cluster import startup

    if args.benchmark == "host":
        return host_command(args, extra)

    topology = startup.start(startup.settings_from(args))  # under zaya launch / SLURM: every process measures
    return bench_command(args, extra, devices=None, topology=topology)


def _template(args: argparse.Namespace, extra: list[str]) -> int:
    from zaya_jax.cluster.template_command import template_command

    return template_command(args, extra)


def _launch(args: argparse.Namespace, extra: list[str]) -> int:
    from zaya_jax.cluster.launcher import launch

    return launch(args, extra, started_at=_process_started_at())


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    from zaya_jax.generation_command import generate_command

    return generate_command(args, extra)


def _eval(args: argparse.Namespace, extra: list[str]) -> int:
    from zaya_jax.eval_command import eval_command

    return eval_command(args, extra)


def _convert(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ZayaError(f"unrecognized arguments: {' '.join(extra)}")
    from zaya_jax.checkpoint import convert

    if args.direction == "from-hf":
        cfg = convert.from_hf(args.hf, args.out, progress=not args.quiet)
        print(f"wrote {args.out}: ZAYA model, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}")
    else:
        convert.to_hf(args.ckpt, args.out, args.dtype, args.max_shard_size, progress=not args.quiet)
        print(f"wrote {args.out} ({args.dtype}); load it with transformers.AutoModelForCausalLM.from_pretrained")
    return 0


# Each subcommand of build_parser(): (parsed args, arguments it did not know) -> exit status.
COMMANDS = {"train": _train, "report": _report, "launch": _launch, "mesh": _mesh, "bench": _bench,
            "template": _template, "convert": _convert, "generate": _generate,
            "eval": _eval}


STARTS_JAX = ("train", "mesh", "bench", "convert", "generate", "eval")  # `launch`'s children check for themselves


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    from zaya_jax import cpu_host
    from zaya_jax.checkpoint.background_noise import quiet_background_failures
    from zaya_jax.jax_environment import backend_failure, check_xla_flags

    quiet_background_failures()  # an error is said once, in words: not again by Orbax's threads
    try:
        if args.command in STARTS_JAX:
            check_xla_flags()  # XLA aborts the process on a flag it does not know
            cpu_host.threads_for_flagged_devices()  # before JAX's CPU client sizes its thread pool
        return COMMANDS[args.command](args, extra)
    except ZayaError as e:
        print(f"zaya: error: {e}", file=sys.stderr)
        return _failed(e.exit_code, together=e.every_process)
    except KeyboardInterrupt:
        print("zaya: interrupted; no partial output was kept", file=sys.stderr)
        return _failed(130)
    except BaseException as e:
        if message := backend_failure(e):  # a start-up setting, said in words
            print(f"zaya: error: {message}", file=sys.stderr)
            return _failed(2)
        if _one_of_several():
            import traceback

            traceback.print_exc()
            _failed(1)
        raise


def entry() -> None:
    """The `zaya` command. After `zaya train` (or `zaya launch`, its children gone) has written everything (checkpoints closed, metrics
    and events flushed), the process leaves without the interpreter's teardown of JAX, Orbax and
    TensorBoard (about a second, nothing left to save; in a job, after JAX's shutdown barrier), so
    the run's event log accounts for its whole life."""
    code = main()
    if sys.argv[1:2] in (["train"], ["launch"]):
        if _one_of_several():
            import jax

            jax.distributed.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _one_of_several() -> bool:
    from zaya_jax.jax_compat import in_distributed_run

    return in_distributed_run()


def _failed(code: int, together: bool = False) -> int:
    """A failed process of a multi-process job leaves at once: JAX's exit handler would wait for
    every other process at its shutdown barrier, and they may be waiting for this one. An error
    every process raised (`together`) goes through that barrier instead: process 0 hosts the
    coordinator, and a peer still polling it when it vanishes dies in a C++ abort."""
    if _one_of_several():
        if together:
            import jax

            jax.distributed.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    entry()
