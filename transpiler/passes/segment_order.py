"""Pass 6, segment order: how each trainer runs its sub-program, sends first.

A trainer runs its sub-program as segments cut before each run of recv ops (a segment starts with
the recvs it waits on), and here a segment is also cut after what its sends need, so its peers get
their tensors before the trainer computes what only it needs.

A backward segment of the dense trainer computes, per layer, the input gradient and the weight
gradient (one `gemm_grad` op), then sends the first layer's input gradient to the embedding trainer
— which, at the last micro-batch of a sync step, waits for it to finish the step, push it and pull
the next step's rows. Here each `gemm_grad` making both is run as two parts (input gradient; weight
and bias gradients: the same products, attr `grads`), and a segment whose sends do not need all of
its ops becomes two: the ops the sends need, in program order, then the others (weight gradients,
pushes) as a segment of their own — it has no recv, so the trainer runs it right after the first
one's sends are out. The ops and their inputs are the same, so the values are too.

The result is stored in each sub-program, `Program.segments` (saved with the plan); `verify`
checks it, and `runtime.exec.simulate` and the trainers run it (`transpiler.passes.schedule.segments`).
The sub-programs' op lists stay as `split` made them.
"""

from __future__ import annotations

from transpiler.ir import Op, Program, SegmentRef
from transpiler.passes.types import SegmentOrder

_Part = tuple[Op, SegmentRef]  # an op to run and how `Program.segments` names it


def order_segments(programs: dict[str, Program]) -> SegmentOrder:
    """Set every sub-program's `segments` (in place): cut at its recv ops, each segment then cut in
    two where its sends do not need all of its ops."""
    out = {}
    for t, prog in programs.items():
        prog.segments = out[t] = [[ref for _, ref in seg] for seg in _sends_first(recv_cuts(prog.ops))]
    return SegmentOrder(out)


def recv_cuts(ops: list[Op]) -> list[list[Op]]:
    """`ops` cut before each run of recv ops: a segment starts with the recvs it waits on."""
    segs: list[list[Op]] = []
    for op in ops:
        if not segs or (op.type == "recv" and segs[-1][-1].type != "recv"):
            segs.append([])
        segs[-1].append(op)
    return segs


def op_part(op: Op, slots: tuple[str, ...]) -> Op:
    """The part of `op` that makes only its outputs in `slots` (a gemm_grad's input gradient, or its
    weight and bias gradients: attr `grads` tells the kernel which)."""
    part = op.copy()
    part.outputs = {s: list(op.outputs[s]) for s in slots}
    part.attrs["grads"] = [s.split("@")[0] for s in slots]
    return part


def _sends_first(segs: list[list[Op]]) -> list[list[_Part]]:
    """The segments, each cut in two where its sends do not need all of its ops."""
    out = []
    for seg in segs:
        if not any(op.type == "send" for op in seg):  # nothing to send first
            out.append([(op, op.id) for op in seg])
            continue
        parts = [part for op in seg for part in _split_gemm_grad(op)]
        ops = [op for op, _ in parts]
        needed = _needed_by_sends(ops)
        first = [p for p in parts if id(p[0]) in needed]
        rest = [p for p in parts if id(p[0]) not in needed]
        if not rest or not any(op.type == "send" for op, _ in first) or not _reorderable(ops, needed):
            out.append([(op, op.id) for op in seg])
            continue
        out += [first, rest]
    return out


def _reorderable(ops: list[Op], needed: set[int]) -> bool:
    """No op left for later writes a var the first ops touch, nor reads one that a first op after
    it writes (so moving the first ops ahead changes no value)."""
    first_writes = {n for op in ops if id(op) in needed for n in op.output_names()}
    later_writes: set[str] = set()
    for op in reversed(ops):
        if id(op) in needed:
            later_writes.update(op.output_names())
        elif first_writes.intersection(op.output_names()) or later_writes.intersection(op.input_names()):
            return False
    return True


def _split_gemm_grad(op: Op) -> list[_Part]:
    """A gemm_grad making the input gradient and weight (bias) gradients as two parts, else the op."""
    weights = tuple(s for s in ("B@GRAD", "C@GRAD") if any(op.outputs.get(s, [])))
    if op.type != "gemm_grad" or not any(op.outputs.get("A@GRAD", [])) or not weights or "grads" in op.attrs:
        return [(op, op.id)]
    return [(op_part(op, slots), (op.id, slots)) for slots in (("A@GRAD",), weights)]


def _needed_by_sends(ops: list[Op]) -> set[int]:
    """ids (Python's) of the sends and of every op whose output they need, directly or not."""
    wanted: set[str] = set()
    needed: set[int] = set()
    for op in reversed(ops):
        if op.type == "send" or wanted.intersection(op.output_names()):
            needed.add(id(op))
            wanted.update(op.input_names())
    return needed
