"""The parameter-server process: one Shard behind a ZeroMQ ROUTER socket.

Requests and replies use the wire format (runtime/transport/wire.py). A request is one of the
records of runtime/ps/protocol.py (hello, pull, push, push_pull, norm, apply, hold, write_back,
assign, save, load, stats, trace, shutdown), its header read into the record once (`protocol.parse`)
and served by its handler (handlers.py `HANDLERS`: record type -> function of the explicit `Context`
and the record), plus the transport's fields: `rid` (echoed in the reply), `cid` / `seq` / `to`
(below), `shm` / `shm_reply` (shared memory). A reply has `ok` and, when false, `error`. No request
ends the server: a bad one (unknown table, wrong shape, NaN gradient, malformed, oversized or
unauthenticated frames, a limit exceeded, even a server bug) gets an error reply and a log line, and
the server goes on serving. In sync mode a pull that must wait for its step is parked (`Parked`),
not blocking the loop, and answered as soon as that step is applied. With `trace=True` the server
records the time it spends on each pull and push (`runtime.telemetry.outputs.Recorder`) and hands
the spans out on a `trace` request.

Security: with a `secret` (the shards' master key), every request must carry its MAC under the
sending client's own key, `wire.client_key(secret, name)`, which the driver derives for each trainer
(its name: "gpu:0"), so a client speaks only as itself: its sender id (`cid` = "name/instance")
starts with that name, it pushes only as pusher `name` and holds only the tables the plan gives
`name` (`holders`). A client opens a session with `hello`; every later request must carry it
(`sess`), a sequence number newer than the last (`wire.Sessions`: a forgotten sender must say hello
again, so a captured request is never accepted later) and the index of the shard it is for (`to`),
so a captured request cannot be replayed, reordered or sent to another shard. Admin requests
(`ADMIN_OPS`: assign, save, load, shrink, shutdown) must be signed with `admin_secret` when one is given
(only the driver holds it), and save / load only touch directories inside `checkpoint_root`.
`Servers` (runtime/ps/local.py) makes both keys at random. Limits on what a request may cost:
`shard.Limits`.

The server binds 127.0.0.1 by default; `ipc://` endpoints work too. It stops on SIGTERM/SIGINT, a
`shutdown` request, or when its parent process dies, closing its socket before exiting. `Servers`
(runtime/ps/local.py) runs shards as local processes.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import zmq

from runtime.ps import protocol as p
from runtime.ps.handlers import HANDLERS, Context, ParkPulls, describe
from runtime.ps.shard import Limits, Shard
from runtime.ps.types import CLIP, NotReady, PSError
from runtime.telemetry.outputs import Recorder, timed
from runtime.transport.shm import ShmRing, ShmSegments, shm_dir
from runtime.transport.wire import (
    AuthError,
    ReplayError,
    Sessions,
    Signed,
    WireError,
    client_key,
    decode_signed,
    encode,
    wire_array,
)
from runtime.transport.zap import Gate
from transpiler.tables import tables_from_dicts

log = logging.getLogger("hetps.ps")
ADMIN_OPS, OPS = p.ADMIN_OPS, p.OPS
MAX_REPLY_RINGS = 64  # clients beyond these get their replies as ZeroMQ frames
MAX_QUEUED = 256  # requests of one connection ZeroMQ keeps before the server reads them


@dataclass
class Parked:
    """A request waiting for its sync step: whom to answer, and how."""

    ident: Any
    rid: Any
    shm_reply: bool
    request: p.Request
    key: bytes | None = None  # the key its reply is signed with (the request's)


class _Loop:
    def __init__(
        self,
        sock: zmq.Socket,
        shard: Shard,
        secret: bytes | None,
        trace: bool = False,
        admin_secret: bytes | None = None,
        checkpoint_root: str | list[str] | None = None,
        holders: dict[str, str] | None = None,
    ) -> None:
        self.sock, self.shard, self.secret = sock, shard, secret
        # without a master key nothing is authenticated (a private endpoint): an admin key alone means nothing
        self.admin_keys = () if secret is None or admin_secret is None else (admin_secret,)
        self.sessions = Sessions() if secret is not None else None
        roots = [checkpoint_root] if isinstance(checkpoint_root, str) else checkpoint_root or []
        self.roots = [os.path.realpath(r) for r in roots]
        self.limits = shard.limits
        self.rec = Recorder(trace)
        self.cx = Context(shard, self.roots, self.rec, self.release, holders)
        self.parked: dict[str, list[Parked]] = {}
        self.segments: ShmSegments | None = None  # requests' arrays in clients' shm segments
        self.rings: dict[bytes, ShmRing | None] = {}  # replies' arrays to clients that read shm
        self.borrowed: list[Callable[[], None]] = []  # hands a request's shm bytes back (_shm_arrays)

    def attach_shm(self, endpoint: str) -> None:
        """Same-host clients may send and receive arrays through shared memory (runtime.transport.channels)
        when `endpoint` is an ipc endpoint of a local run with a shared-memory twin."""
        directory = shm_dir(endpoint)
        self.segments = None if directory is None else ShmSegments(directory)

    def reply(
        self,
        ident: Any,
        rid: Any,
        header: dict,
        arrays: list = (),
        key: bytes | None = None,
        shm: bool = False,
    ) -> None:
        """Send a reply; its arrays through the client's shared-memory ring when `shm` (the
        request said the client reads them) and they fit, else as ZeroMQ frames. An array that does
        not own its memory may be a view of a table (a dense pull: `Shard.pull(copy=False)`), which
        the next push changes in place: it is copied into the ring, or copied before ZeroMQ sends it
        without a copy of its own. Signed with `key` (the request's); unsigned without one."""
        if shm and arrays and key is not None and self.segments is not None:
            ring = self._ring(bytes(ident))
            arrays = [wire_array(i, a) for i, a in enumerate(arrays)]
            if ring is not None and (desc := ring.put(arrays)):
                header, arrays = {**header, "shm": desc}, ()
        arrays = [a if a.flags.owndata else a.copy() for a in map(np.asarray, arrays)]
        frames = encode({"rid": rid, **header}, arrays, key)
        self.sock.send_multipart([ident, *frames], copy=False)

    def _ring(self, ident: bytes) -> ShmRing | None:
        if ident not in self.rings:
            if len(self.rings) >= MAX_REPLY_RINGS:
                return None
            try:
                self.rings[ident] = ShmRing(
                    self.segments.dir, f"ps{self.shard.shard}-reply{len(self.rings)}", p.PS_RING_BYTES
                )
            except OSError:
                self.rings[ident] = None
        return self.rings[ident]

    def close(self) -> None:
        for ring in self.rings.values():
            if ring is not None:
                ring.close()
        self.rings = {}

    def handle(self, frames: list) -> bool:
        """Serve one request; True when it asked the server to stop. Never raises for a request."""
        if len(frames) < 2:
            log.warning("shard %d: a message without an identity or header frame; dropped", self.shard.shard)
            return False
        try:
            return self._handle(frames[0], frames[1:])
        except Exception as e:  # the server must outlive any request, even one that hits a bug
            log.exception("shard %d: request failed", self.shard.shard)
            try:
                self.reply(frames[0], None, {"ok": False, "error": f"server error: {type(e).__name__}: {e}"})
            except Exception:
                log.exception("shard %d: could not send the error reply", self.shard.shard)
            return False

    def _handle(self, ident: Any, frames: list) -> bool:
        try:
            return self._serve(ident, frames)
        finally:
            self._hand_back()

    def _hand_back(self) -> None:
        """Hand the shared-memory bytes of the request being served back to its client."""
        while self.borrowed:
            self.borrowed.pop()()

    def _serve(self, ident: Any, frames: list) -> bool:
        try:
            msg = decode_signed(
                frames, self.admin_keys, max_bytes=self.limits.max_message_bytes, master=self.secret
            )
            if self.sessions is not None:
                self._check_sender(msg)
            if "shm" in msg.header:  # (only after the MAC and replay checks)
                msg.arrays = self._shm_arrays(msg.header.pop("shm"), msg.arrays)
        except AuthError as e:  # (a ReplayError too)
            what = "refused a replayed" if isinstance(e, ReplayError) else "rejected an unauthenticated"
            log.error("shard %d: %s request: %s", self.shard.shard, what, e)
            self.reply(ident, None, {"ok": False, "error": f"authentication failed: {e}"})
            return False
        except WireError as e:
            log.warning("shard %d: malformed request: %s", self.shard.shard, e)
            self.reply(ident, None, {"ok": False, "error": f"malformed request: {e}"})
            return False
        header, arrays = msg.header, msg.arrays
        key = self._key_of(msg)
        rid, op, shm_reply = header.get("rid"), header.get("op"), header.get("shm_reply") is True
        try:
            self._check_rights(msg, op)
            req = p.parse(header, arrays)
            _check_pusher(req, msg.sender)
        except PSError as e:
            log.error("shard %d: refused %r: %s", self.shard.shard, op, e)
            self.reply(ident, rid, {"ok": False, "error": str(e)}, key=key)
            return False
        if isinstance(req, p.Shutdown):
            self.reply(ident, rid, {"ok": True}, key=key)
            return True
        self.serve_request(Parked(ident, rid, shm_reply, req, key), hand_back=True)
        return False

    def _key_of(self, msg: Signed) -> bytes | None:
        """The key `msg` was signed with (its reply's)."""
        if msg.sender is not None:
            return client_key(self.secret, msg.sender)
        return None if msg.key is None else self.admin_keys[msg.key]

    def _check_sender(self, msg: Signed) -> None:
        """ReplayError for a request to another shard, of another client's id, or outside a live
        session (a hello opens one: its id goes into the request as `sess`, for the reply)."""
        h = msg.header
        if h.get("to") != self.shard.shard:  # a request captured on its way to another
            raise ReplayError(
                f"request addressed to shard {h.get('to')!r:.20}, this is shard {self.shard.shard}; refused"
            )
        Sessions.seq_of(h)
        if msg.sender is not None and Sessions.name_of(h.get("cid")) != msg.sender:
            raise AuthError(
                f"request signed with the key of client {msg.sender!r} claims sender id "
                f"{h.get('cid')!r:.80}: a client may speak only as itself"
            )
        if h.get("op") == "hello":
            h["sess"] = self.sessions.open(h)
        else:
            self.sessions.check(h)

    def _check_rights(self, msg: Signed, op: Any) -> None:
        """PSError for an admin request not signed with the admin key."""
        if op in p.ADMIN_OPS and self.admin_keys and msg.key != 0:
            raise PSError(
                f"{op!r} is an admin request: only the driver (which holds the admin key) may send it"
            )

    def serve_request(self, w: Parked, hand_back: bool = False, released: str | None = None) -> None:
        """Answer one request, or park it when it must wait for its sync step. `hand_back`: give
        the request's shared-memory bytes back before its reply (they are used up); `released`:
        the table whose applied step let a parked request go on."""
        r = w.request
        if released is not None:
            span = dict(name="pull", rec=self.rec, table=released, step=getattr(r, "step", None), parked=True)
        else:
            span = dict(
                name=r.span(),
                rec=self.rec if r.OP in p.TRACED_OPS else None,
                table=getattr(r, "table", None),
                step=getattr(r, "step", None),
                by=getattr(r, "pusher", None),
            )
        with timed(span.pop("name"), "ps", **span) as sp:
            try:
                out, out_arrays = HANDLERS[type(r)](self.cx, r)
            except NotReady as e:
                sp.skip()
                self.park(w, e.args[0])
                return
            except ParkPulls as e:
                sp.skip()
                self.park(replace(w, request=e.request), e.table)
                return
            except Exception as e:  # the server must outlive any bad request
                sp.skip()
                if not isinstance(e, PSError):
                    log.exception("shard %d: request %r failed", self.shard.shard, r.OP)
                self.reply(w.ident, w.rid, {"ok": False, "error": describe(e)}, key=w.key)
                return
            if hand_back:
                self._hand_back()  # (the request's arrays are used up; its client may reuse their bytes)
            self.reply(w.ident, w.rid, {"ok": True, **out}, out_arrays, key=w.key, shm=w.shm_reply)

    def _shm_arrays(self, desc: Any, frames: list) -> list:
        """The arrays a request left in its client's shared-memory segment (bounds-checked there):
        read-only views, their bytes handed back to the client (`_hand_back`) once the request is
        applied, before its reply, except in sync mode, where pushes wait in the shard for their
        step and pulls park, so a request's arrays outlive it: copies then."""
        if self.segments is None or frames or self.secret is None:
            raise WireError(
                "a shared-memory request reached a server without a shared-memory directory "
                "(or without a secret, or with frames as well)"
            )
        limit = self.limits.max_message_bytes
        if isinstance(desc, dict) and isinstance(desc.get("n"), int) and desc["n"] > limit:
            raise WireError(
                f"message is {desc['n']} bytes, more than the limit of {limit} (max_message_bytes)"
            )
        if self.shard.mode == "sync":
            return self.segments.arrays(desc)
        views, done = self.segments.views(desc)
        self.borrowed.append(done)
        return views

    def park(self, w: Parked, table: str) -> None:
        """Hold a sync request until `table` has applied its step, or refuse it when `max_parked`
        are held."""
        held, limit = sum(len(v) for v in self.parked.values()), self.limits.max_parked
        if held >= limit:
            self.reply(
                w.ident,
                w.rid,
                {
                    "ok": False,
                    "error": (
                        f"sync pull of {table!r} for step {getattr(w.request, 'step', None)}: {held} pulls "
                        f"already wait for their step, the limit max_parked={limit}"
                    ),
                },
                key=w.key,
            )
            return
        self.parked.setdefault(table, []).append(w)

    def release(self, table: str) -> None:
        """Answer the parked sync requests of `table` whose step has now been applied."""
        waiting, self.parked[table] = self.parked.get(table, []), []
        if table in self.shard.clip_tables:  # a held step may complete a parked norm request
            waiting += self.parked.pop(CLIP, [])
        for w in waiting:
            self.serve_request(w, released=table)


def _check_pusher(req: p.Request, sender: str | None) -> None:
    """PSError for a push as a pusher other than the client whose key signed it."""
    pusher = getattr(req, "pusher", None)
    if sender is not None and pusher is not None and pusher != sender and getattr(req, "pushes", True):
        raise PSError(
            f"{req.OP} as pusher {pusher!r} refused: it is signed with the key of client {sender!r}, "
            "and a client pushes only as itself"
        )


def _log_to(log_file: str | None, shard: int) -> None:
    """Send this process's stderr (its log, any traceback) to `log_file` too, and prefix log lines."""
    if log_file is not None:
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    if not logging.getLogger().handlers:
        logging.basicConfig(format=f"[hetps ps shard {shard}] %(levelname)s %(message)s")


def serve(
    endpoint: str,
    specs: list[dict[str, Any]],
    *,
    shard: int = 0,
    num_shards: int = 1,
    mode: str = "async",
    pushes_per_step: int | dict[str, int] = 1,
    check_finite: bool = True,
    secret: bytes | None = None,
    ready: Any = None,
    log_file: str | None = None,
    trace: bool = False,
    admin_secret: bytes | None = None,
    checkpoint_root: str | list[str] | None = None,
    limits: Limits | None = None,
    holders: dict[str, str] | None = None,
) -> None:
    """Run one shard until stopped. `ready` (a multiprocessing Connection) gets the bound endpoint,
        or `("error", message)` when the server cannot start. With `log_file`, everything the process
        writes to stderr (its log, any traceback) is appended there. `secret` / `admin_secret` /
        `checkpoint_root` / `limits` / `holders` (table -> the client name that may hold it; None: any
    client): see the module docstring (without a secret, anyone who reaches the
        endpoint may do anything: use it only on a private endpoint)."""
    _log_to(log_file, shard)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    parent = os.getppid()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    # memory before authentication: with a key, ZeroMQ admits only connections of clients that log in
    # with their key's token (zap.py); a frame over twice the limit drops its connection unread (a
    # message up to that size gets decode's clear error reply), and at most MAX_QUEUED messages of one
    # connection wait unread
    gate = None if secret is None else Gate(ctx, functools.partial(client_key, secret))
    if gate is not None:
        Gate.guard(sock)
    sock.maxmsgsize = 2 * (limits or Limits()).max_message_bytes
    sock.rcvhwm = MAX_QUEUED
    try:
        tables = Shard(
            tables_from_dicts(specs),
            shard=shard,
            num_shards=num_shards,
            mode=mode,
            pushes_per_step=pushes_per_step,
            check_finite=check_finite,
            limits=limits,
        )
        loop = _Loop(sock, tables, secret, trace, admin_secret, checkpoint_root, holders)
        sock.bind(endpoint)
        loop.attach_shm(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    except Exception as e:
        sock.close()
        if gate is not None:
            gate.close()
        ctx.term()
        if ready is not None:
            ready.send(("error", f"{type(e).__name__}: {e}"))
        raise
    if ready is not None:
        ready.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while not stop and os.getppid() == parent:
            if poller.poll(100) and loop.handle(sock.recv_multipart(copy=False)):
                break
    finally:
        loop.close()
        sock.close()
        if gate is not None:
            gate.close()
        ctx.term()


__all__ = ["ADMIN_OPS", "HANDLERS", "OPS", "Context", "serve"]
