"""The one handler table for the ops that are not kernels: send / recv and parameter-server pulls
and pushes (and the loss-gradient seed, which a trainer scales to its micro-batch, and
`unique_ids`, which a reader answers from its step's one sort of the ids).

An op handler reads the op's slots and attributes and leaves the work to a *backend*, the part that
differs between runners: the trainer process (ZeroMQ peers, PS client, per-step buffers:
`runtime.trainer.process`), `simulate`'s in-memory mailbox and oracle server, a test's threads. A backend
implements the methods of `CommBackend` it supports; `comm_handlers(backend)` gives the Executor
handlers for exactly those, so an op the backend lacks still fails at compile time as "no kernel
and no runtime handler". Every method gets the run's `ctx` (what `Executor.run` was given).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ops_registry import get_op
from runtime.exec.executor import Handler
from transpiler.ir import Op


class CommBackend(Protocol):
    """What a runner does for each comm / PS op (implement those it supports)."""

    def send(self, ctx: Any, dst: str, name: str, value: Any) -> None: ...
    def recv(self, ctx: Any, name: str) -> Any: ...
    def pull_dense(self, ctx: Any, table: str) -> Any: ...
    def pull_sparse(self, ctx: Any, table: str, ids_name: str, ids: Any) -> Any: ...
    def push_dense(self, ctx: Any, table: str, grad: Any) -> None: ...
    def push_sparse(self, ctx: Any, table: str, ids: Any, grad: Any) -> None: ...
    def unique_ids(self, ctx: Any, ids_name: str, ids: Any) -> dict[str, Any]: ...


def _send(b: Any) -> Handler:
    def send(op: Op, values: dict[str, Any], ctx: Any) -> None:
        b.send(ctx, op.attrs["dst"], op.attrs["tensor"], values[op.inputs["X"][0]])

    return send


def _recv(b: Any) -> Handler:
    def recv(op: Op, values: dict[str, Any], ctx: Any) -> None:
        values[op.outputs["Out"][0]] = b.recv(ctx, op.attrs["tensor"])

    return recv


def _pull_dense(b: Any) -> Handler:
    def pull_dense(op: Op, values: dict[str, Any], ctx: Any) -> None:
        values[op.outputs["Out"][0]] = b.pull_dense(ctx, op.attrs["table"])

    return pull_dense


def _pull_sparse(b: Any) -> Handler:
    def pull_sparse(op: Op, values: dict[str, Any], ctx: Any) -> None:
        ids = op.inputs["Ids"][0]
        values[op.outputs["Out"][0]] = b.pull_sparse(ctx, op.attrs["table"], ids, values[ids])

    return pull_sparse


def _push_dense(b: Any) -> Handler:
    def push_dense(op: Op, values: dict[str, Any], ctx: Any) -> None:
        b.push_dense(ctx, op.attrs["table"], values[op.inputs["Grad"][0]])

    return push_dense


def _push_sparse(b: Any) -> Handler:
    def push_sparse(op: Op, values: dict[str, Any], ctx: Any) -> None:
        b.push_sparse(ctx, op.attrs["table"], values[op.inputs["Ids"][0]], values[op.inputs["Grad"][0]])

    return push_sparse


def _unique_ids(b: Any) -> Handler:
    """`unique_ids` (a kernel op) through the backend, which may answer from a sort it already made
    (a reader's one sort of a step's ids: `trainer_ps.PSAccess.unique_ids`)."""

    def unique_ids(op: Op, values: dict[str, Any], ctx: Any) -> None:
        ids = op.inputs["Ids"][0]
        got = b.unique_ids(ctx, ids, values[ids])
        values[op.outputs["Unique"][0]], values[op.outputs["Index"][0]] = got["Unique"], got["Index"]

    return unique_ids


MAKERS = {
    "send": _send,
    "recv": _recv,
    "pull_dense": _pull_dense,
    "pull_sparse": _pull_sparse,
    "push_dense": _push_dense,
    "push_sparse": _push_sparse,
    "unique_ids": _unique_ids,
}


def seeded_fill(xp: Any, seed_id: int | None, rescale: Callable[[Any, float], float]) -> Handler:
    """A `fill_constant` handler: the registry's kernel, with the value of op `seed_id` (the seed
    of the loss gradient) replaced by `rescale(ctx, value)` (e.g. scaled to a micro-batch's share
    of its global batch)."""
    fill = get_op("fill_constant")

    def fill_constant(op: Op, values: dict[str, Any], ctx: Any) -> None:
        ins = {"Like": values[op.inputs["Like"][0]]} if op.inputs.get("Like") else {}
        attrs = {**fill.attrs, **op.attrs}
        if op.id == seed_id:
            attrs["value"] = rescale(ctx, attrs["value"])
        values[op.outputs["Out"][0]] = fill.kernel(xp, ins, attrs)["Out"]

    return fill_constant


def comm_handlers(backend: Any) -> dict[str, Handler]:
    """Executor handlers for the comm / PS ops `backend` implements (see `CommBackend`)."""
    return {kind: make(backend) for kind, make in MAKERS.items() if callable(getattr(backend, kind, None))}
