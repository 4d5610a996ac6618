"""The Paddle-style IR: Program -> Blocks -> Ops and Vars.

Small on purpose: passes are plain functions over these objects, the executor walks `ops` in order,
and everything round-trips through JSON exactly (parameter values travel separately as `.npz`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ops_registry import get_op, has_op
from ops_registry.errors import HetpsError
from transpiler.values import copy_json, json_default, load_params, save_params

OP_ROLES = ("forward", "loss", "backward", "optimize", "comm", "ps")

# One op of a run segment (`Program.segments`): an op id (the whole op), or (op id, output slots)
# for the part of an op that makes only those outputs.
SegmentRef = int | tuple[int, tuple[str, ...]]


def grad_name(name: str) -> str:
    """The gradient variable of `name` (Paddle's convention)."""
    return f"{name}@GRAD"


@dataclass
class Var:
    """A named tensor. `shape` uses -1 for the batch (unknown) dim; None when unknown."""

    name: str
    shape: tuple[int, ...] | None = None
    dtype: str = "float32"
    persistable: bool = False
    is_parameter: bool = False
    trainable: bool = True
    stop_gradient: bool = False
    initializer: dict[str, Any] | None = None
    is_sparse: bool = False  # a table accessed by ids (its gradient is row-sparse)

    def __post_init__(self) -> None:
        if self.shape is not None:
            self.shape = tuple(int(d) for d in self.shape)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape) if self.shape is not None else None
        return d

    def copy(self) -> Var:
        """An independent copy (cheap: passes copy whole programs of 100k vars)."""
        v = object.__new__(Var)
        v.__dict__.update(self.__dict__)
        v.initializer = copy_json(self.initializer)
        return v


@dataclass
class Op:
    """One op: `type`, `inputs`/`outputs` as {slot: [var names]}, `attrs`.

    Reserved attrs: `op_role` (see OP_ROLES) and `op_device` (trainer type; "" = let placement
    decide). `id` is unique within a Program and stable across passes; a grad op records its
    forward op's id in `attrs["fwd_id"]`.
    """

    type: str
    inputs: dict[str, list[str]] = field(default_factory=dict)
    outputs: dict[str, list[str]] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    id: int = -1

    @property
    def role(self) -> str:
        return self.attrs.get("op_role", "forward")

    @property
    def device(self) -> str:
        return self.attrs.get("op_device", "")

    def input_names(self) -> list[str]:
        return [n for names in self.inputs.values() for n in names if n]

    def output_names(self) -> list[str]:
        return [n for names in self.outputs.values() for n in names if n]

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "type": self.type,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "attrs": self.attrs,
        }

    def copy(self) -> Op:
        """An independent copy with the same id."""
        return Op(
            self.type,
            {k: list(v) for k, v in self.inputs.items()},
            {k: list(v) for k, v in self.outputs.items()},
            copy_json(self.attrs),
            self.id,
        )

    def __str__(self) -> str:
        outs = ", ".join(f"{s}={v}" for s, v in self.outputs.items())
        ins = ", ".join(f"{s}={v}" for s, v in self.inputs.items())
        shown = {k: v for k, v in self.attrs.items() if k not in ("op_role", "op_device", "fwd_id")}
        tags = self.role + (f"@{self.device}" if self.device else "")
        return f"{{{outs}}} = {self.type}({ins}) {shown if shown else ''} [{tags}]".replace("  ", " ")


class OpList(Sequence[Op]):
    """A read-only view of a block's ops: change them through the Block's methods, which bump the
    program's version (the Executor's cache key)."""

    __slots__ = ("_ops",)

    def __init__(self, ops: list[Op]) -> None:
        self._ops = ops

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - int or slice, as a list takes
        return self._ops[i]

    def __len__(self) -> int:
        return len(self._ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self._ops)

    def __reversed__(self) -> Iterator[Op]:
        return reversed(self._ops)


class Block:
    """Vars by name and ops in run order. `ops` is read-only: `append_op`, `insert_op`, `set_ops`
    and `update_op` change them and bump `version`."""

    def __init__(
        self, idx: int = 0, parent_idx: int = -1, vars: dict[str, Var] | None = None, ops: Iterable[Op] = ()
    ) -> None:
        self.idx, self.parent_idx = idx, parent_idx
        self.vars: dict[str, Var] = vars if vars is not None else {}
        self._ops: list[Op] = list(ops)
        self._view = OpList(self._ops)
        self.version = 0

    @property
    def ops(self) -> OpList:
        return self._view

    def append_op(self, op: Op) -> Op:
        self._ops.append(op)
        self.version += 1
        return op

    def insert_op(self, index: int, op: Op) -> Op:
        self._ops.insert(index, op)
        self.version += 1
        return op

    def set_ops(self, ops: Iterable[Op]) -> None:
        """Replace every op (a pass that rewrites the program builds the new order and sets it)."""
        self._ops[:] = list(ops)
        self.version += 1

    def update_op(
        self,
        op: Op,
        *,
        inputs: dict[str, list[str]] | None = None,
        outputs: dict[str, list[str]] | None = None,
        attrs: dict[str, Any] | None = None,
    ) -> Op:
        """Merge `inputs` / `outputs` slots and `attrs` into `op` (one of this block's ops)."""
        if inputs:
            op.inputs = {**op.inputs, **inputs}
        if outputs:
            op.outputs = {**op.outputs, **outputs}
        if attrs:
            op.attrs.update(attrs)
        self.version += 1
        return op

    def var(self, name: str) -> Var:
        try:
            return self.vars[name]
        except KeyError:
            raise KeyError(f"variable {name!r} is not in block {self.idx}") from None

    def has_var(self, name: str) -> bool:
        return name in self.vars

    def create_var(self, name: str, **kw: Any) -> Var:
        v = Var(name, **kw)
        self.vars[name] = v
        return v


class Program:
    """A static program. Block 0 is global. `params` holds parameter values that travel with the
    program (e.g. from ONNX initializers); `attrs` holds program-level facts (loss name, ...).
    `segments`: how a trainer runs a transpiled sub-program, set by the segment-order pass
    (`transpiler.passes.segment_order`): block 0's ops as run segments in run order, each a list of
    `SegmentRef`s; None: segments cut at recv ops (`transpiler.passes.schedule.segments`). They
    describe the ops as they were when set: a later change to the ops (which bumps `version`)
    drops them."""

    def __init__(self) -> None:
        self.blocks: list[Block] = [Block(0)]
        self.params: dict[str, np.ndarray] = {}
        self.attrs: dict[str, Any] = {}
        self._segments: tuple[int, list[list[SegmentRef]]] | None = None  # (version when set, segments)
        self._next_id = 0

    # -- structure -------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Grows with every change to the ops (the Executor's cache key, with the program's id)."""
        return sum(b.version for b in self.blocks)

    @property
    def segments(self) -> list[list[SegmentRef]] | None:
        if self._segments is None or self._segments[0] != self.version:
            return None
        return self._segments[1]

    @segments.setter
    def segments(self, segs: list[list[SegmentRef]] | None) -> None:
        self._segments = None if segs is None else (self.version, segs)

    def global_block(self) -> Block:
        return self.blocks[0]

    @property
    def ops(self) -> OpList:
        return self.blocks[0].ops

    @property
    def vars(self) -> dict[str, Var]:
        return self.blocks[0].vars

    def var(self, name: str) -> Var:
        return self.blocks[0].var(name)

    @property
    def fetch_names(self) -> list[str]:
        """The names an importer says to fetch (ONNX graph outputs, Paddle's `fetch` entries), in
        order: the list held in `attrs["fetch_names"]` (its one home); a new [] when none was set
        (assign to set one)."""
        return self.attrs.get("fetch_names", [])

    @fetch_names.setter
    def fetch_names(self, names: list[str]) -> None:
        self.attrs["fetch_names"] = list(names)

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def append_op(
        self,
        type: str,
        inputs: dict | None = None,
        outputs: dict | None = None,
        attrs: dict | None = None,
        index: int | None = None,
    ) -> Op:
        """Append (or insert at `index`) an op with a fresh id; slot values may be a name or a list."""
        attrs = json.loads(json.dumps(attrs or {}, default=json_default))  # as JSON will hold them
        op = Op(type, _slots(inputs), _slots(outputs), attrs, self.new_id())
        block = self.blocks[0]
        return block.append_op(op) if index is None else block.insert_op(index, op)

    def lint(self) -> None:
        """Raise `LintError` naming the first op that breaks an invariant of the IR (see `lint`)."""
        lint(self)

    def parameters(self) -> list[Var]:
        return [v for v in self.vars.values() if v.is_parameter]

    def clone(self) -> Program:
        """A deep copy: blocks, vars, ops (same ids), attrs and parameter values."""
        p = Program()
        p.attrs = copy_json(self.attrs)
        p._next_id = self._next_id
        p.blocks = [
            Block(b.idx, b.parent_idx, {n: v.copy() for n, v in b.vars.items()}, [op.copy() for op in b.ops])
            for b in self.blocks
        ]
        p.params = {k: v.copy() for k, v in self.params.items()}
        p.segments = None if self.segments is None else [list(seg) for seg in self.segments]
        return p

    # -- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "version": 1,
            "attrs": copy.deepcopy(self.attrs),
            "next_id": self._next_id,
            "blocks": [
                {
                    "idx": b.idx,
                    "parent_idx": b.parent_idx,
                    "vars": [v.to_dict() for v in b.vars.values()],
                    "ops": [op.to_dict() for op in b.ops],
                }
                for b in self.blocks
            ],
        }
        if self.segments is not None:  # a part as [id, [slots]]; absent: cut at recv ops
            d["segments"] = [[_ref_json(r) for r in s] for s in self.segments]
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=json_default)

    @classmethod
    def from_dict(cls, d: dict) -> Program:
        p = cls()
        p.attrs = copy.deepcopy(d.get("attrs", {}))
        p._next_id = d.get("next_id", 0)
        p.blocks = []
        for bd in d["blocks"]:
            b = Block(bd["idx"], bd["parent_idx"])
            for vd in bd["vars"]:
                b.vars[vd["name"]] = Var(**vd)
            b.set_ops(
                Op(
                    od["type"],
                    {k: list(v) for k, v in od["inputs"].items()},
                    {k: list(v) for k, v in od["outputs"].items()},
                    copy.deepcopy(od["attrs"]),
                    od["id"],
                )
                for od in bd["ops"]
            )
            p.blocks.append(b)
        if d.get("segments") is not None:
            p.segments = [[_ref_from_json(r) for r in s] for s in d["segments"]]
        return p

    @classmethod
    def from_json(cls, s: str) -> Program:
        return cls.from_dict(json.loads(s))

    def save(self, path: str | Path) -> None:
        """`path`.json for the program, `path`.npz for its parameter values (when any)."""
        path = Path(path)
        path.with_suffix(".json").write_text(self.to_json(indent=1))
        if self.params:
            save_params(self.params, path.with_suffix(".npz"))

    @classmethod
    def load(cls, path: str | Path) -> Program:
        path = Path(path)
        p = cls.from_json(path.with_suffix(".json").read_text())
        if path.with_suffix(".npz").exists():
            p.params = load_params(path.with_suffix(".npz"))
        return p

    def __str__(self) -> str:
        lines = []
        for b in self.blocks:
            lines.append(f"block {b.idx}:")
            for v in b.vars.values():
                flags = [
                    f for f in ("persistable", "is_parameter", "is_sparse", "stop_gradient") if getattr(v, f)
                ]
                lines.append(
                    f"  var {v.name}: {v.dtype}{list(v.shape) if v.shape is not None else '?'}"
                    + (f" ({', '.join(flags)})" if flags else "")
                )
            lines.extend(f"  {op}" for op in b.ops)
        return "\n".join(lines)


def _ref_json(r: SegmentRef) -> int | list:
    return r if isinstance(r, int) else [r[0], list(r[1])]


def _ref_from_json(r: int | list) -> SegmentRef:
    return r if isinstance(r, int) else (r[0], tuple(r[1]))


def _slots(d: dict | None) -> dict[str, list[str]]:
    out = {}
    for k, v in (d or {}).items():
        if v is None:
            continue
        vs = [v] if isinstance(v, (str, Var)) else list(v)
        out[k] = [x.name if isinstance(x, Var) else x for x in vs]
    return out


class LintError(HetpsError, ValueError):
    """A program that breaks an invariant of the IR; the message names the op."""


def lint(program: Program) -> None:
    """Check what every pass must keep true (torch.fx's `Graph.lint` habit), raising `LintError`
    naming the op: op ids are unique and below the next fresh id; op types are registered and name
    only their own slots; roles are among OP_ROLES; every var an op names is in its block; every
    input is persistable (state that lives outside the ops: parameters, tables) or defined by an
    earlier op; `segments`, when set, hold every op of block 0 once (an op split in parts: each of
    its output slots in one part). Linear in the ops (it runs after every pass of `transpile`)."""
    slots: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
    seen: dict[int, Op] = {}
    roles = frozenset(OP_ROLES)
    for b in program.blocks:
        names = b.vars
        defined = {n for n, v in names.items() if v.persistable}
        for i, op in enumerate(b._ops):
            known = slots.get(op.type) or _slots_of(op.type, lambda: _where(b, i, op), slots)
            if op.id in seen or not 0 <= op.id < program._next_id:
                raise LintError(_id_problem(program, b, i, op, seen))
            seen[op.id] = op
            if not known[0].issuperset(op.inputs) or not known[1].issuperset(op.outputs):
                raise LintError(
                    f"{_where(b, i, op)}: slot "
                    f"{sorted(set(op.inputs) - known[0] | set(op.outputs) - known[1])[0]!r} "
                    f"is not one of {op.type!r}'s slots (inputs {sorted(known[0])}, "
                    f"outputs {sorted(known[1])})"
                )
            if op.attrs.get("op_role", "forward") not in roles:
                raise LintError(f"{_where(b, i, op)}: op_role {op.role!r} is not one of {OP_ROLES}")
            for vs in op.inputs.values():
                for n in vs:
                    if n and n not in defined:
                        raise LintError(
                            f"{_where(b, i, op)}: "
                            + (
                                f"names var {n!r}, which block {b.idx} does not have"
                                if n not in names
                                else f"reads {n!r} before anything defines it"
                            )
                        )
            for vs in op.outputs.values():
                for n in vs:
                    if n and n not in names:
                        raise LintError(
                            f"{_where(b, i, op)}: names var {n!r}, which block {b.idx} does not have"
                        )
                    defined.add(n)
    if program.segments is not None:
        lint_segments(program)


def lint_segments(program: Program) -> None:
    """Raise `LintError` unless `program.segments` hold every op of block 0 once (see `lint`)."""
    by_id = {op.id: op for op in program.blocks[0]._ops}
    whole: set[int] = set()
    parts: dict[int, list[str]] = {}
    for k, seg in enumerate(program.segments or ()):
        for r in seg:
            i, slots = (r, None) if isinstance(r, int) else r
            op = by_id.get(i)
            where = f"segment {k}: op id {i}"
            if op is None:
                raise LintError(f"{where} is not an op of block 0")
            if i in whole or (slots is None and i in parts):
                raise LintError(f"{where} {op.type!r} is in the segments twice")
            if slots is None:
                whole.add(i)
                continue
            if not set(slots) <= set(op.outputs) or set(slots) & set(parts.get(i, ())):
                raise LintError(
                    f"{where} {op.type!r}: part {list(slots)} names slots that are not its outputs "
                    f"{sorted(op.outputs)} or are in another part too"
                )
            parts.setdefault(i, []).extend(slots)
    for i, slots in parts.items():
        left = sorted(s for s, names in by_id[i].outputs.items() if any(names) and s not in slots)
        if left:
            raise LintError(f"op id {i} {by_id[i].type!r}: its parts in the segments leave out {left}")
    missing = [i for i in by_id if i not in whole and i not in parts]
    if missing:
        raise LintError(f"op id {missing[0]} {by_id[missing[0]].type!r} is in no segment")


def _where(b: Block, i: int, op: Op) -> str:
    return f"block {b.idx} op #{i} {op.type!r} (id {op.id})"


def _slots_of(type: str, where: Any, cache: dict) -> tuple[frozenset[str], frozenset[str]]:
    if not has_op(type):
        raise LintError(f"{where()}: op type {type!r} is not registered in ops_registry")
    opdef = get_op(type)
    cache[type] = (frozenset(opdef.in_slots), frozenset(opdef.out_slots))
    return cache[type]


def _id_problem(program: Program, b: Block, i: int, op: Op, seen: dict[int, Op]) -> str:
    if op.id in seen:
        return f"{_where(b, i, op)}: id {op.id} is also the id of op {seen[op.id].type!r}"
    return (
        f"{_where(b, i, op)}: id outside [0, {program._next_id}); make ops with Program.append_op "
        "or ids with Program.new_id"
    )
