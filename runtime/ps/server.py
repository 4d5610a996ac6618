"""The parameter-server process: one Shard behind a ZeroMQ ROUTER socket.

Requests and replies use the wire format (runtime/wire.py). A request header has `op` (hello, pull,
push, assign, save, load, stats, trace, shutdown), `rid` (echoed in the reply) and the op's fields; a
reply has `ok` and, when false, `error`. No request ends the server: a bad one (unknown table, wrong
shape, NaN gradient, malformed, oversized or unauthenticated frames, a limit exceeded, even a server
bug) gets an error reply and a log line, and the server goes on serving. In sync mode a pull that
must wait for its step is parked, not blocking the loop, and answered as soon as that step is
applied. With `trace=True` the server records the time it spends on each pull and push
(`runtime.telemetry.Recorder`) and hands the spans out on a `trace` request.

Security: with a `secret`, every request must carry its HMAC, a sender id and sequence number newer
than that sender's last (`wire.ReplayGuard`) and the index of the shard it is for (`to`), so a
captured request cannot be replayed, reordered or sent to another shard. Admin requests
(`ADMIN_OPS`: assign, save, load, shutdown) must be signed with `admin_secret` when one is given
(only the driver holds it; trainers get `secret` alone), and save / load only touch directories
inside `checkpoint_root`. `Servers` makes both keys at random. Limits on what a request may cost:
`shard.Limits`.

The server binds 127.0.0.1 by default; `ipc://` endpoints work too. It stops on SIGTERM/SIGINT, a
`shutdown` request, or when its parent process dies, closing its socket before exiting.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
from typing import TYPE_CHECKING, Any

import zmq

from transpiler.tables import TableSpec, tables_from_dicts, tables_to_dicts

from ..telemetry import Recorder, pack_spans, timed
from ..wire import AuthError, ReplayError, ReplayGuard, WireError, decode_signed, encode
from .shard import Limits, NotReady, Shard
from .table import PSError, SparseTable

if TYPE_CHECKING:
    from .client import PSClient

log = logging.getLogger("hetps.ps")
OPS = ("hello", "pull", "push", "assign", "save", "load", "stats", "trace", "shutdown")
ADMIN_OPS = frozenset({"assign", "save", "load", "shutdown"})


def _field(h: dict, key: str, kind: type, optional: bool = False) -> Any:
    v = h.get(key)
    if (v is None and optional) or (isinstance(v, kind) and not isinstance(v, bool)):
        return v
    raise PSError(f"request {h.get('op')!r} needs field {key!r} of type {kind.__name__}, got {v!r}")


def _describe(e: Exception) -> str:
    """A refusal's own message; any other failure prefixed by its type (it is a server bug)."""
    return str(e) if isinstance(e, PSError) else f"{type(e).__name__}: {e}"


class _Loop:
    def __init__(self, sock: zmq.Socket, shard: Shard, secret: bytes | None, trace: bool = False,
                 admin_secret: bytes | None = None, checkpoint_root: str | list[str] | None = None) -> None:
        self.sock, self.shard, self.secret = sock, shard, secret
        # without a data key nothing is authenticated (a private endpoint): an admin key alone means nothing
        self.keys = () if secret is None else (secret,) if admin_secret is None else (secret, admin_secret)
        self.admin_key = 1 if len(self.keys) == 2 else None
        self.replays = ReplayGuard() if self.keys else None
        roots = [checkpoint_root] if isinstance(checkpoint_root, str) else checkpoint_root or []
        self.roots = [os.path.realpath(r) for r in roots]
        self.limits = shard.limits
        self.rec = Recorder(trace)
        self.parked: dict[str, list[tuple[Any, dict, list]]] = {}

    def reply(self, ident: Any, rid: Any, header: dict, arrays: list = (), sign: bool = True) -> None:
        frames = encode({"rid": rid, **header}, arrays, self.secret if sign else None)
        self.sock.send_multipart([ident, *frames], copy=False)

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
            msg = decode_signed(frames, self.keys, max_bytes=self.limits.max_message_bytes)
            if self.replays is not None:
                if msg.header.get("to") != self.shard.shard:  # a request captured on its way to another
                    raise ReplayError(f"request addressed to shard {msg.header.get('to')!r:.20}, this is "
                                      f"shard {self.shard.shard}; refused")
                self.replays.check(msg.header)
        except ReplayError as e:
            log.error("shard %d: refused a replayed request: %s", self.shard.shard, e)
            self.reply(ident, None, {"ok": False, "error": f"authentication failed: {e}"}, sign=False)
            return False
        except AuthError as e:
            log.error("shard %d: rejected an unauthenticated request: %s", self.shard.shard, e)
            self.reply(ident, None, {"ok": False, "error": f"authentication failed: {e}"}, sign=False)
            return False
        except WireError as e:
            log.warning("shard %d: malformed request: %s", self.shard.shard, e)
            self.reply(ident, None, {"ok": False, "error": f"malformed request: {e}"})
            return False
        header, arrays = msg.header, msg.arrays
        rid, op = header.get("rid"), header.get("op")
        if op in ADMIN_OPS and self.admin_key is not None and msg.key != self.admin_key:
            log.error("shard %d: refused %r signed with the data key, not the admin key",
                      self.shard.shard, op)
            self.reply(ident, rid, {"ok": False, "error": f"{op!r} is an admin request: only the driver "
                                    "(which holds the admin key) may send it"})
            return False
        with timed(op, "ps", rec=self.rec if op in ("pull", "push") else None, table=header.get("table"),
                   step=header.get("step"), by=header.get("pusher")) as span:
            try:
                if op == "shutdown":
                    self.reply(ident, rid, {"ok": True})
                    return True
                out, out_arrays = self.dispatch(op, header, arrays)
            except NotReady:
                span.skip()
                self.park(ident, header, arrays)
                return False
            except Exception as e:  # the server must outlive any bad request
                span.skip()
                if not isinstance(e, PSError):
                    log.exception("shard %d: request %r failed", self.shard.shard, op)
                self.reply(ident, rid, {"ok": False, "error": _describe(e)})
                return False
            self.reply(ident, rid, {"ok": True, **out}, out_arrays)
        return False

    def park(self, ident: Any, header: dict, arrays: list) -> None:
        """Hold a sync pull until its step is applied, or refuse it when `max_parked` are held."""
        held, limit = sum(len(v) for v in self.parked.values()), self.limits.max_parked
        if held >= limit:
            self.reply(ident, header.get("rid"), {"ok": False, "error": (
                f"sync pull of {header['table']!r} for step {header.get('step')}: {held} pulls already "
                f"wait for their step, the limit max_parked={limit}")})
            return
        self.parked.setdefault(header["table"], []).append((ident, header, arrays))

    def checkpoint_dir(self, h: dict) -> str:
        """The request's `dir`, when it lies inside the checkpoint root the server was started with."""
        d = _field(h, "dir", str)
        if not self.roots:
            raise PSError(f"{h.get('op')!r} refused: this server was started without a checkpoint root "
                          "(serve / Servers checkpoint_root=...), so it saves and loads nowhere")
        real = os.path.realpath(d)
        if not any(os.path.commonpath([real, r]) == r for r in self.roots):
            where = self.roots[0] if len(self.roots) == 1 else self.roots
            raise PSError(f"{h.get('op')!r} refused: {d!r} is outside the checkpoint root {where!r} "
                          "this server was started with")
        return real

    def dispatch(self, op: Any, h: dict, arrays: list) -> tuple[dict, list]:
        s = self.shard
        if op == "hello":
            return {"shard": s.shard, "num_shards": s.num_shards, "mode": s.mode,
                    "tables": tables_to_dicts(s.specs)}, []
        if op == "pull":
            if len(arrays) > 1:
                raise PSError(f"pull takes at most one array (ids), got {len(arrays)}")
            rows = s.pull(_field(h, "table", str), arrays[0] if arrays else None,
                          _field(h, "step", int, optional=True), peek=h.get("peek") is True)
            return {}, [rows]
        if op == "push":
            if len(arrays) not in (1, 2):
                raise PSError(f"push takes [grad] or [ids, grad], got {len(arrays)} arrays")
            table = _field(h, "table", str)
            if s.push(table, arrays[-1], arrays[0] if len(arrays) == 2 else None,
                      _field(h, "step", int, optional=True), str(h.get("pusher", "0"))):
                self.release(table)
            return {}, []
        if op == "assign":
            if len(arrays) not in (1, 2):
                raise PSError(f"assign takes [values] or [ids, values], got {len(arrays)} arrays")
            s.assign(_field(h, "table", str), arrays[-1], arrays[0] if len(arrays) == 2 else None)
            return {}, []
        if op == "save":
            return {"files": s.save(self.checkpoint_dir(h))}, []
        if op == "load":
            s.load(self.checkpoint_dir(h), _field(h, "step", int, optional=True))
            return {}, []
        if op == "trace":
            return {}, [pack_spans(self.rec.take())]
        if op == "stats":
            return {"tables": {n: {"rows": len(t) if isinstance(t, SparseTable) else t.param.shape[0],
                                   "bytes": t.memory_bytes(), "version": s.version[n],
                                   "applied": s.applied[n]}
                               for n, t in s.tables.items()}}, []
        raise PSError(f"unknown request op {op!r}; known ops: {', '.join(OPS)}")

    def release(self, table: str) -> None:
        """Answer the parked sync pulls of `table` whose step has now been applied."""
        waiting, self.parked[table] = self.parked.get(table, []), []
        for ident, h, arrays in waiting:
            with timed("pull", "ps", rec=self.rec, table=table, step=h.get("step"), parked=True) as span:
                try:
                    out, out_arrays = self.dispatch("pull", h, arrays)
                except NotReady:
                    span.skip()
                    self.parked[table].append((ident, h, arrays))
                    continue
                except Exception as e:
                    span.skip()
                    self.reply(ident, h.get("rid"), {"ok": False, "error": _describe(e)})
                    continue
                self.reply(ident, h.get("rid"), {"ok": True, **out}, out_arrays)


def serve(endpoint: str, specs: list[dict[str, Any]], *, shard: int = 0, num_shards: int = 1,
          mode: str = "async",
          pushes_per_step: int | dict[str, int] = 1, check_finite: bool = True,
          secret: bytes | None = None, ready: Any = None, log_file: str | None = None,
          trace: bool = False, admin_secret: bytes | None = None,
          checkpoint_root: str | list[str] | None = None,
          limits: Limits | None = None) -> None:
    """Run one shard until stopped. `ready` (a multiprocessing Connection) gets the bound endpoint,
    or `("error", message)` when the server cannot start. With `log_file`, everything the process
    writes to stderr (its log, any traceback) is appended there. `secret` / `admin_secret` /
    `checkpoint_root` / `limits`: see the module docstring (without a secret, anyone who reaches the
    endpoint may do anything: use it only on a private endpoint)."""
    if log_file is not None:
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    if not logging.getLogger().handlers:
        logging.basicConfig(format=f"[hetps ps shard {shard}] %(levelname)s %(message)s")
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    parent = os.getppid()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    # ZeroMQ drops the connection of a peer sending one frame over twice the limit before buffering it
    # (memory stays bounded); a message up to that size gets decode's clear error reply instead
    sock.maxmsgsize = 2 * (limits or Limits()).max_message_bytes
    try:  # specs: TableSpec.to_dict()s (they cross into this process)
        loop = _Loop(sock, Shard(tables_from_dicts(specs), shard=shard, num_shards=num_shards, mode=mode,
                                 pushes_per_step=pushes_per_step, check_finite=check_finite,
                                 limits=limits), secret, trace, admin_secret, checkpoint_root)
        sock.bind(endpoint)
    except Exception as e:
        sock.close()
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
        sock.close()
        ctx.term()


class Servers:
    """Parameter-server shards as local processes; a context manager.

    Processes come from multiprocessing's forkserver (a clean process that imported this module
    once and forks each shard from it; spawn where forkserver does not exist), never from a fork
    of the caller, which may hold threads and sockets.

    `endpoints[k]` is shard k's address. Requests are signed: `secret` and `admin_secret` default to
    random keys made here; `client()` is a `PSClient` holding both (give other processes, e.g.
    trainers, `PSClient(endpoints, secret=servers.secret)`: they can pull and push but not assign,
    save, load or shut down). Save and load work only inside `checkpoint_root`. With `log_dir`,
    shard k writes its log and stderr to `log_dir/ps-shard{k}.log`; otherwise to the forkserver's
    stderr. `limits`: see `shard.Limits`.
    """

    def __init__(self, specs: list[TableSpec], num_shards: int = 1, *, mode: str = "async",
                 transport: str = "tcp", host: str = "127.0.0.1", pushes_per_step: int | dict = 1,
                 check_finite: bool = True, secret: bytes | None = None, admin_secret: bytes | None = None,
                 checkpoint_root: str | os.PathLike | None = None, limits: Limits | None = None,
                 log_dir: str | os.PathLike | None = None, start_timeout: float = 60.0) -> None:
        if transport not in ("tcp", "ipc"):
            raise PSError(f"transport {transport!r} is not 'tcp' or 'ipc'")
        self.secret = secret if secret is not None else os.urandom(32)
        self.admin_secret = admin_secret if admin_secret is not None else os.urandom(32)
        root = None if checkpoint_root is None else os.fspath(checkpoint_root)
        self._tmp = tempfile.mkdtemp(prefix="hetps-ps-") if transport == "ipc" else None
        if "forkserver" in mp.get_all_start_methods():  # imports once, then each shard forks fast
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload([__name__])
        else:
            ctx = mp.get_context("spawn")
        self.processes, self.endpoints, pipes = [], [], []
        try:
            for k in range(num_shards):
                addr = f"ipc://{self._tmp}/shard{k}" if self._tmp else f"tcp://{host}:*"
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=serve, args=(addr, tables_to_dicts(specs)), name=f"hetps-ps-{k}",
                                daemon=True,
                                kwargs=dict(shard=k, num_shards=num_shards, mode=mode, secret=self.secret,
                                            admin_secret=self.admin_secret, checkpoint_root=root,
                                            limits=limits, pushes_per_step=pushes_per_step,
                                            check_finite=check_finite, ready=send,
                                            log_file=log_dir and os.path.join(log_dir, f"ps-shard{k}.log")))
                p.start()
                send.close()
                self.processes.append(p)
                pipes.append(recv)
            for k, recv in enumerate(pipes):
                late = ("error", f"not ready within {start_timeout} s")
                msg = recv.recv() if recv.poll(start_timeout) else late
                if isinstance(msg, tuple):
                    raise PSError(f"parameter server shard {k} failed to start: {msg[1]}")
                self.endpoints.append(msg)
        except EOFError:
            self.stop()
            raise PSError(f"parameter server shard {len(self.endpoints)} exited before it was ready "
                          "(see its stderr)") from None
        except BaseException:
            self.stop()
            raise

    def client(self, **kwargs: Any) -> PSClient:
        """A PSClient of these servers with both keys (the driver's client); `kwargs` go to PSClient."""
        from .client import PSClient

        return PSClient(self.endpoints, secret=self.secret, admin_secret=self.admin_secret, **kwargs)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every shard (SIGTERM, then SIGKILL after `timeout` s) and remove ipc sockets."""
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
