"""`simulate`: the reference runner of a Plan, in one process — the oracle for the real runtime.

Each trainer type gets an `Executor` whose handlers (`runtime.exec.comm_ops`, the table every runner
shares) do the comm and PS ops in memory (`MemoryComm`): `send` drops the tensor in a mailbox keyed
by (tensor, micro-batch id, destination), `recv` takes it out, pulls and pushes talk to an
`InMemoryServer`. One step runs every sub-program's segments
(cut at recv ops) in the order `transpiler.passes.schedule.schedule` finds, so a plan that could deadlock
fails here with a `DeadlockError` naming the waiting recvs. The server has sync semantics: a step's
pushes are summed per table and applied once, after every trainer has finished the step, with the
registry's optimizer kernels — so a correct plan reproduces single-process training.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ops_registry import SparseRows, get_op, init_rows
from ops_registry.embedding import check_ids
from runtime.exec.comm_ops import comm_handlers
from runtime.exec.executor import Executor, RunContext
from transpiler.ir import Var
from transpiler.passes.schedule import schedule, segment_programs
from transpiler.plan import Plan
from transpiler.tables import TableSpec


class InMemoryServer:
    """Every table of a plan as a full numpy array (sparse ones too), with its optimizer state.

    Values start from the plan's `params` or the table's initializer (the startup program's values).
    `push` queues a gradient; `apply` sums each table's queued gradients (the registry's `sum`:
    dense adds, row-sparse concatenates), clips the sums of tables with a `clip_norm` together (the
    registry's `clip_by_global_norm`) and runs each table's optimizer kernel once.

    It does not reuse the sync `runtime.ps.shard.Shard` on purpose: this server is the oracle the
    real parameter servers are tested against, so it shares none of their code (row index, sharding,
    table optimizers, step bookkeeping) and applies the registry's optimizer kernels, the ones
    single-process training runs, to whole arrays; a bug in the shard then shows as a difference
    instead of being copied into the reference.
    """

    def __init__(self, plan: Plan) -> None:
        self.specs = {t.name: t for t in plan.tables}
        self.values: dict[str, np.ndarray] = {}
        self.state: dict[str, dict[str, np.ndarray]] = {}
        for name, t in self.specs.items():
            if name in plan.params:
                self.values[name] = np.array(plan.params[name], dtype=t.dtype)
            elif t.initializer is not None:
                self.values[name] = init_rows(t.initializer, tuple(t.shape), t.dtype)
            else:
                raise ValueError(
                    f"table {name!r} has neither an initializer nor a value in the plan's params"
                )
            state = (t.optimizer.state or {}) if t.optimizer else {}
            self.state[name] = {slot: np.full(s.shape, s.init, dtype=t.dtype) for slot, s in state.items()}
        self.pending: dict[str, list[Any]] = {}

    def _spec(self, table: str) -> TableSpec:
        if table not in self.specs:
            raise KeyError(f"no table {table!r} on the server; tables: {sorted(self.specs)}")
        return self.specs[table]

    def pull(self, table: str, ids: np.ndarray | None = None) -> np.ndarray:
        """A copy of the whole table, or of rows `ids` (checked against the table's height)."""
        value = self.values[self._spec(table).name]
        if ids is None:
            return value.copy()
        ids = np.asarray(ids)
        try:
            check_ids(np, ids, value.shape[0])
        except IndexError as e:
            raise IndexError(f"pull of table {table!r}: {e}") from None
        return value[ids]

    def push(self, table: str, grad: Any, ids: np.ndarray | None = None) -> None:
        """Queue a gradient: dense, `SparseRows`, or (with `ids`) one summed row per unique id."""
        spec = self._spec(table)
        if not spec.optimizer:
            raise ValueError(f"push to table {table!r}, which has no optimizer (frozen)")
        if ids is not None:
            grad = SparseRows(np.asarray(ids), grad, spec.shape[0])
        self.pending.setdefault(table, []).append(grad)

    def apply(self) -> None:
        """Apply every queued gradient: one optimizer step per table on the sum of its pushes."""
        total = get_op("sum").kernel
        sums = {
            t: g[0] if len(g) == 1 else total(np, {"data_0": g}, {})["sum"] for t, g in self.pending.items()
        }
        clipped = [t for t in sums if self.specs[t].clip_norm is not None]
        if clipped:  # the registry's clip_by_global_norm, as single-process training runs it
            clip = {"clip_norm": self.specs[clipped[0]].clip_norm}
            out = get_op("clip_by_global_norm").kernel(np, {"X": [sums[t] for t in clipped]}, clip)["Out"]
            sums.update(zip(clipped, out, strict=True))
        for table, grad in sums.items():
            opt = self.specs[table].optimizer
            kernel = get_op(opt.type).kernel
            outs = kernel(
                np, {"Param": self.values[table], "Grad": grad, **self.state[table]}, dict(opt.hyper)
            )
            self.values[table] = outs["ParamOut"]
            for slot, s in (opt.state or {}).items():
                self.state[table][slot] = outs[s.out]
        self.pending = {}

    def value(self, table: str) -> np.ndarray:
        return self.values[self._spec(table).name]


def simulate(
    plan: Plan,
    batches: Iterable[dict[str, Any]],
    fetch_list: list[str | Var] | None = None,
    server: InMemoryServer | None = None,
) -> list[list[np.ndarray]]:
    """Run `plan` one step per feed dict of `batches`; return, per step, the fetched arrays.

    `fetch_list` defaults to the loss. Pass a `server` to read the tables afterwards
    (`server.value(name)`) or to continue training from it. Micro-batch id = step index.
    """
    server = server or InMemoryServer(plan)
    if fetch_list is None:
        if not plan.loss_name:
            raise ValueError("the plan has no loss; give simulate a fetch_list")
        fetch_list = [plan.loss_name]
    names = [f.name if isinstance(f, Var) else f for f in fetch_list]
    owner = {n: _owner(plan, n) for n in names}
    order = schedule(plan.programs)
    segs = {t: segment_programs(p) for t, p in plan.programs.items()}
    mailbox: dict[tuple[str, int, str], Any] = {}
    exes = {t: Executor(handlers=comm_handlers(MemoryComm(t, mailbox, server))) for t in plan.programs}
    results = []
    for i, feed in enumerate(batches):
        envs: dict[str, dict[str, Any]] = {t: {} for t in plan.programs}
        for t, k in order:
            seg = segs[t][k]
            outs = [n for op in seg.ops for n in op.output_names()]
            got = exes[t].run(
                seg, feed=feed, fetch_list=outs, return_numpy=False, scope=envs[t], ctx=RunContext(i)
            )
            envs[t].update(zip(outs, got, strict=True))
        if mailbox:
            left = ", ".join(f"{n!r} -> {d}" for n, _, d in mailbox)
            raise RuntimeError(f"step {i}: messages sent but never received: {left}")
        server.apply()
        results.append([np.asarray(envs[owner[n]][n]) for n in names])
    return results


class MemoryComm:
    """The comm / PS ops of trainer type `me` in one process (a `comm_ops.CommBackend`): `send`
    drops a tensor in `mailbox` under (tensor, step, destination), `recv` takes it out; pulls and
    pushes go to the oracle `server`."""

    def __init__(self, me: str, mailbox: dict[tuple[str, int, str], Any], server: InMemoryServer) -> None:
        self.me, self.mailbox, self.server = me, mailbox, server

    def send(self, ctx: RunContext, dst: str, name: str, value: Any) -> None:
        self.mailbox[(name, ctx.step, dst)] = value

    def recv(self, ctx: RunContext, name: str) -> Any:
        return self.mailbox.pop((name, ctx.step, self.me))

    def pull_dense(self, ctx: RunContext, table: str) -> np.ndarray:
        return self.server.pull(table)

    def pull_sparse(self, ctx: RunContext, table: str, ids_name: str, ids: Any) -> np.ndarray:
        return self.server.pull(table, ids)

    def push_dense(self, ctx: RunContext, table: str, grad: Any) -> None:
        self.server.push(table, grad)

    def push_sparse(self, ctx: RunContext, table: str, ids: Any, grad: Any) -> None:
        rows = grad.to_dense(np) if isinstance(grad, SparseRows) else grad  # one summed row per id
        self.server.push(table, rows, ids)


def _owner(plan: Plan, name: str) -> str:
    for t, p in plan.programs.items():
        if any(name in op.output_names() for op in p.ops if op.role != "comm"):
            return t
    tables = [t.name for t in plan.tables]
    hint = " (it is a table: read it with server.value)" if name in tables else ""
    raise KeyError(f"fetch {name!r}: no trainer of the plan computes it{hint}")
