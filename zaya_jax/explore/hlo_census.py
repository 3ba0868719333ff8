"""What a compiled XLA program runs per call: its collectives, each counted as often as it runs.

An op inside a `while` body runs once per iteration, and loops nest (the micro-batch scan holds
the layer scan, which holds the loss's vocabulary chunks), so a count of op names in the text
says little. `census(hlo_text, mesh_shape)` walks the call graph from the entry computation,
multiplies by every loop's known trip count on the way down, and gives each collective its
result bytes, how many times it runs, and the mesh axes its replica groups span (for an SPMD
program the ids in a group are positions in the mesh's device grid). Tests and benchmarks use it
to count, for example, the gradient reductions over `data` in one train step.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
_CALLEES = re.compile(r"(condition|body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # one of COLLECTIVES
    bytes: int  # of its result (a tuple's arrays summed)
    runs: int  # times it runs per call of the program
    axes: tuple[str, ...]  # mesh axes its groups span (empty: unknown or one device)
    computation: str


def census(hlo: str, mesh_shape: dict[str, int] | None = None) -> list[Collective]:
    """Every collective of a compiled program's HLO text; `mesh_shape` ({axis: size}, in mesh
    order) names the axes of their replica groups."""
    bodies, entry = computations(hlo)
    runs = _runs(bodies, entry)
    out = []
    for name, lines in bodies.items():
        for line in lines:
            match = _OP.match(line)
            if match and runs.get(name):
                shapes, op = match.group(1), match.group(2)
                out.append(Collective(op, _result_bytes(shapes, op, bool(match.group(3))), runs[name],
                                      _group_axes(line, mesh_shape), name))
    return out


def total(collectives: list[Collective], op: str, axis: str | None = None) -> tuple[int, int]:
    """(runs, bytes moved by those runs) of `op`, only those spanning `axis` if given."""
    chosen = [c for c in collectives if c.op == op and (axis is None or axis in c.axes)]
    return sum(c.runs for c in chosen), sum(c.runs * c.bytes for c in chosen)


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """({computation: its instruction lines}, the entry computation's name) of HLO text."""
    bodies: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            bodies[current] = []
            entry = current if header.group(1) else entry
        elif current is not None:
            bodies[current].append(line)
    return bodies, entry


def _runs(bodies: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per call of `entry` (loop bodies times their trips)."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in bodies.items():
        for line in lines:
            trips = _TRIPS.search(line)
            looped = int(trips.group(1)) if trips and " while(" in line else 1
            for key, callee in _CALLEES.findall(line):
                calls[name].append((callee, looped if key in ("body", "condition") else 1))
            for branches in _BRANCHES.findall(line):
                calls[name] += [(b.strip().lstrip("%"), 1) for b in branches.split(",") if b.strip()]
    runs: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64:  # a compiled program's call graph is a shallow DAG; this bounds a malformed one
            return
        runs[name] += times
        for callee, factor in calls.get(name, ()):
            visit(callee, times * factor, depth + 1)

    visit(entry, 1)
    return dict(runs)


def array_bytes(shapes: str) -> list[int]:
    """The bytes of each array shape written in `shapes` (`f32[4,8]`, a tuple's one by one)."""
    return [_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(shapes)]


def _result_bytes(shapes: str, op: str, started: bool) -> int:
    arrays = array_bytes(shapes)
    if started and op == "all-gather" and len(arrays) >= 2:  # (operand, result): count the result
        arrays = arrays[len(arrays) // 2:]
    return sum(arrays)


def _group_axes(line: str, mesh_shape: dict[str, int] | None) -> tuple[str, ...]:
    if not mesh_shape:
        return ()
    group = _first_group(line)
    if group is None or len(group) < 2:
        return ()
    coords = np.array(np.unravel_index(np.asarray(group), tuple(mesh_shape.values()))).T
    varying = (coords != coords[0]).any(axis=0)
    return tuple(axis for axis, moves in zip(mesh_shape, varying) if moves)


def _first_group(line: str) -> list[int] | None:
    """The first replica group, from either `{{0,1},{2,3}}` or the iota form `[2,2]<=[4]` (or
    `[2,2]<=[2,2]T(1,0)`); collective-permute's source-target pairs count as groups of two."""
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line) or re.search(r"source_target_pairs=\{\{([\d,]*)\}", line)
    if listed:
        return [int(x) for x in listed.group(1).split(",") if x]
    named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if named:  # Shardy's form: a device grid of named axes, and the axes one group spans
        sizes = {k: int(v) for k, v in re.findall(r"'([\w]+)'=(\d+)", named.group(1))}
        spanned = set(re.findall(r"'([\w]+)'", named.group(2)))
        ids = np.arange(math.prod(sizes.values())).reshape(tuple(sizes.values()))
        return ids[tuple(slice(None) if k in spanned else 0 for k in sizes)].reshape(-1).tolist()
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if not iota:
        return None
    groups = [int(x) for x in iota.group(1).split(",")]
    ids = np.arange(math.prod(int(x) for x in iota.group(2).split(","))).reshape(
        [int(x) for x in iota.group(2).split(",")])
    if iota.group(3):
        ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
    return ids.reshape(groups[0], -1)[0].tolist()
