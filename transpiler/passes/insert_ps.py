"""Pass 3, parameter-server access: parameters leave the trainers; pulls and pushes take their place.

- Dense table P: `pull_dense(P)` on each trainer type before its first op that reads P, and
  `push_dense(P@GRAD)` right after the op that completes P@GRAD (its last contribution).
- Sparse table W (an embedding table): each lookup `embedding(W, Ids)` (or `embedding_bag(W, Ids,
  ...)`, a pooled lookup) becomes
  `unique_ids(Ids) -> Unique, Index` (once per ids tensor and trainer type),
  `pull_sparse(Unique) -> Rows` and `embedding(Rows, Index)`: the lookup gathers from the pulled
  local rows, so its backward op yields a gradient over local rows, which
  `push_sparse(Unique, Rows@GRAD)` sends once summed per unique id. A `sum` that accumulated W's
  gradient over several lookups disappears: each lookup pushes, and the server sums the step's pushes.
- Optimizer ops (op_role optimize) are removed; they become the tables' optimizers. A program
  without optimize ops trains every parameter that gets a gradient with `config.optimizer`.
- A `clip_by_global_norm` op (also op_role optimize) is removed too: the spec of each table whose
  gradient it clips gets its `clip_norm`, and the sync-mode servers clip the step's gradients of
  those tables by their global norm before applying them (runtime/ps/clip.py).

The pass returns a `Tables`: the table specs (`transpiler.tables.TableSpec`, see `_specs`) and why
each op it inserted runs where it does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ops_registry import get_op
from ops_registry.optimizer import STATE, state_init, state_slots
from transpiler.config import TranspileConfig
from transpiler.cost.balance import balance, table_bytes
from transpiler.ir import Op, Program, Var, grad_name
from transpiler.passes.types import Tables
from transpiler.tables import OptimizerSpec, Sharding, StateSpec, TableSpec

_RESERVED = ("op_role", "op_device", "fwd_id")
# Row lookups of a table W by Ids (slots "W", "Ids"): a sparse table serves them by pulled rows.
LOOKUPS = ("embedding", "embedding_bag")
LOOKUP_GRADS = tuple(f"{t}_grad" for t in LOOKUPS)


def optimizer_spec(type: str, attrs: dict, param: Var) -> OptimizerSpec:
    """The optimizer of one table: its hyper-parameters and state slots.

    Hyper-parameters are the op's attrs over the registry defaults; state slots and their start
    values come from `ops_registry.optimizer` (`state_slots`, `state_init`).
    """
    if type not in STATE:
        raise ValueError(f"optimizer {type!r} (table {param.name!r}) is not one of {sorted(STATE)}")
    hyper = {
        k: v
        for k, v in {**get_op(type).attrs, **attrs}.items()
        if k not in _RESERVED and not k.startswith("_")
    }
    state = {
        s.name: StateSpec(s.out, [1] if s.scalar else list(param.shape), state_init(s, hyper))
        for s in state_slots(type, hyper)
    }
    return OptimizerSpec(type, hyper, state)


def insert_ps(program: Program, config: TranspileConfig | None = None) -> Tables:
    """Add pull/push ops to placed `program` and drop its optimizer ops (in place); return the
    table specs and the inserted ops' placement reasons."""
    config = config or TranspileConfig()
    prog, block = program, program.global_block()
    read, with_grad, other_use = _uses(prog)
    clipped = _clipped(prog)
    sparse = _sparse_tables(block, read, other_use, config)
    optim = _optimizers(prog, read, with_grad, config)
    rw = _Rewrite(prog, {})
    push_after = {grad_name(p): p for p in optim if p not in sparse}
    sparse_grads = {grad_name(w) for w in sparse}
    dense_read = read - sparse
    for op in prog.ops:
        if op.role == "optimize" or (op.type == "sum" and op.output_names()[0] in sparse_grads):
            continue
        if op.type in LOOKUPS and op.role != "backward" and op.inputs["W"][0] in sparse:
            _rewrite_lookup(rw, op)
        elif op.type in LOOKUP_GRADS and op.attrs.get("fwd_id") in rw.lookup:
            _rewrite_lookup_grad(rw, op, optim)
        else:
            _pull_push_dense(rw, op, dense_read, push_after)
    block.set_ops(rw.ops)
    specs = _specs(block, read | set(sparse), sparse, optim, prog.params, config)
    specs = [dataclasses.replace(t, clip_norm=clipped[t.name]) if t.name in clipped else t for t in specs]
    return Tables(specs, rw.reasons)


def _clipped(prog: Program) -> dict[str, float]:
    """{parameter: clip_norm} of the parameters whose gradient a `clip_by_global_norm` op clips
    before their update op reads it."""
    out: dict[str, float] = {}
    clips = [op for op in prog.ops if op.type == "clip_by_global_norm"]
    if len(clips) > 1:
        raise ValueError(
            f"the program has {len(clips)} clip_by_global_norm ops; the parameter servers "
            "clip one global norm per step: clip all gradients with one op"
        )
    for clip in clips:
        clipped = set(clip.outputs["Out"])
        for op in prog.ops:
            if op.role == "optimize" and "Param" in op.inputs and op.inputs["Grad"][0] in clipped:
                out[op.inputs["Param"][0]] = float(clip.attrs["clip_norm"])
    return out


def _uses(prog: Program) -> tuple[set[str], set[str], dict[str, Op]]:
    """(parameters trainer ops read, vars that get a gradient, parameter -> an op reading it that is
    not an embedding lookup); refuses unplaced ops and forward ops that write persistable state."""
    persistable = {n for n, v in prog.vars.items() if v.persistable}
    read: set[str] = set()
    with_grad: set[str] = set()
    other_use: dict[str, Op] = {}
    for op in prog.ops:
        if op.role == "optimize":
            continue
        if not op.device:
            raise ValueError(f"op {op.type!r} (id {op.id}) has no op_device; run assign_devices first")
        lookup = op.type in LOOKUPS or op.type in LOOKUP_GRADS
        for slot, names in op.inputs.items():
            params = persistable.intersection(names)
            read |= params
            if params and not (lookup and slot == "W"):
                for n in params:
                    other_use.setdefault(n, op)
        for n in op.output_names():
            if n in persistable:
                raise ValueError(
                    f"op {op.type!r} (id {op.id}) on {op.device} writes persistable var "
                    f"{n!r}; trainers hold no state: state updated by forward ops is not "
                    "supported"
                )
            if "@GRAD" in n:
                with_grad.add(n.split("@GRAD")[0])
    return read, with_grad, other_use


def _optimizers(prog: Program, read: set[str], with_grad: set[str], config: TranspileConfig) -> dict:
    """{parameter: optimizer spec}: from the program's optimize ops, else `config.optimizer` for every
    trainable parameter that gets a gradient."""
    block = prog.global_block()
    optim = {
        op.inputs["Param"][0]: optimizer_spec(op.type, op.attrs, block.var(op.inputs["Param"][0]))
        for op in prog.ops
        if op.role == "optimize" and "Param" in op.inputs  # (not clip_by_global_norm: see _clipped)
    }
    if optim:
        return optim
    hyper = {k: v for k, v in config.optimizer.items() if k != "type"}
    return {
        n: optimizer_spec(config.optimizer["type"], hyper, block.var(n))
        for n in sorted(read)
        if block.var(n).is_parameter and block.var(n).trainable and n in with_grad
    }


@dataclass
class _Rewrite:
    """The new op list being built, and what the rewrites share: pulled dense tables per trainer
    type, unique-ids vars per (ids, trainer type), and each rewritten lookup's table and vars."""

    prog: Program
    reasons: dict[str, str]
    ops: list[Op] = field(default_factory=list)
    pulled: set[tuple[str, str]] = field(default_factory=set)
    uniq: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    lookup: dict[int, tuple[str, str, str, str]] = field(default_factory=dict)  # id -> W, rows, u, ix

    def emit(self, type: str, ins: dict, outs: dict, attrs: dict, device: str, why: str) -> None:
        op = Op(type, ins, outs, {**attrs, "op_role": "ps", "op_device": device}, self.prog.new_id())
        self.reasons[str(op.id)] = f"inserted by insert_ps: {why}"
        self.ops.append(op)

    def new_var(self, name: str, **kw: Any) -> str:
        block = self.prog.global_block()
        if name not in block.vars:
            block.create_var(name, **kw)
        return name


def _rewrite_lookup(rw: _Rewrite, op: Op) -> None:
    """embedding(W, Ids) -> unique_ids(Ids) (once per ids and trainer type), pull_sparse, and the
    lookup gathering from the pulled rows."""
    block, dev = rw.prog.global_block(), op.device
    w, ids = op.inputs["W"][0], op.inputs["Ids"][0]
    table = block.var(w)
    if (ids, dev) not in rw.uniq:
        u = rw.new_var(f"{ids}@UNIQUE", shape=(-1,), dtype="int64")
        ix = rw.new_var(f"{ids}@INDEX", shape=block.var(ids).shape, dtype="int64")
        rw.emit(
            "unique_ids",
            {"Ids": [ids]},
            {"Unique": [u], "Index": [ix]},
            {},
            dev,
            f"unique ids of {ids!r} for sparse pulls on {dev}",
        )
        rw.uniq[(ids, dev)] = (u, ix)
    u, ix = rw.uniq[(ids, dev)]
    rows = rw.new_var(f"{w}@ROWS@{op.id}", shape=(-1, table.shape[1]), dtype=table.dtype)
    rw.emit(
        "pull_sparse",
        {"Ids": [u]},
        {"Out": [rows]},
        {"table": w, "dim": table.shape[1], "dtype": table.dtype},
        dev,
        f"rows of sparse table {w!r} for lookup id {op.id}",
    )
    rw.ops.append(block.update_op(op, inputs={"W": [rows], "Ids": [ix]}))
    rw.lookup[op.id] = (w, rows, u, ix)


def _rewrite_lookup_grad(rw: _Rewrite, op: Op, optim: dict) -> None:
    """The lookup's grad op works on the pulled rows; push_sparse sends their gradient."""
    block = rw.prog.global_block()
    w, rows, u, ix = rw.lookup[op.attrs["fwd_id"]]
    rw.ops.append(block.update_op(op, inputs={"W": [rows], "Ids": [ix]}))
    if any(op.outputs.get("W@GRAD", [])) and w in optim:
        g = rw.new_var(grad_name(rows), shape=(-1, block.var(w).shape[1]), dtype=block.var(w).dtype)
        block.update_op(op, outputs={"W@GRAD": [g]})
        rw.emit(
            "push_sparse",
            {"Ids": [u], "Grad": [g]},
            {},
            {"table": w},
            op.device,
            f"row gradients of sparse table {w!r} from lookup id {op.attrs['fwd_id']}",
        )


def _pull_push_dense(rw: _Rewrite, op: Op, dense_read: set[str], push_after: dict[str, str]) -> None:
    """pull_dense(P) before the first op reading P on a trainer type; push_dense(P@GRAD) after the
    op completing it."""
    dev = op.device
    for n in op.input_names():
        if n in dense_read and (n, dev) not in rw.pulled:
            v = rw.prog.var(n)
            rw.emit(
                "pull_dense",
                {},
                {"Out": [n]},
                {"table": n, "shape": list(v.shape), "dtype": v.dtype},
                dev,
                f"dense table {n!r} before its first use on {dev}",
            )
            rw.pulled.add((n, dev))
    rw.ops.append(op)
    for n in op.output_names():
        if n in push_after:
            rw.emit(
                "push_dense",
                {"Grad": [n]},
                {},
                {"table": push_after[n]},
                dev,
                f"gradient of {push_after[n]!r} after its last contribution",
            )


def _sparse_tables(block, read: set[str], other_use: dict[str, Op], config: TranspileConfig) -> set[str]:
    """Tables served by rows: config.sparse_tables, or every is_sparse parameter only looked up."""
    if config.sparse_tables is None:
        return {n for n in read if block.var(n).is_sparse and n not in other_use}
    for n in config.sparse_tables:
        if n not in read:
            raise ValueError(
                f"config.sparse_tables names {n!r}, which no trainer op reads; parameters "
                f"read: {sorted(read)}"
            )
        if n in other_use:
            op = other_use[n]
            raise ValueError(
                f"sparse table {n!r} is read by op {op.type!r} (id {op.id}), which is not an "
                "embedding lookup; serve it as a dense table (leave it out of sparse_tables)"
            )
    return set(config.sparse_tables)


def _specs(
    block, names: set[str], sparse: set[str], optim: dict, params: dict, config: TranspileConfig
) -> list[TableSpec]:
    """Table specs in name order; dense tables go to shards by bytes (`transpiler.cost.balance`)."""
    sizes = {n: table_bytes(block.var(n).shape, block.var(n).dtype) for n in names if n not in sparse}
    shard = balance(sizes, config.num_servers)
    stray = sorted(set(config.unbounded or ()) - sparse) if not isinstance(config.unbounded, bool) else []
    if stray:
        raise ValueError(
            f"TranspileConfig.unbounded names {stray}, which are not sparse tables of the program "
            f"(sparse tables: {sorted(sparse)})"
        )
    specs = []
    for n in sorted(names):
        v = block.var(n)
        if n in sparse:
            sharding = Sharding("id_hash", config.num_servers)
        else:
            sharding = Sharding("table", config.num_servers, shard[n])
        streaming = n in sparse
        unbounded = streaming and (config.unbounded is True or n in (config.unbounded or ()))
        specs.append(
            TableSpec(
                name=n,
                kind="sparse" if n in sparse else "dense",
                shape=[-1, *v.shape[1:]] if unbounded else list(v.shape),
                dtype=v.dtype,
                initializer=None if n in params else v.initializer,
                optimizer=optim.get(n),
                sharding=sharding,
                entry=dict(config.sparse_entry) if streaming and config.sparse_entry is not None else None,
                evict_after=config.evict_after if streaming else None,
                delta_every=config.checkpoint_delta_every if streaming else None,
                lifecycle=dict(config.lifecycle) if streaming and config.lifecycle is not None else None,
            )
        )
    return specs
