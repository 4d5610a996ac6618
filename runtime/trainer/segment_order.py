"""Sends first: a trainer's segment is cut after what its sends need, so its peers get their
tensors before the trainer computes what only it needs.

A backward segment of the dense trainer computes, per layer, the input gradient and the weight
gradient (one `gemm_grad` op), then sends the first layer's input gradient to the embedding trainer
— which, at the last micro-batch of a sync step, waits for it to finish the step, push it and pull
the next step's rows. Here each `gemm_grad` making both is split in two ops (input gradient; weight
and bias gradients: the same products, attr `grads`), and a segment whose sends do not need all of
its ops becomes two: the ops the sends need, in program order, then the others (weight gradients,
pushes) as a segment of their own — it has no recv, so the trainer runs it right after the first
one's sends are out. The ops and their inputs are the same, so the values are too.
"""

from __future__ import annotations

from transpiler.ir import Op, Program


def sends_first(segs: list[Program]) -> list[Program]:
    """The segments, each cut in two where its sends do not need all of its ops."""
    out = []
    for seg in segs:
        ops = [part for op in seg.ops for part in _split_gemm_grad(op)]
        needed = _needed_by_sends(ops)
        first = [op for op in ops if id(op) in needed]
        rest = [op for op in ops if id(op) not in needed]
        if not rest or not any(op.type == "send" for op in first) or not _reorderable(ops, needed):
            out.append(seg)
            continue
        out += [_program(seg, first), _program(seg, rest)]
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


def _split_gemm_grad(op: Op) -> list[Op]:
    """A gemm_grad making the input gradient and weight (bias) gradients as two ops, else [op]."""
    weights = [s for s in ("B@GRAD", "C@GRAD") if any(op.outputs.get(s, []))]
    if op.type != "gemm_grad" or not any(op.outputs.get("A@GRAD", [])) or not weights or "grads" in op.attrs:
        return [op]
    grad_a, grad_w = op.copy(), op.copy()
    grad_a.outputs = {"A@GRAD": list(op.outputs["A@GRAD"])}
    grad_a.attrs["grads"] = ["A"]
    grad_w.outputs = {s: list(op.outputs[s]) for s in weights}
    grad_w.attrs["grads"] = [s.split("@")[0] for s in weights]
    return [grad_a, grad_w]


def _needed_by_sends(ops: list[Op]) -> set[int]:
    """ids (Python's) of the sends and of every op whose output they need, directly or not."""
    wanted: set[str] = set()
    needed: set[int] = set()
    for op in reversed(ops):
        if op.type == "send" or wanted.intersection(op.output_names()):
            needed.add(id(op))
            wanted.update(op.input_names())
    return needed


def _program(like: Program, ops: list[Op]) -> Program:
    seg = Program()
    seg.global_block().vars = like.global_block().vars
    seg.global_block().set_ops(ops)
    return seg


def kept_outputs(segs: list[Program], report: list[str | None]) -> list[list[str]]:
    """Per segment, the outputs a later segment reads or the trainer reports (what an item keeps)."""
    later: set[str] = {n for n in report if n}
    kept = []
    for seg in reversed(segs):
        outs = dict.fromkeys(n for op in seg.ops for n in op.output_names())
        kept.append([n for n in outs if n in later])
        later.update(n for op in seg.ops for n in op.input_names())
    return kept[::-1]
