"""Pass 6, verify: a plan is runnable — checked statically, before any process starts.

- every op input is defined earlier in its sub-program (by a data op, a recv, a pull or an op);
- every send has exactly one matching recv (same tensor, src, dst) and the reverse, with equal
  shape and dtype on both sides, and a send sends the tensor its key names;
- every pull/push names a table of the plan of the right kind and dtype, and every table that has
  an optimizer is pushed (a pulled trainable parameter always comes back as a gradient);
- the sub-programs cannot deadlock: `schedule` finds an order that runs them all.

`segments` and `schedule` are what a runtime needs too: a trainer runs its sub-program as segments
cut at recv ops; `schedule` gives one deadlock-free global order of (trainer type, segment).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ops_registry import UnknownOpError, has_op

from ..ir import Op, Program, topo_check

if TYPE_CHECKING:
    from ..plan import Plan


class PlanError(ValueError):
    """A plan that cannot run; the message lists every problem found, naming ops and tensors."""


class DeadlockError(PlanError):
    """The sub-programs wait on each other's messages in a cycle."""


def segments(program: Program) -> list[list[Op]]:
    """`program`'s ops cut before each run of recv ops: a segment starts with the recvs it waits on."""
    segs: list[list[Op]] = []
    for op in program.ops:
        if not segs or (op.type == "recv" and segs[-1][-1].type != "recv"):
            segs.append([])
        segs[-1].append(op)
    return segs


def segment_programs(program: Program) -> list[Program]:
    """`segments(program)` as Programs sharing `program`'s vars, each ready for `Executor.run`."""
    out = []
    for ops in segments(program):
        seg = Program()
        seg.global_block().vars = program.global_block().vars
        seg.global_block().ops = ops
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
                sent.update((t, op.attrs["dst"], op.attrs["tensor"]) for op in ss[pos[t]]
                            if op.type == "send")
                order.append((t, pos[t]))
                pos[t] += 1
                moved = True
        if not moved:
            waits = []
            for t, ss in segs.items():
                if pos[t] < len(ss):
                    op = next(op for op in ss[pos[t]] if op.type == "recv"
                              and (op.attrs["src"], t, op.attrs["tensor"]) not in sent)
                    waits.append(f"{t} waits at recv op id {op.id} for {op.attrs['tensor']!r} from "
                                 f"{op.attrs['src']}")
            raise DeadlockError("deadlock: " + "; ".join(waits))
    return order


def _waits(trainer: str, seg: list[Op]) -> list[tuple[str, str, str]]:
    return [(op.attrs["src"], trainer, op.attrs["tensor"]) for op in seg if op.type == "recv"]


def verify(plan: Plan) -> None:
    """Raise PlanError listing every problem of `plan`; return None when it is sound."""
    problems: list[str] = []
    sends: dict[tuple[str, str, str], list[Op]] = {}
    recvs: dict[tuple[str, str, str], list[Op]] = {}
    pushed: set[str] = set()
    tables = {t["name"]: t for t in plan.tables}
    for dev, prog in plan.programs.items():
        try:
            topo_check(prog.ops, ())
        except ValueError as e:
            problems.append(f"trainer {dev}: {e}")
        for op in prog.ops:
            if not has_op(op.type):
                problems.append(f"trainer {dev}: {UnknownOpError(op.type, f'op id {op.id}')}")
                continue
            if op.type == "send":
                sends.setdefault((dev, op.attrs["dst"], op.attrs["tensor"]), []).append(op)
                if op.inputs.get("X") != [op.attrs["tensor"]]:
                    problems.append(f"trainer {dev}: send op id {op.id} sends var {op.inputs.get('X')} "
                                    f"under the key {op.attrs['tensor']!r}")
            elif op.type == "recv":
                recvs.setdefault((op.attrs["src"], dev, op.attrs["tensor"]), []).append(op)
                if op.outputs.get("Out") != [op.attrs["tensor"]]:
                    problems.append(f"trainer {dev}: recv op id {op.id} receives key "
                                    f"{op.attrs['tensor']!r} into {op.outputs.get('Out')}")
            elif op.type in ("pull_dense", "pull_sparse", "push_dense", "push_sparse"):
                problems += _check_table(dev, prog, op, tables.get(op.attrs.get("table")))
                if op.type.startswith("push"):
                    pushed.add(op.attrs.get("table"))
    for key in sorted(set(sends) | set(recvs)):
        src, dst, tensor = key
        s, r = sends.get(key, []), recvs.get(key, [])
        if len(s) > 1 or len(r) > 1:
            problems.append(f"{tensor!r} {src}->{dst}: {len(s)} sends (op ids {[o.id for o in s]}) and "
                            f"{len(r)} recvs (op ids {[o.id for o in r]}); expected one pair per crossing")
        if not r:
            problems.append(f"trainer {src}: send op id {s[0].id} of {tensor!r} to {dst} has no matching "
                            f"recv on {dst}")
        elif not s:
            problems.append(f"trainer {dst}: recv op id {r[0].id} of {tensor!r} from {src} has no matching "
                            f"send on {src}")
        elif dst in plan.programs:
            a, b = plan.programs[src].vars.get(tensor), plan.programs[dst].vars.get(tensor)
            sig_a, sig_b = _sig(a), _sig(b)
            attrs = r[0].attrs
            sig_r = (attrs.get("dtype"), tuple(attrs["shape"]) if attrs.get("shape") is not None else None)
            if sig_a != sig_b or sig_b != sig_r:
                problems.append(f"{tensor!r} {src}->{dst}: send op id {s[0].id} has {_fmt(sig_a)} but recv "
                                f"op id {r[0].id} declares {_fmt(sig_r)} into a var of {_fmt(sig_b)}")
    for name, t in tables.items():
        if t.get("optimizer") and name not in pushed:
            problems.append(f"table {name!r} has an optimizer but no trainer pushes its gradient")
    if not problems:
        try:
            schedule(plan.programs)
        except DeadlockError as e:
            problems.append(str(e))
    if problems:
        raise PlanError("plan verification failed:\n  - " + "\n  - ".join(problems))


def _check_table(dev: str, prog: Program, op: Op, table: dict | None) -> list[str]:
    kind = op.type.split("_")[1]
    problem = None
    if table is None:
        problem = f"names table {op.attrs.get('table')!r}, which the plan does not have"
    elif table["kind"] != kind:
        problem = f"accesses {table['kind']} table {table['name']!r} as {kind}"
    elif op.type.startswith("push"):
        problem = None if table.get("optimizer") else f"pushes to {table['name']!r}, which has no optimizer"
    else:
        var = prog.vars.get(op.outputs["Out"][0])
        if var is not None and var.dtype != table["dtype"]:
            problem = f"pulls {table['name']!r} ({table['dtype']}) into {var.name!r} of dtype {var.dtype}"
        elif kind == "dense" and var is not None and list(var.shape or ()) != table["shape"]:
            problem = (f"pulls {table['name']!r} of shape {table['shape']} into {var.name!r} of shape "
                       f"{list(var.shape or ())}")
    return [f"trainer {dev}: {op.type} op id {op.id} {problem}"] if problem else []


def _sig(var) -> tuple:
    return (var.dtype, var.shape) if var is not None else (None, None)


def _fmt(sig: tuple) -> str:
    dtype, shape = sig
    return f"{dtype}{list(shape) if shape is not None else '[?]'}"
