"""PSClient: pull and push across the shards of a parameter server.

A sparse pull is deduplicated, split by `shard_of(id)`, sent to all shards at once and reassembled
in the caller's order; a sparse push is merged to unique ids first (rows of repeated ids summed),
then split, and goes to every shard (with zero rows where it has none), so every shard sees one push
per pusher and step (sync mode counts on it; Adam's per-table step counters stay equal across
shards). Dense tables live whole on one shard (`place_dense`).

Requests are signed with `secret` and carry a random client id, an increasing sequence number and
the shard they are for (the server refuses replays, also to another shard); admin requests (assign,
save, load) are signed with `admin_secret` when given (the driver's key; see server.py). Every
request waits at most `timeout` seconds for its reply and then raises PSTimeoutError naming the
shard: a client never hangs on a dead or stuck server. A client is not thread-safe (ZeroMQ sockets
are not): give each thread its own. """

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from ops_registry import SparseRows
from transpiler.tables import TableSpec, tables_from_dicts

from ..telemetry import unpack_spans
from ..wire import AuthError, decode, encode
from . import checkpoint
from .server import ADMIN_OPS
from .shard import check_ids_given
from .sharding import place_dense, shard_of
from .table import PSError


def _sorted_unique(ids: np.ndarray) -> bool:
    """True for strictly increasing ids (np.unique's output): nothing to deduplicate."""
    return bool((ids[1:] > ids[:-1]).all())


class PSTimeoutError(PSError, TimeoutError):
    """A shard sent no reply within the client's timeout."""


class PSClient:
    def __init__(self, endpoints: Sequence[str], *, secret: bytes | None = None, timeout: float = 30.0,
                 pusher: int | str = 0, admin_secret: bytes | None = None) -> None:
        self.endpoints, self.secret, self.timeout = list(endpoints), secret, timeout
        self.admin_secret = admin_secret if admin_secret is not None else secret
        self.pusher = str(pusher)
        self._cid = os.urandom(8).hex()  # with _rid, the (sender, sequence number) a server checks
        self._ctx = zmq.Context.instance()
        self._socks = []
        for ep in self.endpoints:
            s = self._ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(ep)
            self._socks.append(s)
        self._rid = itertools.count()
        try:
            hello = self._call({k: ({"op": "hello"}, []) for k in range(len(self._socks))})
        except BaseException:
            self.close()
            raise
        first = hello[0][0]
        for k, (h, _) in hello.items():
            if h["shard"] != k or h["num_shards"] != len(self.endpoints) or h["tables"] != first["tables"]:
                self.close()
                raise PSError(f"endpoint {self.endpoints[k]} serves shard {h['shard']} of "
                              f"{h['num_shards']} (tables {[t['name'] for t in h['tables']]}); expected "
                              f"shard {k} of {len(self.endpoints)} with the tables of shard 0")
        self.mode = first["mode"]
        self.specs = {t.name: t for t in tables_from_dicts(first["tables"])}
        self._dense = place_dense(list(self.specs.values()), len(self.endpoints))

    # -- requests ---------------------------------------------------------------------------
    def _call(self, requests: dict[int, tuple[dict, list]]) -> dict[int, tuple[dict, list]]:
        """Send one request to each named shard, then wait for all replies."""
        keys = list(requests)
        return dict(zip(keys, self._exchange([(k, *requests[k]) for k in keys]), strict=True))

    def _exchange(self, requests: list[tuple[int, dict, list]]) -> list[tuple[dict, list]]:
        """Send every (shard, header, arrays) request at once — several to one shard are pipelined,
        so n requests cost one round trip — then wait for all replies (matched by request id)."""
        pending: dict[int, int] = {}  # rid -> index in requests
        due = dict.fromkeys((k for k, _, _ in requests), 0)
        for i, (k, header, arrays) in enumerate(requests):
            rid = next(self._rid)
            key = self.admin_secret if header.get("op") in ADMIN_OPS else self.secret
            frames = encode({**header, "rid": rid, "cid": self._cid, "seq": rid, "to": k}, arrays, key)
            self._socks[k].send_multipart(frames, copy=False)
            pending[rid] = i
            due[k] += 1
        poller = zmq.Poller()
        for k in due:
            poller.register(self._socks[k], zmq.POLLIN)
        out: list = [None] * len(requests)
        deadline = time.monotonic() + self.timeout
        while pending:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(max(0, left) * 1000)) if left > 0 else {}
            if not ready:
                late = sorted({f"shard {requests[i][0]} ({self.endpoints[requests[i][0]]})"
                               for i in pending.values()})
                op = requests[0][1].get("op")
                raise PSTimeoutError(f"no reply to {op!r} within {self.timeout} s from {', '.join(late)}; "
                                     "is the server running and reachable?")
            for k in [k for k in due if due[k] and self._socks[k] in ready]:
                h, arrays = self._reply(k, self._socks[k].recv_multipart(copy=False))
                rid = h.get("rid")
                if rid is None:  # a refusal that could not be read: it answers this shard's oldest request
                    rid = next(r for r, i in pending.items() if requests[i][0] == k)
                if rid not in pending:
                    continue  # the late reply to a request of an earlier call that timed out
                out[pending.pop(rid)] = (h, arrays)
                due[k] -= 1
                if not due[k]:
                    poller.unregister(self._socks[k])
        errors = [f"shard {k} ({self.endpoints[k]}): {h['error']}"
                  for (k, _, _), (h, _) in zip(requests, out, strict=True) if not h.get("ok")]
        if errors:
            raise PSError("; ".join(errors))
        return out

    def _reply(self, k: int, frames: list) -> tuple[dict, list]:
        try:
            return decode(frames, self.secret)
        except AuthError:
            h, arrays = decode(frames, None)  # an unsigned reply: the server's authentication refusal
            if h.get("ok") is False:
                return h, arrays
            raise AuthError(f"reply from shard {k} ({self.endpoints[k]}) failed authentication: "
                            "the server uses a different shared secret") from None

    # -- pull / push ------------------------------------------------------------------------
    def _spec(self, table: str) -> TableSpec:
        try:
            return self.specs[table]
        except KeyError:
            raise PSError(f"unknown table {table!r}; the servers hold {sorted(self.specs)}") from None

    def _check_ids(self, table: str, ids: Any, what: str) -> TableSpec:
        """The table's spec, after checking that ids come with a sparse table and only with one."""
        spec = self._spec(table)
        check_ids_given(spec.kind, table, ids, what)
        return spec

    def _split(self, ids: np.ndarray) -> list[np.ndarray]:
        """Per shard, the positions in `ids` of the ids it holds."""
        if len(self._socks) == 1:
            return [np.arange(ids.size)]
        owner = shard_of(ids, len(self._socks))
        return [np.flatnonzero(owner == k) for k in range(len(self._socks))]

    def pull(self, table: str, ids: np.ndarray | None = None, *, step: int | None = None,
             peek: bool = False) -> np.ndarray:
        """Dense: the parameter. Sparse: rows of `ids` (any shape), shape ids.shape + (dim,).

        In sync mode pass the trainer's `step` t: the reply waits until t steps are applied.
        `peek`: read without creating rows or touching admission counters (evaluation).
        """
        return self.pull_many([(table, ids)], step=step, peek=peek)[0]

    def pull_many(self, requests: Sequence[tuple[str, np.ndarray | None]], *,
                  step: int | None = None, peek: bool = False) -> list[np.ndarray]:
        """`pull` of several (table, ids or None) at once: all their shard requests are in flight
        together, so they cost one round trip, not one per table."""
        sends: list[tuple[int, dict, list]] = []
        plans = []  # per request: spec, ids' shape (None: dense), unique ids, inverse, [(send, positions)]
        for table, ids in requests:
            spec = self._check_ids(table, ids, "pull")
            base = {"op": "pull", "table": table, "step": step, **({"peek": True} if peek else {})}
            if spec.kind == "dense":
                plans.append((spec, None, 0, None, [(len(sends), None)]))
                sends.append((self._dense[table], base, []))
                continue
            ids = np.asarray(ids)
            flat = ids.reshape(-1).astype(np.int64)
            uniq, inv = (flat, None) if _sorted_unique(flat) else np.unique(flat, return_inverse=True)
            where = []
            for k, p in enumerate(self._split(uniq)):
                if p.size:
                    where.append((len(sends), p))
                    sends.append((k, base, [uniq[p]]))
            plans.append((spec, ids.shape, uniq.size, inv, where))
        replies = self._exchange(sends)
        out = []
        for spec, shape, n, inv, where in plans:
            if shape is None:
                out.append(replies[where[0][0]][1][0])
                continue
            rows = np.empty((n, spec.shape[1]), spec.dtype)
            for i, p in where:
                rows[p] = replies[i][1][0]
            out.append((rows if inv is None else rows[inv]).reshape(*shape, spec.shape[1]))
        return out

    def push(self, table: str, grad: np.ndarray | SparseRows, ids: np.ndarray | None = None, *,
             step: int | None = None) -> None:
        """Dense: `grad` of the parameter's shape. Sparse: row gradients `grad` [n, dim] of `ids` [n]
        (or a SparseRows). In sync mode pass the step t being pushed; in geo mode `grad` is a delta."""
        self.push_many([(table, grad, ids)], step=step)

    def push_many(self, requests: Sequence[tuple[str, np.ndarray | SparseRows, np.ndarray | None]], *,
                  step: int | None = None) -> None:
        """`push` of several (table, grad, ids or None) at once, in one round trip."""
        sends: list[tuple[int, dict, list]] = []
        for table, grad, ids in requests:
            if isinstance(grad, SparseRows):
                ids, grad = grad.rows, grad.values
            spec = self._check_ids(table, ids, "push")
            base = {"op": "push", "table": table, "step": step, "pusher": self.pusher}
            if spec.kind == "dense":
                sends.append((self._dense[table], base, [np.asarray(grad)]))
                continue
            ids, grad = np.asarray(ids).reshape(-1).astype(np.int64), np.asarray(grad)
            if grad.ndim != 2 or grad.shape[0] != ids.size:
                raise PSError(f"push to {table!r}: {ids.size} ids need a gradient of shape "
                              f"[{ids.size}, {spec.shape[1]}], got {list(grad.shape)}")
            if not _sorted_unique(ids):
                merged = SparseRows(ids, grad, 0).merged(np)
                ids, grad = merged.rows, merged.values
            sends += [(k, base, [ids[p], grad[p]]) for k, p in enumerate(self._split(ids))]
        self._exchange(sends)

    def assign(self, table: str, values: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Set a table's values: dense, the whole array; sparse, rows `ids` (e.g. imported weights,
        `ids=np.arange(vocab)`). Optimizer state is untouched."""
        if self._check_ids(table, ids, "assign").kind == "dense":
            self._call({self._dense[table]: ({"op": "assign", "table": table}, [np.asarray(values)])})
            return
        ids, values = np.asarray(ids).reshape(-1).astype(np.int64), np.asarray(values)
        self._call({k: ({"op": "assign", "table": table}, [ids[p], values[p]])
                    for k, p in enumerate(self._split(ids)) if p.size})

    # -- admin --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, **meta: Any) -> None:
        """Checkpoint every shard into directory `path` (on a file system the servers share, inside
        their checkpoint root), replacing the checkpoint there only once the new one is complete.
        `meta` (JSON values) goes into the manifest (e.g. `train`'s run state)."""
        stage = checkpoint.begin(path)
        try:
            replies = self._call({k: ({"op": "save", "dir": str(stage.resolve())}, [])
                                  for k in range(len(self._socks))})
            files = [e for k in sorted(replies) for e in replies[k][0]["files"]]
            checkpoint.finish(stage, path, list(self.specs.values()), files,
                              **{"num_shards": len(self._socks), "mode": self.mode, **meta})
        except BaseException:
            checkpoint.abort(stage)
            raise

    def load(self, path: str | os.PathLike, step: int | None = None) -> None:
        """Load checkpoint `path` (saved with any shard count) into every shard. `step`: count the
        tables' applied sync steps from there (a run resumed at `step`; else the saved counts)."""
        path = os.path.abspath(path)
        header = {"op": "load", "dir": path, **({"step": int(step)} if step is not None else {})}
        self._call({k: (header, []) for k in range(len(self._socks))})

    def stats(self) -> list[dict]:
        """Per shard: {table: {"rows": n, "bytes": memory held, "version": applied sync steps}}."""
        r = self._call({k: ({"op": "stats"}, []) for k in range(len(self._socks))})
        return [r[k][0]["tables"] for k in sorted(r)]

    def trace(self) -> list[list]:
        """Per shard, the spans it recorded since the last call (servers started with trace=True)."""
        r = self._call({k: ({"op": "trace"}, []) for k in range(len(self._socks))})
        return [unpack_spans(r[k][1][0]) for k in sorted(r)]

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks = []

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
