"""`zaya template`: print (or write) a rendered cluster job file for ZAYA1-base."""

from __future__ import annotations

import argparse

from zaya_jax.errors import ZayaError

EPILOG = """\
examples:
  zaya template slurm > job.sbatch && sbatch job.sbatch
  zaya template k8s --image=registry.example.com/zaya-jax:rocm > jobset.yaml && kubectl apply -f jobset.yaml
  zaya template slurm --nodes=2 --set partition=gpu --set time=02:00:00

--set NAME=VALUE sets any other value of the template: slurm takes partition, account, time,
cpus_per_task, grace_s (SIGTERM this many seconds before the time limit), port, job_name;
k8s takes gpu_resource (amd.com/gpu | nvidia.com/gpu), shared_claim, shared_mount, grace_s,
port, job_name. The defaults are in zaya_jax/cluster/templates.py; comments in the file say what
else to edit (the environment, the data paths)."""

_FLAGS = ("nodes", "gpus_per_node", "config", "workdir", "image")  # each sets the template value of its name


def add_parser(jobs) -> None:
    p = jobs.add_parser(
        "template", help="print a cluster job file: a SLURM batch script or a Kubernetes JobSet",
        description="Print a SLURM batch script (slurm) or a Kubernetes JobSet manifest (k8s) that trains "
                    "ZAYA1-base on NODES x GPUS devices, the ZAYA1 layout (128 x 8) by default.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # A plain positional, not `choices`: a wrong kind is then one line (ZayaError), not argparse's usage.
    p.add_argument("kind", metavar="{slurm,k8s}", help="slurm: an sbatch script; k8s: a JobSet manifest")
    p.add_argument("--nodes", type=int, metavar="N", help="nodes (default 128)")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs per node, one process each (default 8)")
    p.add_argument("--config", metavar="FILE", help="experiment file (default experiments/zaya1_base_phase1.py)")
    p.add_argument("--workdir", metavar="DIR", help="run directory on a filesystem every node shares")
    p.add_argument("--image", metavar="IMAGE", help="k8s: container image with zaya-jax installed")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="any other template value")
    p.add_argument("--out", metavar="FILE", help="write here instead of printing")


def _values(args) -> dict:
    values = {name: getattr(args, name) for name in _FLAGS if getattr(args, name) is not None}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise ZayaError(f"--set takes NAME=VALUE, got {item!r}")
        values[name.strip()] = value
    return values


def template_command(args, extra: list[str]) -> int:
    if extra:
        raise ZayaError(f"unrecognized arguments: {' '.join(extra)}")
    from zaya_jax.cluster.templates import render

    text = render(args.kind, **_values(args))
    if not args.out:
        print(text, end="")
        return 0
    try:
        with open(args.out, "w") as f:
            f.write(text)
    except OSError as e:
        raise ZayaError(f"cannot write {args.out}: {e.strerror}") from None
    submit = "sbatch" if args.kind == "slurm" else "kubectl apply -f"
    print(f"wrote {args.out}; edit what its comments name, then: {submit} {args.out}")
    return 0
