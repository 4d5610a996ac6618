"""PSClient: pull and push across the shards of a parameter server.

A sparse pull is deduplicated, split by `shard_of(id)`, sent to all shards at once and reassembled
in the caller's order; a sparse push is merged to unique ids first (rows of repeated ids summed),
then split, and goes to every shard (with zero rows where it has none), so every shard sees one push
per pusher and step (sync mode counts on it; Adam's per-table step counters stay equal across
shards). Dense tables live whole on one shard (`place_dense`).

Requests are signed with the client's own key — `client_key` as the driver hands it to a trainer,
or derived here from the shards' master `secret` — under its name (`pusher`), and carry a sender id
"name/instance", the session its hello opened on each shard, an increasing sequence number and the
shard they are for (the server refuses replays, also to another shard); admin requests (assign,
save, load) are signed with `admin_secret` when given (the driver's key; see server.py). Every
request waits at most `timeout` seconds for its reply and then raises PSTimeoutError naming the
shard: a client never hangs on a dead or stuck server. `watch`, when given, is called at least five
times a second while a request waits for its reply (the driver names a shard that died or stopped
there, instead of waiting out the timeout: it raises). A client is not thread-safe (ZeroMQ sockets
are not): give each thread its own."""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from ops_registry import SparseRows
from ops_registry.base import RowMerge
from ops_registry.optimizer import global_norm_scale
from runtime.ps import checkpoint
from runtime.ps import protocol as p
from runtime.ps.index import strictly_increasing
from runtime.ps.pulls import ALL, assemble, one_pull_per_table
from runtime.ps.sharding import place_dense, shard_of
from runtime.ps.types import PSError, check_ids_given
from runtime.telemetry.outputs import unpack_spans
from runtime.transport import zap
from runtime.transport.shm import ShmRing, ShmSegments, shm_dir
from runtime.transport.wire import AuthError, WireError, decode, decode_signed, encode, wire_array
from runtime.transport.wire import client_key as wire_client_key
from transpiler.tables import TableSpec, tables_from_dicts

WATCH_S = 0.2  # the longest a waiting request goes without calling its client's `watch`


class PSTimeoutError(PSError, TimeoutError):
    """A shard sent no reply within the client's timeout."""


class PSClient:
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        secret: bytes | None = None,
        timeout: float = 30.0,
        pusher: int | str = 0,
        admin_secret: bytes | None = None,
        watch: Callable[[], None] | None = None,
        client_key: bytes | None = None,
    ) -> None:
        self.endpoints, self.timeout = list(endpoints), timeout
        self.watch = watch
        self.pusher = str(pusher)
        if "/" in self.pusher:
            raise PSError(f"a client's name (pusher) may not contain '/', got {self.pusher!r}")
        if client_key is None and secret is not None:
            client_key = wire_client_key(secret, self.pusher)
        self.secret = self._key = client_key  # (None: the servers authenticate nothing)
        self.admin_secret = admin_secret
        self._keys = tuple(k for k in (client_key, admin_secret) if k is not None)  # replies' keys
        self._cid = f"{self.pusher}/{os.urandom(8).hex()}"  # with _rid, what a server's Sessions check
        self._sess: dict[int, str] = {}  # shard -> the session its hello opened
        self._ctx = zmq.Context.instance()
        monitors = self._connect()
        self._rid = itertools.count()
        # same-host servers of a local run: large arrays through shared memory (runtime.transport.channels)
        shm = shm_dir(self.endpoints[0]) if self._key is not None else None
        self._segments = None if shm is None else ShmSegments(shm)
        self._rings: list[ShmRing | None] = [None] * len(self.endpoints)
        try:
            self.watch = functools.partial(self._refused_at_handshake, monitors, watch)
            hello = self._call({k: p.Hello() for k in range(len(self._socks))})
        except BaseException:
            self.close()
            raise
        finally:
            self.watch = watch
            for sock, mon in zip(self._socks, monitors, strict=False):
                sock.disable_monitor()
                mon.close()
        first = hello[0][0]
        self._sess = {k: h.get("session") or "" for k, (h, _) in hello.items()}
        for k, (h, _) in hello.items():
            if h["shard"] != k or h["num_shards"] != len(self.endpoints) or h["tables"] != first["tables"]:
                self.close()
                raise PSError(
                    f"endpoint {self.endpoints[k]} serves shard {h['shard']} of "
                    f"{h['num_shards']} (tables {[t['name'] for t in h['tables']]}); expected "
                    f"shard {k} of {len(self.endpoints)} with the tables of shard 0"
                )
        self.mode = first["mode"]
        self.specs = {t.name: t for t in tables_from_dicts(first["tables"])}
        self._dense = place_dense(list(self.specs.values()), len(self.endpoints))

    def _connect(self) -> list[zmq.Socket]:
        """A DEALER socket per shard, logged in with this client's key (zap.py); the monitor sockets
        of their handshake failures (a shard refusing the key), for the hellos."""
        self._socks, monitors = [], []
        for ep in self.endpoints:
            s = self._ctx.socket(zmq.DEALER)
            s.linger = 0
            if self._key is not None:
                zap.credentials(s, self.pusher, self._key)
            monitors.append(s.get_monitor_socket(zap.HANDSHAKE_FAILED))
            s.connect(ep)
            self._socks.append(s)
        return monitors

    def _refused_at_handshake(self, monitors: list[zmq.Socket], watch: Callable[[], None] | None) -> None:
        """PSError when a shard refused this client's connection (no key, or another run's), else `watch`."""
        for k, mon in enumerate(monitors):
            if mon.poll(0):
                mon.recv_multipart()
                raise PSError(
                    f"shard {k} ({self.endpoints[k]}): authentication failed: it refused the connection "
                    "(this client has no key, or a key of other servers)"
                )
        if watch is not None:
            watch()

    # -- requests ---------------------------------------------------------------------------
    def _call(self, requests: dict[int, p.Request]) -> dict[int, tuple[dict, list]]:
        """Send one request to each named shard, then wait for all replies."""
        keys = list(requests)
        return dict(zip(keys, self._exchange([(k, requests[k]) for k in keys]), strict=True))

    def _exchange(self, requests: list[tuple[int, p.Request]]) -> list[tuple[dict, list]]:
        """Send every (shard, request) at once — several to one shard are pipelined, so n requests
        cost one round trip — then wait for all replies (matched by request id)."""
        pending: dict[int, int] = {}  # rid -> index in requests
        due = dict.fromkeys((k for k, _ in requests), 0)
        deadline = time.monotonic() + self.timeout
        for i, (k, req) in enumerate(requests):
            rid = next(self._rid)
            self._queue(k, req.OP, self._frames(k, req, rid), deadline)
            pending[rid] = i
            due[k] += 1
        poller = zmq.Poller()
        for k in due:
            poller.register(self._socks[k], zmq.POLLIN)
        out: list = [None] * len(requests)
        while pending:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(min(left, WATCH_S) * 1000)) if left > 0 else {}
            if self.watch is not None:
                self.watch()
            if not ready and time.monotonic() < deadline:
                continue
            if not ready:
                late = sorted(
                    {f"shard {requests[i][0]} ({self.endpoints[requests[i][0]]})" for i in pending.values()}
                )
                op = requests[0][1].OP
                raise PSTimeoutError(
                    f"no reply to {op!r} within {self.timeout} s from {', '.join(late)}; "
                    "is the server running and reachable?"
                )
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
        errors = [
            f"shard {k} ({self.endpoints[k]}): {h['error']}"
            for (k, _), (h, _) in zip(requests, out, strict=True)
            if not h.get("ok")
        ]
        if errors:
            raise PSError("; ".join(errors))
        return out

    def _queue(self, k: int, op: str, frames: list, deadline: float) -> None:
        """Queue `frames` for shard k. A socket with no connection to hand them to (the shard refused
        this client's login and ZeroMQ is between reconnects, or it is not up yet) would block a plain
        send forever: wait for one until `deadline`, watching (a refused login raises), then times out."""
        sock = self._socks[k]
        while True:
            try:
                return sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if self.watch is not None:
                    self.watch()
                if (left := deadline - time.monotonic()) <= 0:
                    raise PSTimeoutError(
                        f"could not send {op!r} to shard {k} ({self.endpoints[k]}) within {self.timeout} s: "
                        "no connection; is the server running and reachable?"
                    ) from None
                sock.poll(min(left, WATCH_S) * 1000, zmq.POLLOUT)

    def _frames(self, k: int, req: p.Request, rid: int) -> list:
        """Request `req` to shard k as frames: signed with the admin key (an admin request) or this
        client's, its arrays through the shared-memory ring when they fit."""
        arrays = req.arrays()
        admin = req.OP in p.ADMIN_OPS and self.admin_secret is not None
        key, sender = (self.admin_secret, None) if admin else (self._key, self.pusher)
        header = {**req.header(), "rid": rid, "cid": self._cid, "seq": rid, "to": k}
        if k in self._sess:
            header["sess"] = self._sess[k]
        if self._segments is not None:
            header["shm_reply"] = True
            ring = self._ring(k) if arrays else None
            if ring is not None and (
                desc := ring.put(arrays := [wire_array(i, a) for i, a in enumerate(arrays)])
            ):
                header["shm"], arrays = desc, ()
        return encode(header, arrays, key, None if key is None else sender)

    def _ring(self, k: int) -> ShmRing | None:
        """The shared-memory ring of requests to shard k (None: it cannot be made, e.g. /dev/shm full)."""
        if self._rings[k] is None:
            try:
                self._rings[k] = ShmRing(self._segments.dir, f"ps{k}-requests", p.PS_RING_BYTES)
            except OSError:
                return None
        return self._rings[k]

    def _reply(self, k: int, frames: list) -> tuple[dict, list]:
        try:
            signed = decode_signed(frames, self._keys)
            h, arrays = signed.header, signed.arrays
            if "shm" in h:
                if self._segments is None or arrays:
                    raise WireError(
                        f"shard {k} replied through shared memory, which this client did not ask for"
                    )
                arrays = self._segments.arrays(h.pop("shm"))
            return h, arrays
        except AuthError:
            h, arrays = decode(frames, None)  # an unsigned reply: the server's authentication refusal
            if h.get("ok") is False:
                return h, arrays
            raise AuthError(
                f"reply from shard {k} ({self.endpoints[k]}) failed authentication: "
                "the server uses a different shared secret"
            ) from None

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

    def _split(self, ids: np.ndarray) -> list[np.ndarray | slice]:
        """Per shard, the positions in `ids` of the ids it holds (one shard: `ALL`, no copy)."""
        if len(self._socks) == 1:
            return [ALL]
        owner = shard_of(ids, len(self._socks))
        return [np.flatnonzero(owner == k) for k in range(len(self._socks))]

    def pull(
        self, table: str, ids: np.ndarray | None = None, *, step: int | None = None, peek: bool = False
    ) -> np.ndarray:
        """Dense: the parameter. Sparse: rows of `ids` (any shape), shape ids.shape + (dim,).

        In sync mode pass the trainer's `step` t: the reply waits until t steps are applied.
        `peek`: read without creating rows or touching admission counters (evaluation).
        """
        return self.pull_many([(table, ids)], step=step, peek=peek)[0]

    def pull_many(
        self,
        requests: Sequence[tuple[str, np.ndarray | None]],
        *,
        step: int | None = None,
        peek: bool = False,
    ) -> list[np.ndarray]:
        """`pull` of several (table, ids or None) at once: one request per shard for all of them,
        all in flight together, so they cost one round trip, not one per table."""
        requests, split = one_pull_per_table(requests)
        parts, plans = self._pull_parts(requests)
        return split(assemble(plans, self._send([], parts, step=None, pull_step=step, peek=peek)))

    def push(
        self,
        table: str,
        grad: np.ndarray | SparseRows,
        ids: np.ndarray | None = None,
        *,
        step: int | None = None,
    ) -> None:
        """Dense: `grad` of the parameter's shape. Sparse: row gradients `grad` [n, dim] of `ids` [n]
        (or a SparseRows). In sync mode pass the step t being pushed; in geo mode `grad` is a delta."""
        self.push_many([(table, grad, ids)], step=step)

    def push_many(
        self,
        requests: Sequence[tuple[str, np.ndarray | SparseRows, np.ndarray | None]],
        *,
        step: int | None = None,
    ) -> None:
        """`push` of several (table, grad, ids or None) at once, in one round trip. A sparse one may
        be (table, grad, ids, show_click): [n, 2] float32 (show, click) per id, which the shards add
        to the rows' statistics (a table with a `lifecycle`, runtime/ps/lifecycle.py)."""
        self._send(self._push_parts(requests), [], step=step, pull_step=None)

    def push_pull(
        self,
        pushes: Sequence[tuple[str, np.ndarray | SparseRows, np.ndarray | None]],
        pulls: Sequence[tuple[str, np.ndarray | None]],
        *,
        step: int | None = None,
    ) -> list[np.ndarray]:
        """`push_many(pushes, step=step)` then `pull_many(pulls)` of the next step, fused: one
        request per shard, which applies its part of the pushes and then answers its part of the
        pulls, so a step costs one round trip. In sync mode (`step` = t) the pulls are for step
        t + 1: each shard answers once every pusher's step t is applied there. In async mode
        (`step` None) the rows already include these pushes. Returns what `pull_many` returns."""
        pulls, split = one_pull_per_table(pulls)
        parts, plans = self._pull_parts(pulls)
        pushed = self._push_parts(pushes)
        return split(
            assemble(
                plans, self._send(pushed, parts, step=step, pull_step=None if step is None else step + 1)
            )
        )

    def _pull_parts(self, requests: Sequence[tuple[str, np.ndarray | None]]) -> tuple[list, list]:
        """The (shard, table, arrays) parts of pulls, and per pull the plan to reassemble its rows:
        (spec, ids' shape (None: dense), number of unique ids, inverse, [(part, positions)])."""
        parts: list[tuple[int, str, list]] = []
        plans = []
        for table, ids in requests:
            spec = self._check_ids(table, ids, "pull")
            if spec.kind == "dense":
                plans.append((spec, None, 0, None, [(len(parts), None)]))
                parts.append((self._dense[table], table, []))
                continue
            ids = np.asarray(ids)
            flat = ids.reshape(-1).astype(np.int64)
            uniq, inv = (flat, None) if strictly_increasing(flat) else np.unique(flat, return_inverse=True)
            where = []
            for k, pos in enumerate(self._split(uniq)):
                if pos is ALL or pos.size:
                    where.append((len(parts), pos))
                    parts.append((k, table, [uniq[pos]]))
            plans.append((spec, ids.shape, uniq.size, inv, where))
        return parts, plans

    def _push_parts(
        self, requests: Sequence[tuple[str, np.ndarray | SparseRows, np.ndarray | None]]
    ) -> list[tuple[int, str, list]]:
        """The (shard, table, arrays) parts of pushes: a sparse one goes to every shard (merged to
        unique ids, zero rows where a shard has none)."""
        parts: list[tuple[int, str, list]] = []
        last: tuple[np.ndarray, RowMerge] | None = None  # tables pushed for the same ids share a sort
        for table, grad, ids, *shows in requests:
            if isinstance(grad, SparseRows):
                ids, grad = grad.rows, grad.values
            spec = self._check_ids(table, ids, "push")
            if spec.kind == "dense":
                parts.append((self._dense[table], table, [np.asarray(grad)]))
                continue
            ids, grad = np.asarray(ids).reshape(-1).astype(np.int64), np.asarray(grad)
            arrays = [grad, *(np.asarray(sc, np.float32) for sc in shows if sc is not None)]
            if grad.ndim != 2 or grad.shape[0] != ids.size or any(a.shape[0] != ids.size for a in arrays):
                raise PSError(
                    f"push to {table!r}: {ids.size} ids need a gradient of shape "
                    f"[{ids.size}, {spec.shape[1]}] (and a show/click of [{ids.size}, 2]), got "
                    f"{[list(a.shape) for a in arrays]}"
                )
            if not strictly_increasing(ids):
                if last is None or not np.array_equal(last[0], ids):
                    last = (ids, RowMerge.of(np, ids))
                ids, arrays = last[1].unique_rows, [last[1].sum(np, a) for a in arrays]
            parts += [
                (k, table, [ids[pos], *(a[pos] for a in arrays)]) for k, pos in enumerate(self._split(ids))
            ]
        return parts

    def _send(
        self,
        pushes: list[tuple[int, str, list]],
        pulls: list[tuple[int, str, list]],
        *,
        step: int | None,
        pull_step: int | None,
        peek: bool = False,
    ) -> list[np.ndarray]:
        """One request per shard for its push and pull parts (a plain push or pull when it has one
        part, else a push_pull); the reply array of each pull part, in order."""
        by_shard: dict[int, tuple[list, list, list]] = {}  # shard -> pushes, pulls, indices of pulls
        for k, table, arrays in pushes:
            by_shard.setdefault(k, ([], [], []))[0].append((table, arrays))
        for i, (k, table, arrays) in enumerate(pulls):  # (one part per table and shard: pulls.py)
            part = by_shard.setdefault(k, ([], [], []))
            part[1].append((table, arrays))
            part[2].append(i)
        sends: list[tuple[int, p.Request]] = []
        for k, (push, pull, _) in by_shard.items():
            if len(push) + len(pull) > 1:
                sends.append((k, p.PushPull(push, pull, step, pull_step, self.pusher, peek)))
            elif push:
                ((table, arrays),) = push
                ids, grad, shows = p.push_arrays(arrays)
                sends.append((k, p.Push(table, grad, ids, step, self.pusher, shows)))
            else:
                ((table, arrays),) = pull
                sends.append((k, p.Pull(table, arrays[0] if arrays else None, pull_step, peek)))
        got: list[Any] = [None] * len(pulls)
        for (_, _, where), (_, arrays) in zip(by_shard.values(), self._exchange(sends), strict=True):
            for j, i in enumerate(where):
                got[i] = arrays[j]
        return got

    def clip_step(self, step: int, clip_norm: float, dtype: Any) -> float:
        """Clip sync step `step` by global norm (runtime/ps/clip.py): every shard's sum of squares
        (each answers once every pusher's step is in), the scale from their total, then `apply` on
        every shard. Returns the step's global gradient norm."""
        shards = range(len(self._socks))
        got = self._call({k: p.Norm(step) for k in shards})
        total = sum(float(got[k][0]["sum_squares"]) for k in shards)
        scale = float(global_norm_scale(total, clip_norm, dtype))
        self._call({k: p.Apply(step, scale) for k in shards})
        return math.sqrt(total)

    def hold(self, tables: Sequence[str]) -> dict[str, dict[str, np.ndarray]]:
        """Hold dense `tables` (runtime/ps/held_tables.py): {table: its state (Param, optimizer slots)}."""
        got = self._exchange([(self._dense[t], p.Hold(t)) for t in tables])
        return {t: dict(zip(h["keys"], a, strict=True)) for t, (h, a) in zip(tables, got, strict=True)}

    def write_back(self, states: dict[str, dict[str, np.ndarray]], steps: int, final: bool) -> None:
        """Write held tables' states back, `steps` steps applied since the hold (`final`: release them)."""
        self._exchange(
            [
                (self._dense[t], p.WriteBack(t, list(st), list(st.values()), steps, final))
                for t, st in states.items()
            ]
        )

    def assign(self, table: str, values: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Set a table's values: dense, the whole array; sparse, rows `ids` (e.g. imported weights,
        `ids=np.arange(vocab)`). Optimizer state is untouched."""
        if self._check_ids(table, ids, "assign").kind == "dense":
            self._call({self._dense[table]: p.Assign(table, np.asarray(values))})
            return
        ids, values = np.asarray(ids).reshape(-1).astype(np.int64), np.asarray(values)
        self._call(
            {
                k: p.Assign(table, values[where], ids[where])
                for k, where in enumerate(self._split(ids))
                if where is ALL or where.size
            }
        )

    # -- admin --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, **meta: Any) -> None:
        """Checkpoint every shard into directory `path` (on a file system the servers share, inside
        their checkpoint root), replacing the checkpoint there only once the new one is complete.
        `meta` (JSON values) goes into the manifest (e.g. `train`'s run state)."""
        stage = checkpoint.begin(path)
        try:
            replies = self._call({k: p.Save(str(stage.resolve())) for k in range(len(self._socks))})
            files = [e for k in sorted(replies) for e in replies[k][0]["files"]]
            checkpoint.finish(
                stage,
                path,
                list(self.specs.values()),
                files,
                **{"num_shards": len(self._socks), "mode": self.mode, **meta},
            )
        except BaseException:
            checkpoint.abort(stage)
            raise

    def load(self, path: str | os.PathLike, step: int | None = None) -> None:
        """Load checkpoint `path` (saved with any shard count) into every shard. `step`: count the
        tables' applied sync steps from there (a run resumed at `step`; else the saved counts)."""
        path = os.path.abspath(path)
        req = p.Load(path, None if step is None else int(step))
        self._call(dict.fromkeys(range(len(self._socks)), req))

    def shrink(self) -> dict[str, int]:
        """A pass end of the feature lifecycle on every shard (runtime/ps/lifecycle.py: show and
        click decayed, rows past `ttl_passes` unseen passes or below `delete_threshold` removed, one
        more unseen pass counted for the rest); {table: rows removed over all shards}, for the
        sparse tables with a `lifecycle`. Admin only."""
        r = self._call(dict.fromkeys(range(len(self._socks)), p.Shrink()))
        out: dict[str, int] = {}
        for k in sorted(r):
            for name, n in r[k][0]["removed"].items():
                out[name] = out.get(name, 0) + int(n)
        return out

    def stats(self) -> list[dict]:
        """Per shard: {table: {"rows": n, "bytes": memory held, "version": applied sync steps}}."""
        r = self._call(dict.fromkeys(range(len(self._socks)), p.Stats()))
        return [r[k][0]["tables"] for k in sorted(r)]

    def trace(self) -> list[list]:
        """Per shard, the spans it recorded since the last call (servers started with trace=True)."""
        r = self._call(dict.fromkeys(range(len(self._socks)), p.Trace()))
        return [unpack_spans(r[k][1][0]) for k in sorted(r)]

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks = []
        for ring in self._rings:
            if ring is not None:
                ring.close()
        self._rings = [None] * len(self.endpoints)

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
