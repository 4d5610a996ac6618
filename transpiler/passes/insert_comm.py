"""Pass 4, communication: a `send`/`recv` pair wherever a tensor crosses from one trainer type to
another.

Walking the placed program in its global order, a tensor that an op on trainer type d reads, but
that was produced on another type s and not yet received on d, gets one `send` on s right after
its producer and one `recv` on d right before that first reader; later readers on d reuse it. So
there is exactly one pair per tensor per crossing (s, d), not one per consumer. Forward crossings
carry activations and labels, backward ones `@GRAD`s. Messages are keyed by (tensor name,
micro-batch id): the runtime adds the micro-batch id, the op carries the name.

Why no deadlock: sends never block and every sub-program keeps the global order. A recv waits for
a send that comes earlier in the global order than the recv's reader; so among blocked trainers,
the one waiting at the earliest global position waits for a send that a trainer not blocked before
it will reach. `transpiler.passes.schedule.schedule` replays this and `runtime.exec.simulate` runs it.

Pulls (op role "ps") make a trainer-local copy of a parameter on every type that reads it, so
they never cause a crossing. The pass returns a `Channels`: the channel list and why each op it
inserted runs where it does.
"""

from __future__ import annotations

from collections import defaultdict

from transpiler.ir import Op, Program
from transpiler.passes.assign_devices import bytes_per_example, fixed_batch
from transpiler.passes.types import Channels


def insert_comm(program: Program) -> Channels:
    """Add send/recv ops to placed `program` (in place); return the channels and the inserted ops'
    placement reasons."""
    recvs, sends, channels = _crossings(program)
    reasons: dict[str, str] = {}
    block = program.global_block()
    new_ops = []
    for op in program.ops:
        for n, src in recvs.get(op.id, ()):
            var = block.vars.get(n)
            attrs = {"tensor": n, "src": src, "shape": _shape(var), "dtype": var.dtype if var else None}
            why = f"receives {n!r} from {src} before its first reader here, op id {op.id} {op.type!r}"
            new_ops.append(_comm(program, "recv", {}, {"Out": [n]}, attrs, op.device, why, reasons))
        new_ops.append(op)
        for n, dst in sends.get(op.id, ()):
            why = f"sends {n!r} to {dst} right after its producer, op id {op.id} {op.type!r}"
            attrs = {"tensor": n, "dst": dst}
            new_ops.append(_comm(program, "send", {"X": [n]}, {}, attrs, op.device, why, reasons))
    block.set_ops(new_ops)
    return Channels(channels, reasons)


def _shape(var) -> list | None:
    return list(var.shape) if var and var.shape is not None else None


def _crossings(prog: Program) -> tuple[dict, dict, list[dict]]:
    """Where each tensor crosses a device boundary, walking the ops in order: {reader op id: [(tensor,
    src)]}, {producer op id: [(tensor, dst)]} and one channel record per (tensor, destination)."""
    block = prog.global_block()
    where: dict[str, tuple[str, Op]] = {}  # tensor -> (device, producer) of its latest write
    have: dict[str, set[str]] = defaultdict(set)  # device -> tensors it holds
    recvs: dict[int, list[tuple[str, str]]] = defaultdict(list)  # reader id -> [(tensor, src)]
    sends: dict[int, list[tuple[str, str]]] = defaultdict(list)  # producer id -> [(tensor, dst)]
    channels = []
    batch = fixed_batch(prog)
    for op in prog.ops:
        dev = op.attrs["op_device"]
        mine = have[dev]
        for n in (n for names in op.inputs.values() for n in names):
            if n in mine or n not in where:
                continue
            src, producer = where[n]
            recvs[op.id].append((n, src))
            sends[producer.id].append((n, dev))
            mine.add(n)
            var = block.vars.get(n)
            channels.append(
                {
                    "tensor": n,
                    "src": src,
                    "dst": dev,
                    "shape": _shape(var),
                    "dtype": var.dtype if var else None,
                    "bytes_per_example": bytes_per_example(var, batch),
                    "direction": "backward" if producer.role == "backward" else "forward",
                }
            )
        local_copy = op.attrs.get("op_role") == "ps"
        for n in (n for names in op.outputs.values() for n in names if n):
            if not local_copy:
                for held in have.values():
                    held.discard(n)
            mine.add(n)
            where[n] = (dev, op)
    return recvs, sends, channels


def _comm(
    prog: Program, type: str, ins: dict, outs: dict, attrs: dict, device: str, why: str, reasons: dict
) -> Op:
    op = Op(type, ins, outs, {**attrs, "op_role": "comm", "op_device": device}, prog.new_id())
    reasons[str(op.id)] = f"inserted by insert_comm: {why}"
    return op
