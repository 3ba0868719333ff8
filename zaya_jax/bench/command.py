"""`zaya bench collectives` and `zaya bench host`: parse the flags, measure, print, write the records.

`collectives` lays the mesh on the real devices and times each collective per axis; `host` times a
matmul and a memory stream on one device (`bench/host.py`).

Every flag is checked before anything is compiled, on every process (they all hold the same
arguments, so they all fail alike); only the output folder can differ between hosts, so process 0
checks it and tells the others. Every process runs the collectives; process 0 prints and writes.
"""

from __future__ import annotations

import argparse
import os
import re

from zaya_jax.cpu_host import DEVICE_COUNT_FLAG
from zaya_jax.errors import ZayaError
from zaya_jax.explore.collectives import OPS
from zaya_jax.parallel.axes import MESH_AXES
from zaya_jax.sizes import parse_size

KIB, MIB, GIB = 1024, 1024**2, 1024**3
CPU_SIZES = [4 * KIB, 64 * KIB, MIB]  # fake CPU devices only check the tool: keep it to seconds
ACCEL_SIZES = [64 * KIB * 4**k for k in range(8)]  # 64KiB .. 1GiB, where busbw levels off on GPUs
EPILOG = """\
examples:
  zaya bench collectives --out=collectives.json      # default mesh: fsdp = each node's devices, data = nodes
  zaya mesh --config=experiments/zaya1_base_phase1.py --hardware=mi300x --nodes=128 --collectives=collectives.json
  zaya bench collectives --mesh=tensor=2,fsdp=-1 --mesh=tensor=4,fsdp=-1 --ops=all_gather,permute --out=c.json
                                                     # on one node: groups of 2 and 4 (the default: 8)

In a multi-process job every process runs it (the collectives need them all); process 0 prints and writes.
The records are what `zaya mesh --collectives` reads, one per axis of size > 1, op and size:
  {"tier": "intra"|"inter", "op": ..., "group": N, "bytes": S, "busbw_gb_per_s": ..., "axis": ..., "time_us": ...}
S is the gathered / reduced array (permute: the bytes each device sends), rounded to float32 elements
divisible by the group; busbw as nccl-tests / rccl-tests report it. tier is "intra" when every group
of the axis is inside one node, else "inter". The default mesh measures the node's links with groups
of all its devices and the network with one device per node, the shapes the explorer looks up;
repeat --mesh to add other group sizes to the same file."""


def add_parser(jobs) -> None:
    bench = jobs.add_parser("bench", help="microbenchmarks of this machine: collectives over the mesh axes, "
                                          "matmul and memory rates",
                            description="Microbenchmarks of the machine a run trains on.")
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    p = kinds.add_parser(
        "collectives", help="time all-gather, reduce-scatter, all-reduce, all-to-all and permute per mesh axis",
        description="Time all-gather, reduce-scatter, all-reduce, all-to-all and a ring permute over each mesh axis "
                    "of size > 1, across message sizes, and write bus bandwidths for `zaya mesh --collectives`.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="FILE", help="JSON list of records (written atomically)")
    p.add_argument("--mesh", action="append", metavar="AXIS=N,...",
                   help=f"axis sizes, e.g. data=2,fsdp=4; axes {', '.join(MESH_AXES)}; unnamed = 1, one may be -1 "
                        "(the devices left); may be repeated (default: fsdp = devices per node, data = nodes)")
    p.add_argument("--sizes", metavar="LIST",
                   help="message sizes S, e.g. 1KiB,64KiB,1MiB,16MiB (units B, KB, MB, GB, KiB, MiB, GiB; "
                        "default 64KiB..1GiB x4 on GPUs, 4KiB,64KiB,1MiB on CPU)")
    p.add_argument("--ops", default="all", metavar="LIST", help=f"comma-separated, from {', '.join(OPS)} (default all)")
    p.add_argument("--iters", type=int, default=20, metavar="N",
                   help="timed calls per op and size; the median is kept (default 20)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed calls first (default 2)")
    h = kinds.add_parser("host", help="this machine's matmul TFLOP/s and memory GB/s (for zaya mesh --host)",
                         description="Time square matmuls (float32 and bfloat16, 64 to 2048 wide), an elementwise "
                                     "kernel and a streaming pass per device, every device at once, and write them "
                                     "for `zaya mesh --host`.")
    h.add_argument("--out", required=True, metavar="FILE", help="JSON object (written atomically)")
    h.add_argument("--iters", type=int, default=5, metavar="N", help="timed calls per measurement (default 5)")
    h.add_argument("--cpu-devices", type=int, default=0, metavar="N",
                   help="on a CPU, the XLA devices the cores are split into, as the run's train.cpu_devices "
                        "(default 0: one per core; a device count in XLA_FLAGS wins, as over train.cpu_devices); "
                        "each device's rates are measured while all of them run")


def host_command(args, extra: list[str]) -> int:
    if extra:
        raise ZayaError(f"unrecognized arguments: {' '.join(extra)}")
    if args.iters < 1:
        raise ZayaError(f"--iters must be at least 1, got {args.iters}")
    if args.cpu_devices < 0:
        raise ZayaError(f"--cpu-devices must be 0 (one per core) or more, got {args.cpu_devices}")
    problem = out_problem(args.out)
    if problem:
        raise ZayaError(problem)
    import json
    import os

    from zaya_jax import cpu_host

    cpu_host.prepare(args.cpu_devices or os.cpu_count() or 1)  # before JAX starts
    import jax

    from zaya_jax.bench.host import measure
    from zaya_jax.explore.report import write_atomic

    record = measure(jax.local_devices(), args.iters)
    rates = ", ".join(f"{dtype} {v:.3g}" for dtype, v in record["matmul_tflops"].items())
    print(f"{record['device_kind']} ({record['platform']}, {record['devices']} devices at once): matmul TFLOP/s "
          f"{rates} per device; elementwise {record['elementwise_gb_per_s']:.3g} GB/s, memory "
          f"{record['memory_gb_per_s']:.3g} GB/s")
    write_atomic(args.out, lambda f: f.write(json.dumps(record, indent=1) + "\n"))
    print(f"wrote {args.out}; use it with zaya mesh --host={args.out}")
    return 0


def parse_ops(text: str) -> tuple[str, ...]:
    ops: list[str] = []
    for op in (t.strip() for t in text.split(",")):
        if op == "all":
            ops += OPS
        elif op in OPS:
            ops.append(op)
        else:
            raise ZayaError(f"--ops: unknown collective {op!r}; choose from {', '.join(OPS)} (comma-separated) or all")
    return tuple(dict.fromkeys(ops))


def parse_sizes(text: str) -> list[int]:
    sizes = set()
    for item in text.split(","):
        value = parse_size(item)
        if value is None:
            raise ZayaError(f"--sizes: {item.strip()!r} is not a positive size like 4KiB, 1MiB, 64MB or 4096 (bytes); "
                            "separate sizes with commas")
        sizes.add(value)
    return sorted(sizes)


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,fsdp=-1' → all six axes (unnamed = 1); resolve_axis_sizes fills the -1 later."""
    requested = dict.fromkeys(MESH_AXES, 1)
    named = set()
    for part in (p.strip() for p in text.split(",")):
        axis, eq, value = (s.strip() for s in part.partition("="))
        if not eq or axis not in MESH_AXES:
            raise ZayaError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}; "
                            "write e.g. --mesh data=2,fsdp=4")
        if axis in named:
            raise ZayaError(f"--mesh {text!r} names {axis} twice; give each axis once")
        if not re.fullmatch(r"-?\d+", value) or (int(value) < 1 and int(value) != -1):
            raise ZayaError(f"--mesh {text!r}: {axis}={value} is not a size; use a positive count or -1 (the devices left)")
        named.add(axis)
        requested[axis] = int(value)
    if list(requested.values()).count(-1) > 1:
        raise ZayaError(f"--mesh {text!r} has more than one -1; only one axis can take the devices left")
    return requested


def default_mesh(nodes: int, per_node: int) -> dict[str, int]:
    """One axis inside each node, one across the nodes: the explorer's intra and inter lookups."""
    return {**dict.fromkeys(MESH_AXES, 1), "fsdp": per_node, "data": nodes}


def _check_counts(args) -> None:
    if args.iters < 1:
        raise ZayaError(f"--iters must be at least 1, got {args.iters}")
    if args.warmup < 0:
        raise ZayaError(f"--warmup must be 0 or more, got {args.warmup}")


def out_problem(path: str) -> str | None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--out {path} is a folder; name a file, e.g. {os.path.join(path, 'collectives.json')}"
    if not os.path.isdir(folder):
        return f"cannot write {path}: folder {folder} does not exist; create it or choose another --out"
    if not os.access(folder, os.W_OK):
        return f"cannot write {path}: folder {folder} is not writable; choose another --out"
    return None


def _agree_out_writable(path: str, lead: bool) -> None:
    """Process 0 checks --out before the work; the others learn its answer rather than wait on it."""
    import jax
    import numpy as np

    problem = out_problem(path) if lead else None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if multihost_utils.broadcast_one_to_all(np.int32(problem is not None)) and problem is None:
            problem = f"process 0 cannot write --out {path} (see its error); choose another --out"
    if problem:
        raise ZayaError(problem)


def human(nbytes: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


COLUMNS = (("op", 14), ("axis", 8), ("group", 5), ("tier", 5), ("bytes", 9), ("time us", 10), ("busbw GB/s", 10))


def table_line(cells) -> str:
    return "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS)))


def row(r: dict) -> str:
    return table_line([r["op"], r["axis"], r["group"], r["tier"], human(r["bytes"]), f"{r['time_us']:.1f}",
                       f"{r['busbw_gb_per_s']:.3g}"])


def bench_command(args, extra: list[str], devices=None, topology=None) -> int:
    """`devices` default to jax.devices(), `topology` to every process on one node."""
    if extra:
        raise ZayaError(f"unrecognized arguments: {' '.join(extra)}")
    ops, requested = parse_ops(args.ops), [parse_mesh(t) for t in args.mesh or []]
    sizes = parse_sizes(args.sizes) if args.sizes is not None else None
    _check_counts(args)
    import jax

    from zaya_jax.bench.collectives import measure
    from zaya_jax.explore.placement import describe
    from zaya_jax.parallel.mesh import build_mesh, resolve_axis_sizes
    from zaya_jax.parallel.topology import Topology

    topology = topology or Topology.one_node(jax.process_count())
    devices = topology.order(devices if devices is not None else jax.devices())
    per_node = topology.devices_per_node(devices)
    nodes = len(devices) // per_node
    layouts = [resolve_axis_sizes(r, len(devices)) for r in requested or [default_mesh(nodes, per_node)]]
    for layout in layouts:
        if max(layout.values()) == 1:
            raise ZayaError(f"nothing to measure: every mesh axis is 1 on this run's {len(devices)} device(s); "
                            f"collectives need 2 or more (on CPU: XLA_FLAGS={DEVICE_COUNT_FLAG}=8)")
    platform = devices[0].platform
    sizes = sizes or (CPU_SIZES if platform == "cpu" else ACCEL_SIZES)
    lead = jax.process_index() == 0
    _agree_out_writable(args.out, lead)
    records = []
    for layout in layouts:
        if lead:
            print(f"collectives over {describe(layout)} on {len(devices)} {platform} devices ({nodes} node(s) x "
                  f"{per_node}), float32, median of {args.iters} calls after {args.warmup} warm-up"
                  + (" [CPU devices: this checks the tool, not a network]" if platform == "cpu" else ""))
            print(table_line([name for name, _ in COLUMNS]), flush=True)
        for r in measure(build_mesh(layout, devices), topology.node_of, ops, sizes, args.iters, args.warmup):
            records.append(r)
            if lead:
                print(row(r), flush=True)
    if lead:
        from zaya_jax.explore.report import write_json_lines

        write_json_lines(args.out, records)
        print(f"wrote {args.out} ({len(records)} records); use it with zaya mesh --collectives={args.out}")
    return 0
