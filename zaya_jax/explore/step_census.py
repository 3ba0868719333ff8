"""What a compiled step runs, op by op: kernel launches, GEMM FLOPs by dtype, non-GEMM bytes, by model part.

`census(hlo_text)` reads XLA's optimized HLO (a GPU target's, compiled here without the GPU, or any
other) and returns one `Op` for every instruction that launches work on the device, with how many
times it runs per step: control flow is followed from the entry (loop bodies times their known trip
counts, conditional branches, called computations), never into a fusion's body or a reducer, which
are the inside of one kernel. Each op has

* `kind`: `gemm` (a vendor GEMM call, a dot, or a fusion around one), `kernel` (a Pallas/Triton or
  other custom call), `collective`, `copy`, `elementwise` (every other fusion or op);
* `part`: the model scope its `op_name` names (`PARTS`: the optimizer's `newton_schulz`, the
  solve balancer's forward (`re-route`), the micro-batches' running gradient sum (`accumulation`), the loss,
  attention, experts, router, norms, embedding, the layer scan's slicing of stacked weights and
  gradients), `optimizer` for the update outside the differentiated step, `other` for the rest of
  the blocks; a backward op's part ends in ` bwd`;
* `bytes`: what it reads and writes in HBM (result + operands; an in-place dynamic update or a
  dynamic slice moves the slice, not the buffer it lives in);
* `flops` and `dtype` of a GEMM (2 x result elements x contracted size; the lhs operand's dtype),
  and of the kernels that multiply: our grouped matmul and attention, cuDNN's attention
  (`kernel_flops`).

`tools/gpu_census.py` prints it as a table per part and prices it at a GPU report's rates
(`explore/census_pricing.py`); `tools/profile_step.py` matches a measured trace to the same ops.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

from zaya_jax.explore import hlo_census
from zaya_jax.train.step import GRADIENT_SUM_SCOPE, REROUTE_SCOPE

# (text in op_name, part), first match wins: Newton–Schulz and the balancer's re-route before the
# model's scopes (they are named alone), the loss before attention (its chunks run after the last
# block), experts before `moe`'s router.
PARTS = (("newton_schulz", "newton-schulz"), (REROUTE_SCOPE, "re-route"), (GRADIENT_SUM_SCOPE, "accumulation"),
         ("loss", "loss"),
         ("linear_attention", "linear attention"), ("rms_norm", "norms"), ("experts", "experts"),
         ("router", "router"), ("attention", "attention"), ("norm", "norms"),
         ("embed", "embedding"), ("_take", "embedding"), ("dynamic_index_in_dim", "layer scan"),
         ("dynamic_update_index_in_dim", "layer scan"), ("dynamic_slice", "layer scan"),
         ("dynamic_update_slice", "layer scan"))
KINDS = ("gemm", "kernel", "collective", "copy", "elementwise")
# Opcodes that launch nothing: bookkeeping, control flow (its bodies are counted), the second
# half of an async pair.
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
              "after-all", "opt-barrier", "add-dependency", "domain", "partition-id", "replica-id",
              "async-done", "copy-done", "send-done", "recv-done", "all-gather-done", "all-reduce-done",
              "collective-permute-done", "async-update"}
_CONTROL = re.compile(r"(condition|body|to_apply|true_computation|false_computation|calls)=%?([\w.\-]+)")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    opcode: str
    kind: str  # one of KINDS
    part: str
    runs: int  # per step
    bytes: int  # read + written by one run
    flops: int = 0  # of one run: a GEMM's, or one of our multiplying kernels' (`kernel_flops`)
    dtype: str = ""  # a GEMM's lhs element type
    target: str = ""  # a custom call's target (or Pallas kernel name)


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    text: str  # everything after `name = `
    computation: str
    root: bool = False

    @property
    def opcode(self) -> str:
        return opcode(self.text)


def instructions(hlo: str) -> dict[str, Instruction]:
    """{instruction name: Instruction} over every computation of the module."""
    out = {}
    for computation, lines in hlo_census.computations(hlo)[0].items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m:
                out[m.group(2)] = Instruction(m.group(2), m.group(3), computation, bool(m.group(1)))
    return out


def census(hlo: str) -> list[Op]:
    """Every launching instruction of the program reachable from its entry, with its runs per call."""
    table = instructions(hlo)
    bodies = collections.defaultdict(list)
    for inst in table.values():
        bodies[inst.computation].append(inst)
    entry = hlo_census.computations(hlo)[1]
    runs = _control_runs(bodies, entry)
    out = []
    for computation, times in runs.items():
        for inst in bodies.get(computation, ()):
            op = inst.opcode
            if op in _NO_KERNEL or op.endswith("-done"):
                continue
            called = [i for c in re.findall(r"calls=%?([\w.\-]+)", inst.text) for i in bodies.get(c, [])]
            kind = kind_of(inst.text, called)
            flops, dtype = (gemm_flops(inst, called, table) if kind == "gemm"
                            else kernel_flops(inst, table) if kind == "kernel" else (0, ""))
            out.append(Op(inst.name, op, kind, part_of(inst.text), times, moved_bytes(inst, called, table), flops,
                          dtype, _target(inst.text)))
    return out


def _control_runs(bodies: dict[str, list[Instruction]], entry: str) -> dict[str, int]:
    """Runs per call of each computation control reaches: loops' bodies x trips, branches, calls.
    A fusion's or custom call's body and a reducer (`to_apply` of a reduce) are one kernel's inside."""
    runs: dict[str, int] = collections.defaultdict(int)

    def visit(name: str, times: int, depth: int) -> None:
        if depth > 64:
            return
        runs[name] += times
        for inst in bodies.get(name, ()):
            op = inst.opcode
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', inst.text)
                n = int(trips.group(1)) if trips else 1
                for key, callee in _CONTROL.findall(inst.text):
                    if key in ("body", "condition"):
                        visit(callee, times * n, depth + 1)
            elif op == "conditional":
                branches = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", inst.text)
                listed = re.search(r"branch_computations=\{([^}]*)\}", inst.text)
                branches += [b.strip().lstrip("%") for b in listed.group(1).split(",")] if listed else []
                for callee in branches:  # one branch runs; counting each once bounds it from above
                    visit(callee, times, depth + 1)
            elif op in ("call", "async-start"):
                for key, callee in _CONTROL.findall(inst.text):
                    if key in ("to_apply", "calls"):
                        visit(callee, times, depth + 1)

    visit(entry, 1, 0)
    return dict(runs)


def _result_head(text: str) -> str:
    """The result's shape (or tuple of shapes) at the start of an instruction's text."""
    return text[: _tuple_end(text)] if text.startswith("(") else text.split(" ", 1)[0]


def opcode(text: str) -> str:
    """An instruction's opcode: the first `name(` after its result's shape (a tuple's too)."""
    rest = text[len(_result_head(text)):]
    m = re.search(r"([a-z][\w\-]*)\(", rest)
    return m.group(1) if m else ""


def kind_of(text: str, called: list[Instruction]) -> str:
    """The kind of op an instruction is (see the module docstring); `called` holds the instructions
    of the computations it calls: a fusion's body."""
    op = opcode(text)
    if op.removesuffix("-start") in hlo_census.COLLECTIVES:
        return "collective"
    if op == "custom-call":  # a vendor library's GEMM, or a kernel (Pallas/Triton, cuDNN attention...)
        target = re.search(r'custom_call_target="([^"]*)"', text)
        target = target.group(1).lower() if target else ""
        return "gemm" if ("cublas" in target or "gemm" in target or "hipblas" in target) else "kernel"
    if op in ("dot", "convolution") or any(c.opcode in ("dot", "convolution") for c in called):
        return "gemm"
    if op == "fusion" and "__triton_gemm" in text:
        return "gemm"
    if op in ("copy", "transpose", "copy-start"):
        return "copy"
    return "elementwise"


def part_of(text: str) -> str:
    """The model part an instruction's op_name names, ` bwd` added for the backward."""
    name = re.search(r'op_name="([^"]*)"', text)
    name = name.group(1) if name else ""
    direction = " bwd" if "transpose(" in name else ""
    for key, part in PARTS:
        if key in name:
            return part + ("" if part == "newton-schulz" else direction)
    if not name:
        return "no scope"
    # Outside the differentiated step (no jvp/transpose) and no model scope: the update, the
    # clipping, the bad-step guard, the balancer.
    return ("other" + direction) if ("jvp(" in name or direction) else "optimizer"


def _target(text: str) -> str:
    target = re.search(r'custom_call_target="([^"]*)"', text)
    if not target:
        return ""
    if "triton" in target.group(1):  # a Pallas kernel: its op_name ends in the kernel's name
        kernel = re.search(r'op_name="[^"]*/(zaya_\w+)[^"]*"', text)
        return kernel.group(1) if kernel else target.group(1)
    return target.group(1)


def shape_bytes(text: str) -> int:
    """Bytes of the first shape (or tuple of shapes) the text writes: an instruction's result."""
    return sum(hlo_census.array_bytes(_result_head(text)))


def _operands(text: str) -> list[str]:
    body = text[len(_result_head(text)):]
    args = body.split("(", 1)[1] if "(" in body else ""
    depth, end = 1, 0
    for end, ch in enumerate(args):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    return re.findall(r"%([\w.\-]+)", args[:end])


def moved_bytes(inst: Instruction, called: list[Instruction], table: dict[str, Instruction]) -> int:
    """HBM bytes one run reads and writes: its result and operands, except that a dynamic slice
    reads only its slice, an in-place dynamic update writes only its update (XLA updates the
    buffer where it lies), and a fusion reads of an operand it slices or gathers only that part."""
    operands = [table[o] for o in _operands(inst.text) if o in table]
    sizes = [shape_bytes(o.text) for o in operands]
    result = _first_result_bytes(inst.text) if inst.opcode == "custom-call" else shape_bytes(inst.text)
    if inst.opcode == "dynamic-slice":
        return 2 * result
    if inst.opcode == "dynamic-update-slice":
        return 2 * (sizes[1] if len(sizes) > 1 else 0)
    read = _sliced_params(called)
    root = next((c for c in called if c.root), None)
    if root is not None and root.opcode == "dynamic-update-slice":
        names = _operands(root.text)
        inner = {c.name: c for c in called}
        buffer = _param_index(inner.get(names[0])) if names else None
        update = shape_bytes(inner[names[1]].text) if len(names) > 1 and names[1] in inner else 0
        # The update is written; what it is made from is read (a slice of an operand: the slice).
        return update + sum(read.get(i, size) for i, size in enumerate(sizes) if i != buffer)
    return result + sum(read.get(i, size) for i, size in enumerate(sizes))


def _first_result_bytes(text: str) -> int:
    """A custom call's first result: a vendor GEMM returns (result, workspace)."""
    return (hlo_census.array_bytes(_result_head(text)) or [0])[0]


def _param_index(inst: Instruction | None) -> int | None:
    if inst is None or inst.opcode != "parameter":
        return None
    return int(re.search(r"parameter\((\d+)\)", inst.text).group(1))


# Ops a fused kernel evaluates element by element, only where a later op asks for the element.
_PER_ELEMENT = {"bitcast", "reshape", "transpose", "convert", "copy", "select", "compare", "add", "subtract",
                "multiply", "divide", "maximum", "minimum", "negate", "exponential", "log", "and", "or", "not", "abs"}
_READS_PART = ("dynamic-slice", "slice", "gather")  # of their first operand: only the elements they return


def _sliced_params(called: list[Instruction]) -> dict[int, int]:
    """{parameter index: bytes read} of a fusion's parameters read only in part: through slices or
    gathers of them, directly or through per-element ops (a gather of a masked array reads the
    gathered elements, not the array)."""
    users = collections.defaultdict(list)
    for c in called:
        for o in _operands(c.text):
            users[o].append(c)
    read = {}
    for c in called:
        if c.opcode == "parameter":
            elements = _elements_read(c.name, users)
            if elements is not None:
                read[_param_index(c)] = elements * shape_bytes(c.text) // max(_result_elements(c.text), 1)
    return read


def _elements_read(name: str, users: dict[str, list[Instruction]]) -> int | None:
    """Elements of `name` a fused kernel reads if every use ends in a slice or gather of it (or of
    per-element ops of it); None if any use reads all of it."""
    ends: dict[str, int] = {}
    todo, seen = [name], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if not users.get(current):
            return None  # the fusion's result: every element is read
        for u in users[current]:
            if u.opcode in _READS_PART and _operands(u.text)[:1] == [current]:
                ends[u.name] = _result_elements(u.text)
            elif u.opcode in _PER_ELEMENT:
                todo.append(u.name)
            else:
                return None
    return sum(ends.values())


def gemm_flops(inst: Instruction, called: list[Instruction], table: dict[str, Instruction]) -> tuple[int, str]:
    """(FLOPs, lhs dtype) of one run of a GEMM: a vendor call with dot dimension numbers, a dot, or
    a fusion around one (its dot's)."""
    if inst.opcode == "custom-call":
        dims = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', inst.text)
        operands = [table[o] for o in _operands(inst.text) if o in table]
        if not dims or not operands:
            return 0, ""
        contracting = [int(d) for d in json.loads(dims.group(1)).get("lhs_contracting_dimensions", [])]
        return _dot_flops(operands[0].text, contracting, _result_elements(inst.text)), _dtype(operands[0].text)
    dot = inst if inst.opcode in ("dot", "convolution") else next(
        (c for c in called if c.opcode in ("dot", "convolution")), None)
    if dot is None:
        return 0, ""
    scope = table if dot is inst else {c.name: c for c in called}
    operands = [scope[o] for o in _operands(dot.text) if o in scope]
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.text)
    if not operands or not contracting:
        return 0, _dtype(operands[0].text) if operands else ""
    dims = [int(d) for d in contracting.group(1).split(",") if d]
    return _dot_flops(operands[0].text, dims, _result_elements(dot.text)), _dtype(operands[0].text)


# Products of one attention kernel, in units of one [S, S] x d product per head: FlashAttention's
# forward (QKᵀ, PV), its dq pass (QKᵀ, dO·Vᵀ, dS·K) and its dk/dv pass (QKᵀ, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q).
_ATTENTION_PRODUCTS = {"zaya_forward_kernel": 2, "zaya_dq_kernel": 3, "zaya_dkv_kernel": 4}


def kernel_flops(inst: Instruction, table: dict[str, Instruction]) -> tuple[int, str]:
    """(FLOPs, input dtype) of one run of our Pallas kernels that multiply: the grouped matmul (each
    row meets one expert's weight: 2 x rows x K x N, its transposed form alike) and causal
    attention (half of the [S, S] products); other kernels: (0, "")."""
    target = _target(inst.text)
    operands = [_first_shape(table[o].text) for o in _operands(inst.text) if o in table]
    dtype = next((_dtype(table[o].text) for o in _operands(inst.text) if o in table), "")
    out = _first_shape(inst.text)
    if "grouped_matmul" in target:
        rows = [s for s in operands if len(s) == 2]
        if len(out) == 3 and rows:  # the weight gradient [G, K, N] from [M, K] and [M, N]
            return 2 * rows[0][0] * out[1] * out[2], dtype
        lhs = next((s for s in rows if s[0] == out[0]), None)
        return (2 * math.prod(out) * lhs[-1], dtype) if lhs else (0, dtype)
    products = _ATTENTION_PRODUCTS.get(target) or _cudnn_attention_products(target)
    if products and operands:
        q = operands[0]  # [B, S, heads..., d]
        batch, seq, d = q[0], q[1], q[-1]
        heads = math.prod(q[2:-1])
        return products * batch * seq * seq * heads * d, dtype
    return 0, ""


def _cudnn_attention_products(target: str) -> int:
    """cuDNN's fused attention (`__cudnn$fmha…`, BTNH): its forward's two products, its backward's
    five (QKᵀ again, dO·Vᵀ, Pᵀ·dO, dS·K, dSᵀ·Q); 0 for any other call."""
    if not target.startswith("__cudnn$fmha"):
        return 0
    return 5 if target.endswith("Backward") else 2


def _dot_flops(lhs_text: str, contracting: list[int], result_elements: int) -> int:
    shape = _first_shape(lhs_text)
    return 2 * result_elements * math.prod(shape[d] for d in contracting if d < len(shape))


def _result_elements(text: str) -> int:
    return math.prod(_first_shape(text))


def _first_shape(text: str) -> list[int]:
    m = hlo_census._SHAPE.search(text.lstrip("("))
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _dtype(text: str) -> str:
    m = hlo_census._SHAPE.search(text.lstrip("("))
    return m.group(1) if m else ""


def _tuple_end(text: str) -> int:
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i + 1
    return len(text)


# ---- the table and the time ---------------------------------------------------------------
def totals(ops: list[Op]) -> dict:
    """Launches, GEMM FLOPs by dtype, kernel FLOPs, non-GEMM bytes (XLA's fusions and copies) and
    kernel bytes, over `ops`."""
    out = {"launches": sum(o.runs for o in ops), "gemm_flops": collections.Counter(), "kernel_flops": 0,
           "nongemm_bytes": 0, "kernel_bytes": 0, "kernels": collections.Counter()}
    for o in ops:
        if o.kind == "gemm":
            out["gemm_flops"][o.dtype or "?"] += o.runs * o.flops
        elif o.kind == "kernel":
            out["kernel_flops"] += o.runs * o.flops
            out["kernel_bytes"] += o.runs * o.bytes
            out["kernels"][o.target] += o.runs
        else:
            out["nongemm_bytes"] += o.runs * o.bytes
    out["gemm_flops"], out["kernels"] = dict(out["gemm_flops"]), dict(out["kernels"])
    return out


def by_part(ops: list[Op]) -> dict[str, dict]:
    """`totals` of each part's ops, the parts in order of launches."""
    parts = collections.defaultdict(list)
    for o in ops:
        parts[o.part].append(o)
    rows = {part: totals(chosen) for part, chosen in parts.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["launches"]))
