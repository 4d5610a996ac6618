"""How sub-programs run: their run segments, and one deadlock-free global order.

A trainer runs its sub-program as the segments the segment-order pass stored in it
(`Program.segments`, transpiler/passes/segment_order.py), or, for a program without them (a plan
saved before that pass existed), cut at recv ops (`segments`, `segment_programs`); `schedule` gives
one deadlock-free global order of (trainer type, segment), which `verify` uses to prove a plan
cannot deadlock, `runtime.exec.simulate` runs, and the cost model walks.
"""

from __future__ import annotations

from transpiler.errors import DeadlockError
from transpiler.ir import Op, Program
from transpiler.passes.segment_order import op_part, recv_cuts


def segments(program: Program) -> list[list[Op]]:
    """`program`'s run segments, in run order: its stored `segments` (an op split in parts as one op
    per part), else its ops cut before each run of recv ops."""
    if program.segments is None:
        return recv_cuts(program.ops)
    by_id = {op.id: op for op in program.ops}
    return [
        [by_id[r] if isinstance(r, int) else op_part(by_id[r[0]], r[1]) for r in s] for s in program.segments
    ]


def segment_programs(program: Program) -> list[Program]:
    """`segments(program)` as Programs sharing `program`'s vars, each ready for `Executor.run`."""
    out = []
    for ops in segments(program):
        seg = Program()
        seg.global_block().vars = program.global_block().vars
        seg.global_block().set_ops(ops)
        out.append(seg)
    return out


def schedule(programs: dict[str, Program]) -> list[tuple[str, int]]:
    """A global order of (trainer type, segment index) in which every recv finds its message.

    Round robin: each trainer runs segments until one waits for a message not yet sent. Raises
    DeadlockError, naming each waiting trainer's recv op and tensor, when no trainer can move.
    """
    segs = {t: segments(p) for t, p in programs.items()}
    pos = dict.fromkeys(programs, 0)
    sent: set[tuple[str, str, str]] = set()
    order: list[tuple[str, int]] = []
    while any(pos[t] < len(segs[t]) for t in segs):
        moved = False
        for t, ss in segs.items():
            while pos[t] < len(ss) and all(k in sent for k in _waits(t, ss[pos[t]])):
                sent.update(
                    (t, op.attrs["dst"], op.attrs["tensor"]) for op in ss[pos[t]] if op.type == "send"
                )
                order.append((t, pos[t]))
                pos[t] += 1
                moved = True
        if not moved:
            waits = []
            for t, ss in segs.items():
                if pos[t] < len(ss):
                    op = next(
                        op
                        for op in ss[pos[t]]
                        if op.type == "recv" and (op.attrs["src"], t, op.attrs["tensor"]) not in sent
                    )
                    waits.append(
                        f"{t} waits at recv op id {op.id} for {op.attrs['tensor']!r} from {op.attrs['src']}"
                    )
            raise DeadlockError("deadlock: " + "; ".join(waits))
    return order


def _waits(trainer: str, seg: list[Op]) -> list[tuple[str, str, str]]:
    return [(op.attrs["src"], trainer, op.attrs["tensor"]) for op in seg if op.type == "recv"]


def kept_outputs(segs: list[Program], report: list[str | None]) -> list[list[str]]:
    """Per segment, the outputs a later segment reads or the trainer reports (what an item keeps)."""
    later: set[str] = {n for n in report if n}
    kept = []
    for seg in reversed(segs):
        outs = dict.fromkeys(n for op in seg.ops for n in op.output_names())
        kept.append([n for n in outs if n in later])
        later.update(n for op in seg.ops for n in op.input_names())
    return kept[::-1]
