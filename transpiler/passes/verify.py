"""Pass 6, verify: a plan is runnable — checked statically, before any process starts.

- every op input is defined earlier in its sub-program (by a data op, a recv, a pull or an op);
- every send has exactly one matching recv (same tensor, src, dst) and the reverse, with equal
  shape and dtype on both sides, and a send sends the tensor its key names;
- every pull/push names a table of the plan of the right kind and dtype, and every table that has
  an optimizer is pushed (a pulled trainable parameter always comes back as a gradient) and has
  one the parameter servers know (`ops_registry.optimizer.STATE`);
- the run segments a sub-program stores (`Program.segments`, the segment-order pass) hold each of
  its ops once, and in their run order every op reads what it reads in program order (the same
  writes of its inputs), and every var's last write is the same: the segments compute the values
  the program does;
- the sub-programs cannot deadlock: `transpiler.passes.schedule.schedule` finds an order that runs
  their run segments all.
"""

from __future__ import annotations

from collections.abc import Iterable

from ops_registry import UnknownOpError, has_op
from ops_registry.optimizer import STATE as OPTIMIZERS
from transpiler.errors import DeadlockError, PlanError
from transpiler.ir import LintError, Op, Program, lint_segments
from transpiler.passes.schedule import schedule, segments
from transpiler.tables import TableSpec


def _topo_check(ops: Iterable[Op]) -> None:
    """Raise ValueError naming the op and variable when an op reads a var no earlier op defines."""
    have: set[str] = set()
    for i, op in enumerate(ops):
        for n in op.input_names():
            if n not in have:
                raise ValueError(f"op #{i} {op.type!r} (id {op.id}) reads {n!r} before anything defines it")
        have.update(op.output_names())


def _writes(ops: Iterable[Op]) -> tuple[dict[tuple[int, str], set[int | None]], dict[str, int]]:
    """{(op id, input var): ids of the ops whose write of it the op reads (None: none)}, and each
    var's last writer (an op run in parts counts as one op)."""
    last: dict[str, int] = {}
    reads: dict[tuple[int, str], set[int | None]] = {}
    for op in ops:
        for n in op.input_names():
            reads.setdefault((op.id, n), set()).add(last.get(n))
        last.update(dict.fromkeys(op.output_names(), op.id))
    return reads, last


def _same_reads(program_order: Iterable[Op], run_order: list[Op]) -> None:
    """Raise ValueError naming the op when, run in `run_order`, an op reads another write of an
    input than in program order, or a var's last write differs."""
    want, want_last = _writes(program_order)
    got, got_last = _writes(run_order)
    for (i, n), writers in got.items():
        if writers != want.get((i, n)):
            w = next(iter(want.get((i, n)) or {None}))
            op = next(op for op in run_order if op.id == i)
            seen = (
                "before anything defines it" if None in writers else f"as op ids {sorted(writers)} write it"
            )
            raise ValueError(
                f"op {op.type!r} (id {i}) reads {n!r} {seen}, in program order as op id {w} does"
            )
    for n, w in want_last.items():
        if got_last.get(n) != w:
            raise ValueError(
                f"{n!r} is last written by op id {got_last.get(n)}, in program order by op id {w}"
            )


_Key = tuple[str, str, str]  # (src trainer type, dst trainer type, tensor)


def verify(programs: dict[str, Program], tables: list[TableSpec]) -> None:
    """Raise PlanError listing every problem of a plan's sub-programs (by trainer type) and table
    specs; return None when they are sound."""
    sends: dict[_Key, list[Op]] = {}
    recvs: dict[_Key, list[Op]] = {}
    pushed: set[str] = set()
    by_name = {t.name: t for t in tables}
    problems: list[str] = []
    for dev, prog in programs.items():
        problems += _check_ops(dev, prog, by_name, sends, recvs, pushed)
    for key in sorted(set(sends) | set(recvs)):
        problems += _check_pair(programs, key, sends.get(key, []), recvs.get(key, []))
    problems += [
        f"table {name!r} has an optimizer but no trainer pushes its gradient"
        for name, t in by_name.items()
        if t.optimizer and name not in pushed
    ]
    problems += [
        f"table {name!r} has optimizer {t.optimizer.type!r}, which the parameter servers do not "
        f"know (they know {', '.join(sorted(OPTIMIZERS))})"
        for name, t in by_name.items()
        if t.optimizer and t.optimizer.type not in OPTIMIZERS
    ]
    if not problems:
        try:
            schedule(programs)
        except DeadlockError as e:
            problems.append(str(e))
    if problems:
        raise PlanError("plan verification failed:\n  - " + "\n  - ".join(problems))


def _check_ops(
    dev: str,
    prog: Program,
    tables: dict[str, TableSpec],
    sends: dict[_Key, list[Op]],
    recvs: dict[_Key, list[Op]],
    pushed: set[str],
) -> list[str]:
    """Problems of one sub-program's ops; records its sends, recvs and pushed tables on the way."""
    problems = []
    try:
        _topo_check(prog.ops)
    except ValueError as e:
        problems.append(f"trainer {dev}: {e}")
    if prog.segments is not None:
        try:
            lint_segments(prog)
            run = [op for seg in segments(prog) for op in seg]
            if len(run) != len(prog.ops) or any(a is not b for a, b in zip(run, prog.ops, strict=True)):
                _same_reads(prog.ops, run)
        except (LintError, ValueError) as e:
            problems.append(f"trainer {dev}: in its run segments (Program.segments): {e}")
    for op in prog.ops:
        if not has_op(op.type):
            problems.append(f"trainer {dev}: {UnknownOpError(op.type, f'op id {op.id}')}")
        elif op.type == "send":
            sends.setdefault((dev, op.attrs["dst"], op.attrs["tensor"]), []).append(op)
            if op.inputs.get("X") != [op.attrs["tensor"]]:
                problems.append(
                    f"trainer {dev}: send op id {op.id} sends var {op.inputs.get('X')} "
                    f"under the key {op.attrs['tensor']!r}"
                )
        elif op.type == "recv":
            recvs.setdefault((op.attrs["src"], dev, op.attrs["tensor"]), []).append(op)
            if op.outputs.get("Out") != [op.attrs["tensor"]]:
                problems.append(
                    f"trainer {dev}: recv op id {op.id} receives key "
                    f"{op.attrs['tensor']!r} into {op.outputs.get('Out')}"
                )
        elif op.type in ("pull_dense", "pull_sparse", "push_dense", "push_sparse"):
            problems += _check_table(dev, prog, op, tables.get(op.attrs.get("table")))
            if op.type.startswith("push"):
                pushed.add(op.attrs.get("table"))
    return problems


def _check_pair(programs: dict[str, Program], key: _Key, s: list[Op], r: list[Op]) -> list[str]:
    """Problems of one crossing: one send, one recv, the same dtype and shape on both sides."""
    src, dst, tensor = key
    problems = []
    if len(s) > 1 or len(r) > 1:
        problems.append(
            f"{tensor!r} {src}->{dst}: {len(s)} sends (op ids {[o.id for o in s]}) and "
            f"{len(r)} recvs (op ids {[o.id for o in r]}); expected one pair per crossing"
        )
    if not r:
        problems.append(
            f"trainer {src}: send op id {s[0].id} of {tensor!r} to {dst} has no matching recv on {dst}"
        )
    elif not s:
        problems.append(
            f"trainer {dst}: recv op id {r[0].id} of {tensor!r} from {src} has no matching send on {src}"
        )
    elif dst in programs:
        sig_a, sig_b = _sig(programs[src].vars.get(tensor)), _sig(programs[dst].vars.get(tensor))
        attrs = r[0].attrs
        sig_r = (attrs.get("dtype"), tuple(attrs["shape"]) if attrs.get("shape") is not None else None)
        if sig_a != sig_b or sig_b != sig_r:
            problems.append(
                f"{tensor!r} {src}->{dst}: send op id {s[0].id} has {_fmt(sig_a)} but recv "
                f"op id {r[0].id} declares {_fmt(sig_r)} into a var of {_fmt(sig_b)}"
            )
    return problems


def _check_table(dev: str, prog: Program, op: Op, table: TableSpec | None) -> list[str]:
    kind = op.type.split("_")[1]
    problem = None
    if table is None:
        problem = f"names table {op.attrs.get('table')!r}, which the plan does not have"
    elif table.kind != kind:
        problem = f"accesses {table.kind} table {table.name!r} as {kind}"
    elif op.type.startswith("push"):
        problem = None if table.optimizer else f"pushes to {table.name!r}, which has no optimizer"
    else:
        var = prog.vars.get(op.outputs["Out"][0])
        if var is not None and var.dtype != table.dtype:
            problem = f"pulls {table.name!r} ({table.dtype}) into {var.name!r} of dtype {var.dtype}"
        elif kind == "dense" and var is not None and list(var.shape or ()) != list(table.shape):
            problem = (
                f"pulls {table.name!r} of shape {table.shape} into {var.name!r} of shape "
                f"{list(var.shape or ())}"
            )
    return [f"trainer {dev}: {op.type} op id {op.id} {problem}"] if problem else []


def _sig(var) -> tuple:
    return (var.dtype, var.shape) if var is not None else (None, None)


def _fmt(sig: tuple) -> str:
    dtype, shape = sig
    return f"{dtype}{list(shape) if shape is not None else '[?]'}"
