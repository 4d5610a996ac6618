"""The parameter server's request handlers: one function per request type of runtime/ps/protocol.py,
each taking an explicit `Context` and the typed request, returning the reply's fields and arrays
(`HANDLERS`). A handler raises a PSError to refuse a request, `NotReady` / `ParkPulls` when a sync
request must wait for its step (server.py parks it and serves it again once the step is applied).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from runtime.ps import held_tables
from runtime.ps import protocol as p
from runtime.ps.shard import Shard
from runtime.ps.types import NotReady, PSError
from runtime.telemetry.outputs import Recorder, pack_spans
from transpiler.tables import tables_to_dicts

Reply = tuple[dict[str, Any], list]  # a reply's fields (beside ok) and arrays


class ParkPulls(Exception):  # noqa: N818 (a signal, not an error)
    """The pushes of a push_pull are applied, its pulls must wait for `table`: park `request`."""

    def __init__(self, table: str, request: p.PushPull) -> None:
        super().__init__(table)
        self.table, self.request = table, request


@dataclass
class Context:
    """What a request handler may use: the shard, the server's checkpoint roots and trace recorder,
    `release(table)`, which answers the parked requests a step just applied lets go on, and
    `holders` (table -> the client name the plan gives it; None: any client may hold a table)."""

    shard: Shard
    roots: list[str]
    rec: Recorder
    release: Callable[[str], None]
    holders: dict[str, str] | None = None


def describe(e: Exception) -> str:
    """A refusal's own message; any other failure prefixed by its type (it is a server bug)."""
    return str(e) if isinstance(e, PSError) else f"{type(e).__name__}: {e}"


def checkpoint_dir(cx: Context, op: str, d: str) -> str:
    """`d`, when it lies inside a checkpoint root the server was started with."""
    if not cx.roots:
        raise PSError(
            f"{op!r} refused: this server was started without a checkpoint root "
            "(serve / Servers checkpoint_root=...), so it saves and loads nowhere"
        )
    real = os.path.realpath(d)
    if not any(os.path.commonpath([real, r]) == r for r in cx.roots):
        where = cx.roots[0] if len(cx.roots) == 1 else cx.roots
        raise PSError(
            f"{op!r} refused: {d!r} is outside the checkpoint root {where!r} this server was started with"
        )
    return real


# -- the handlers: one per request type --------------------------------------------------------------
def _hello(cx: Context, r: p.Hello) -> Reply:
    s = cx.shard
    return {
        "shard": s.shard,
        "num_shards": s.num_shards,
        "mode": s.mode,
        "tables": tables_to_dicts(s.specs),
        "session": r.session,
    }, []


def _pull(cx: Context, r: p.Pull) -> Reply:
    return {}, [cx.shard.pull(r.table, r.ids, r.step, peek=r.peek, copy=False)]


def _push(cx: Context, r: p.Push) -> Reply:
    if cx.shard.push(r.table, r.grad, r.ids, r.step, r.pusher, r.show_click):
        cx.release(r.table)
    return {}, []


def _push_pull(cx: Context, r: p.PushPull) -> Reply:
    """The pushes applied first, then the pulls answered. In sync mode a client pushes step t and
    pulls step t + 1: the pulls are parked until every pusher's step t is applied (fused push +
    pull: one round trip per step)."""
    s, applied = cx.shard, []
    try:
        for t, a in r.pushes:
            ids, grad, shows = p.push_arrays(a)
            if s.push(t, grad, ids, r.step, r.pusher, shows):
                applied.append(t)
    finally:  # (a refused part refuses the request; what was applied before it stays applied)
        for table in applied:
            cx.release(table)
    try:
        return {}, [s.pull(t, a[0] if a else None, r.pull_step, peek=r.peek, copy=False) for t, a in r.pulls]
    except NotReady as e:
        raise ParkPulls(e.args[0], replace(r, pushes=[])) from None  # (the pushes are done)


def _norm(cx: Context, r: p.Norm) -> Reply:
    return {"sum_squares": cx.shard.clip_sum_squares(r.step)}, []


def _apply(cx: Context, r: p.Apply) -> Reply:
    for table in cx.shard.clip_apply(r.step, r.scale):
        cx.release(table)
    return {}, []


def _hold(cx: Context, r: p.Hold) -> Reply:
    if cx.holders is not None:
        who, may = r.holder.split("/", 1)[0], cx.holders.get(r.table)
        if who != may:
            allowed = f"the plan gives it to {may!r}" if may else "the plan gives it to no trainer"
            raise PSError(f"hold of table {r.table!r} by {who!r} refused: {allowed}")
    state = held_tables.hold(cx.shard, r.table, r.holder)
    return {"keys": list(state)}, list(state.values())


def _write_back(cx: Context, r: p.WriteBack) -> Reply:
    held_tables.write_back(cx.shard, r.table, r.keys, r.states, r.steps, r.final, r.holder)
    return {}, []


def _assign(cx: Context, r: p.Assign) -> Reply:
    cx.shard.assign(r.table, r.values, r.ids)
    return {}, []


def _save(cx: Context, r: p.Save) -> Reply:
    return {"files": cx.shard.save(checkpoint_dir(cx, r.OP, r.dir))}, []


def _load(cx: Context, r: p.Load) -> Reply:
    cx.shard.load(checkpoint_dir(cx, r.OP, r.dir), r.step)
    return {}, []


def _shrink(cx: Context, r: p.Shrink) -> Reply:
    return {"removed": cx.shard.shrink()}, []  # {table: rows removed} of the tables with a lifecycle


def _stats(cx: Context, r: p.Stats) -> Reply:
    return {"tables": cx.shard.table_stats()}, []  # (rows, bytes, steps; a sparse table's counts)


def _trace(cx: Context, r: p.Trace) -> Reply:
    return {}, [pack_spans(cx.rec.take())]


HANDLERS: dict[type, Callable[[Context, Any], Reply]] = {
    p.Hello: _hello,
    p.Pull: _pull,
    p.Push: _push,
    p.PushPull: _push_pull,
    p.Norm: _norm,
    p.Apply: _apply,
    p.Hold: _hold,
    p.WriteBack: _write_back,
    p.Assign: _assign,
    p.Save: _save,
    p.Load: _load,
    p.Shrink: _shrink,
    p.Stats: _stats,
    p.Trace: _trace,
}  # (Shutdown: the loop's own)
