"""XLA's memory at a compiled step's peak, attributed to the explorer's memory terms.

Compiled with XLA's dump on (`dumping`), a step leaves its optimized HLO (every instruction's shape, opcode and
the JAX op name of the code that made it), its values' live ranges over the schedule and the
buffer assignment (where each value lies). The peak is the point of the schedule with the most
bytes in place (`peak_buffers`: every assigned value, a loop's carried values included, aliases
counted once). Each buffer live there goes to one term, by what made it (`term_of`, first match):

  parameters, optimizer, inputs  the step's arguments, by their names (`state.params[...]`, ...)
  gradients           made by the backward (`transpose(...)` in its op name) with the shape of a
                      parameter's shard (whole, or one layer's), or the micro-batch loop's running
                      sum (`train/step.py`'s `gradient_sum` scope), carried between micro-batches
  loss                made under the loss's scope (its backward's too: `transpose(jvp(loss))`)
  schedule            a collective's result: gathered weights, K/V or states, routed tokens
  update              made outside the differentiated step: the optimizer and balancer update
  stored_activations  made by the forward (`jvp(...)`): what the backward will read
  block_working_set   made by the backward: one block's gradients of its activations
  kernel              made inside a kernel's CPU-only form or its derivative (`CPU_ONLY_SCOPES`:
                      XLA:CPU's masked [experts, rows, K] copies in `ragged_dot`, flattened to
                      [rows, experts·K] or not, the `tiled` grouped matmul's per-tile copies of rows
                      and weights); no GPU kernel has them. The backward's per-expert weight
                      products there are gradients
  xla_copies          copies XLA added between loop buffers, with no source op
and `fragmentation`: what XLA reserves beyond the bytes live at the peak (how the temporaries
pack). The terms sum to XLA's argument + temporary + output − aliased bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import tempfile

import jax

from zaya_jax.errors import ZayaError
from zaya_jax.train.step import GRADIENT_SUM_SCOPE

TERMS = ("parameters", "gradients", "optimizer", "inputs", "stored_activations", "block_working_set", "loss",
         "schedule", "update", "kernel", "xla_copies", "fragmentation")
PHASES = ("forward", "loss", "backward", "update")  # the step's phases in their order (`phase_of`)
CPU_ONLY_TERMS = ("kernel",)  # a GPU backend holds every other term too
# Grouped-matmul backends whose CPU form holds buffers no GPU kernel has (`kernels/ops.py` names
# the scopes): XLA's CPU expansion of ragged_dot ([G, M, K] masked copies), the tiled form's tiles.
CPU_ONLY_SCOPES = ("grouped_matmul_xla", "grouped_matmul_tiled")
# ragged_dot's CPU expansion masks its operand per expert, [experts, rows, K] or flattened to
# [rows, experts·K], by a select (and its mask's `and`) made in the kernel's own scope; the
# `jnp.where` that zeroes the product's rows past the groups is the product, an activation.
_RAGGED_MASK = re.compile(r"grouped_matmul_xla\)*/(select_n|and)$")
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter",
               "all-gather-start", "all-gather-done", "collective-permute-start", "collective-permute-done",
               "all-reduce-start", "all-reduce-done")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([\w-]+)\(")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_COPIED = re.compile(r" copy\(%([^)\s,]+)\)")
_RANGE = re.compile(r"^\s+(\S+?\{[^}]*\}):(\d+)-(\d+)$")
_ALLOCATION = re.compile(r"^allocation (\d+):")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+?)(\{[^}]*\})?( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")


@dataclasses.dataclass(frozen=True)
class Buffer:
    name: str
    bytes: int
    shape: str  # as the HLO writes it, layout dropped: f32[4,4,128,128]
    opcode: str
    op_name: str  # "" when XLA made it with no source op


@contextlib.contextmanager
def dumping(keep: str | None = None):
    """(XLA compiler options that dump the step's reports into a temporary folder, or into `keep`,
    which is left in place; a function reading the buffers live at the peak from it). The
    persistent compilation cache is off meanwhile: a step it served would be compiled by no one,
    and dump nothing."""
    previous = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="zaya_xla_") as folder:
            yield {"xla_dump_to": folder, "xla_dump_hlo_as_text": True}, lambda: peak_buffers(*dump_files(folder))
    finally:
        jax.config.update("jax_enable_compilation_cache", previous)


def total_bytes(compiled) -> int:
    """Per device: XLA's argument + temporary + output − aliased bytes."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


def dump_files(folder: str) -> tuple[str, str, str]:
    """(live ranges, optimized HLO, buffer assignment) of the step itself: the largest module."""
    ranges = sorted(glob.glob(os.path.join(folder, "*after_optimizations-live-range.txt")), key=os.path.getsize)
    if not ranges:
        raise ZayaError("XLA wrote no buffer live ranges for this step (was it loaded from the compilation "
                        "cache?); run without a compilation cache to attribute its memory")
    live = ranges[-1]
    return live, live.replace("-live-range.txt", ".txt"), live.replace("-live-range.txt", "-buffer-assignment.txt")


@dataclasses.dataclass(frozen=True)
class _Value:
    key: tuple[int, int]  # (allocation, offset): values there at the same time are one buffer's aliases
    size: int
    phi: bool  # a loop's carried value: named for the loop, made by whatever flows into it


def peak_buffers(live_range_path: str, hlo_path: str, assignment_path: str) -> list[Buffer]:
    """The buffers live at the step's peak, each with its instruction's shape, opcode and op name.

    The peak is found over every value XLA assigned (the loops' carried values included, which
    XLA's own peak listing leaves out), a buffer's aliases counted once: at each point of the
    schedule, the bytes of the distinct (allocation, offset) places holding a live value."""
    schedule = _Schedule.read(live_range_path, hlo_path, assignment_path)
    live = schedule.live_bytes()
    return schedule.buffers_at(max(range(len(live)), key=lambda t: (live[t], -t)))


def phase_peaks(live_range_path: str, hlo_path: str, assignment_path: str) -> dict[str, list[Buffer]]:
    """For each of the step's phases (`PHASES`), the buffers live at the point of its span of the
    schedule (`_Schedule.phases`) with the most bytes live, counted as `peak_buffers` counts the
    step's: what the explorer's price of each phase (`memory.phases`) is held against. The step's
    peak is the largest of them."""
    schedule = _Schedule.read(live_range_path, hlo_path, assignment_path)
    live, phase_at = schedule.live_bytes(), schedule.phases()
    best: dict[str, int] = {}
    for t, phase in enumerate(phase_at):
        if phase not in best or live[t] > live[best[phase]]:
            best[phase] = t
    return {phase: schedule.buffers_at(best[phase]) for phase in PHASES if phase in best}


def phase_of(op_name: str) -> str | None:
    """The phase of the step an instruction runs in, by its JAX op name: the loss (its forward and
    its backward rule, `transpose(jvp(loss))`), the blocks' backward (a derivative's transpose, and
    the micro-batch loop's gradient sum), the forward (`jvp`), else the update; None for what
    carries no op of its own (XLA's copies, the step's arguments)."""
    if not op_name or op_name.startswith(("state.", "batches")):
        return None
    scopes = _scopes(op_name)
    if "loss" in scopes:
        return "loss"
    if "transpose(" in op_name or GRADIENT_SUM_SCOPE in scopes:
        return "backward"
    return "forward" if "jvp(" in op_name else "update"


@dataclasses.dataclass
class _Schedule:
    """A compiled step's values over XLA's sequential schedule: where each lies, when it is live."""

    values: dict[str, "_Value"]
    ranges: dict[str, tuple[int, int]]
    made_by: callable  # value name → its maker's (shape, opcode, op name) (`_makers`)
    op_names: dict[str, str]  # each instruction's own op name (a copy's not taken from its source)

    @classmethod
    def read(cls, live_range_path: str, hlo_path: str, assignment_path: str) -> "_Schedule":
        values = _assigned_values(assignment_path)
        ranges = {name: span for name, span in _live_ranges(live_range_path).items() if name in values}
        if not ranges:
            raise ZayaError(f"{live_range_path} and {assignment_path} share no buffers; this XLA writes another format")
        instructions, op_names = _instructions(hlo_path)
        return cls(values, ranges, _makers(values, instructions), op_names)

    @property
    def length(self) -> int:
        """The points of the schedule: 0 .. the last point any value is live at."""
        return max(end for _, end in self.ranges.values()) + 1

    def live_bytes(self) -> list[int]:
        """Bytes live at each point of the schedule, each place counted once at its largest value."""
        events = sorted([(start, 1, name) for name, (start, _) in self.ranges.items()]
                        + [(stop + 1, 0, name) for name, (_, stop) in self.ranges.items()])
        at_place: dict[tuple[int, int], list[int]] = {}
        out, live, i = [0] * self.length, 0, 0
        for t in range(self.length):
            while i < len(events) and events[i][0] == t:
                _, starts, name = events[i]
                value = self.values[name]
                sizes = at_place.setdefault(value.key, [])
                before = max(sizes, default=0)
                if starts:
                    sizes.append(value.size)
                else:
                    sizes.remove(value.size)
                live += max(sizes, default=0) - before
                i += 1
            out[t] = live
        return out

    def phases(self) -> list[str]:
        """The phase of each point of the schedule. XLA interleaves instructions of neighbouring
        phases (it makes the loss's and the backward's zeroed buffers early, its layout copies
        late), so the phases are spans between boundaries: the loss from its first matmul to its
        last (the logits of a chunk, forward and backward, and their gradients), the forward before
        it, the backward after it up to the last instruction of the backward (`phase_of`), the
        update after that."""
        matmuls, backward = [], []
        for name, (start, _) in self.ranges.items():
            op_name = self.op_names.get(name.split("{")[0], "")
            phase = phase_of(op_name)
            if phase == "loss" and op_name.endswith("dot_general"):
                matmuls.append(start)
            elif phase == "backward":
                backward.append(start)
        if not matmuls:
            raise ZayaError("no matmul of the step runs under the loss's scope; its phases cannot be told apart")
        first, last = min(matmuls), max(matmuls)
        last_backward = max([t for t in backward if t > last], default=last)
        return ["forward" if t < first else "loss" if t <= last else "backward" if t <= last_backward else "update"
                for t in range(self.length)]

    def buffers_at(self, time: int) -> list[Buffer]:
        live: dict[tuple[int, int], str] = {}
        for name, (start, end) in self.ranges.items():
            if start <= time <= end:
                place = self.values[name].key
                if place not in live or self.values[name].size > self.values[live[place]].size:
                    live[place] = name
        return [Buffer(name.split("{")[0], self.values[name].size, *self.made_by(name)) for name in live.values()]


def _assigned_values(assignment_path: str) -> dict[str, _Value]:
    """name{shape index} → where XLA put it, from the buffer assignment."""
    out, allocation = {}, -1
    with open(assignment_path, encoding="utf-8") as f:
        for line in f:
            head = _ALLOCATION.match(line)
            if head:
                allocation = int(head.group(1))
                continue
            value = _VALUE.match(line)
            if value:
                name, index, phi, size, offset = value.groups()
                out[name + (index or "{}")] = _Value((allocation, int(offset)), int(size), bool(phi))
    return out


def _live_ranges(live_range_path: str) -> dict[str, tuple[int, int]]:
    out, inside = {}, False
    with open(live_range_path, encoding="utf-8") as f:
        for line in f:
            if "BufferLiveRange:" in line:
                inside = True
            elif inside:
                span = _RANGE.match(line)
                if not span:
                    break
                out[span.group(1)] = (int(span.group(2)), int(span.group(3)))
    return out


def _makers(values: dict[str, _Value], instructions: dict) -> callable:
    """value name → (shape, opcode, op name) of the instruction that made it; a loop's carried
    value takes them from a value XLA placed with it that an instruction made."""
    by_place = {}
    for name, value in values.items():
        info = instructions.get(name.split("{")[0])
        if not value.phi and info and info[2]:
            by_place.setdefault((value.key, value.size), info)

    def made_by(name: str) -> tuple[str, str, str]:
        info = instructions.get(name.split("{")[0], ("", "", ""))
        value = values[name]
        return by_place.get((value.key, value.size), info) if value.phi else info

    return made_by


def _instructions(hlo_path: str) -> tuple[dict[str, tuple[str, str, str]], dict[str, str]]:
    """(name → (shape, opcode, op name), name → the instruction's own op name). In the first a copy
    XLA added without a source op takes its operand's op name (the step's arguments are copied so:
    their copy is theirs); in the second it has none ("")."""
    out, copied = {}, {}
    with open(hlo_path, encoding="utf-8") as f:
        for line in f:
            match = _INSTRUCTION.match(line)
            if match:
                name, shape, opcode = match.groups()
                op_name = _OP_NAME.search(line)
                out[name] = (re.sub(r"\{[^}]*\}", "", shape), opcode, op_name.group(1).replace("\\'", "'") if op_name else "")
                source = _COPIED.search(line) if opcode == "copy" and not op_name else None
                if source:
                    copied[name] = source.group(1)
    own = {name: info[2] for name, info in out.items()}
    for name, source in copied.items():
        seen = {name}
        while source in copied and source not in seen:
            seen.add(source)
            source = copied[source]
        if source in out:
            out[name] = out[name][:2] + (out[source][2],)
    return out, own


def attribute(buffers: list[Buffer], total_bytes: int) -> dict[str, int]:
    """{term: bytes} over `TERMS`; `fragmentation` is `total_bytes` less the bytes live at the peak."""
    param_shapes = _param_shapes(buffers)
    out = dict.fromkeys(TERMS, 0)
    for buffer in buffers:
        out[term_of(buffer, param_shapes)] += buffer.bytes
    out["fragmentation"] = total_bytes - sum(b.bytes for b in buffers)
    return out


def _rank(shape: str) -> int:
    dims = re.match(r"\w+\[([^\]]*)\]$", shape)
    return len(dims.group(1).split(",")) if dims and dims.group(1) else 0


def _param_shapes(buffers: list[Buffer]) -> set[str]:
    """A parameter shard's shape (as a parameter, or as its optimizer state: ZeRO-1's shard of
    the gradient), one layer's of a stacked parameter ([L, ...] → [...]), and for the experts'
    gate and up one layer's of the two fused ([E, H, 2I]: the grouped matmul's weight gradient)."""
    shapes = set()
    for b in buffers:
        if b.op_name.startswith("state.params") or (b.op_name.startswith("state.opt_state") and "['" in b.op_name):
            shapes.add(b.shape)
            dims = re.match(r"(\w+)\[(\d+),(.*)\]", b.shape)
            if dims and "['layers/" in b.op_name:
                layer = f"{dims.group(1)}[{dims.group(3)}]"
                shapes.add(layer)
                if re.search(r"experts/(gate|up)'\]", b.op_name):
                    head, last = layer.rsplit(",", 1)
                    shapes.add(f"{head},{2 * int(last.rstrip(']'))}]")
    return shapes


def _cpu_only_scope(op_name: str) -> bool:
    """Made inside a CPU-only kernel form: its scope, or its derivative's (`jvp(grouped_matmul_xla)/`,
    `transpose(jvp(grouped_matmul_xla))/`)."""
    return any(re.search(re.escape(scope) + r"\)*/", op_name) for scope in CPU_ONLY_SCOPES)


def _scopes(op_name: str) -> list[str]:
    """The named scopes of an op name, each stripped of the transformations around it: a custom
    rule's own scope under its caller's derivative (`transpose(jvp(loss))`) is `loss`."""
    return [re.sub(r"^(?:\w+\()*([^()]*)\)*$", r"\1", part) for part in op_name.split("/")]


def term_of(b: Buffer, param_shapes: set[str]) -> str:
    name = b.op_name
    if name.startswith("state.params"):
        return "parameters"
    if name.startswith("state."):
        return "optimizer"
    if name.startswith("batches"):
        return "inputs"
    backward = "transpose(" in name
    if (b.shape in param_shapes and (backward or not name)) or GRADIENT_SUM_SCOPE in _scopes(name):
        return "gradients"
    if _cpu_only_scope(name) and (_rank(b.shape) >= 3 or _RAGGED_MASK.search(name)):
        if backward and b.opcode == "dot":
            return "gradients"  # the experts' per-expert weight gradient, before its reduce-scatter
        return "kernel"  # the product's own [rows, width] operands and result are activations
    if not name:
        return "xla_copies"
    if "loss" in _scopes(name):
        return "loss"
    if b.opcode in COLLECTIVES:
        return "schedule"
    if backward:
        return "block_working_set"
    if "jvp(" in name:
        return "stored_activations"
    return "update"
