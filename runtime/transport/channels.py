"""Trainer-to-trainer messaging: one ZeroMQ PULL socket per process, PUSH sockets to its peers.

Every process of a run (trainer or driver) binds one inbox (`Inbox`) at an address the engine gives
it (`ipc://` on the local engine) and sends to others through an `Outbox`, which connects one PUSH
socket per destination on first use. Messages use the data-plane frame format of `runtime.transport.wire`
(MessagePack header + raw array buffers, optional MAC; never pickle). Sends never block a trainer: a PUSH
socket queues up to its high-water mark, and a trainer never has more than `micro_batches`
micro-batches in flight, so queues stay short. Arrays go out without a copy (`copy=False`): a sender
must not write into an array after sending it (the executor makes fresh arrays for every op).

ZeroMQ keeps the order of messages between one sender and one receiver, which the trainers rely on:
a step's announcement reaches a trainer before that step's tensors from the same sender.

Tensor messages carry one micro-batch's tensors for one destination:
    header {"k": "t", "s": step, "o": origin trainer index, "m": micro-batch, "v": [[name, height]]}
`height` is None for a dense array; for a row-sparse gradient (`SparseRows`) it is the height and the
message carries two arrays (rows, values) for that name.

Every process signs with the keys of its own links only (`Links`: one key per sender and receiver,
`wire.link_key`, derived by the driver, which alone holds the run's master secret); an inbox admits
a connection only with a sender's login token (zap.py) and a message only under its sender's link
key, numbered by its `Outbox` (`wire.LinkGuard`). See docs/cluster.md for who holds which key.

Same-host tensors go through shared memory (`runtime.transport.shm`): an `Outbox` writes a message's arrays
into a ring segment it owns for that receiver and sends only the signed control message; other hosts,
and endpoints without a shared-memory directory, use ZeroMQ frames.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from ops_registry import SparseRows
from runtime.transport import zap
from runtime.transport.shm import ShmRing, ShmSegments, copied, shm_dir
from runtime.transport.wire import (
    MAX_MESSAGE_BYTES,
    AuthError,
    LinkGuard,
    WireError,
    decode,
    decode_signed,
    encode,
    link_key,
    wire_array,
)
from runtime.transport.zap import Gate

log = logging.getLogger("hetps.channels")
REFUSALS_PER_CALL = 100  # refused messages one `Inbox.recv` skips before it returns None
# how long a process that ends waits for its messages to a `patient` peer (the driver) to go out: a
# driver stopped (SIGSTOP, Ctrl-Z) meanwhile reads them once continued, so a run that finished is not
# judged failed for a trainer's last report lost at its exit
PATIENT_LINGER_S = 60.0
SEND_TIMEOUT_MS = 60_000  # a send that finds no connection to queue in (its login refused) fails after this
DRIVER = "driver"  # the driver's name as an end of links (and its inbox's name on the engine)


@dataclass(frozen=True)
class Links:
    """The keys one process holds for its links (`wire.link_key`), as the driver hands them out:
    the process signs as `name` to each endpoint of `send`, and its inbox accepts a message only
    from a sender of `recv`, under that link's key. No process but the driver holds the run's master
    secret, so a trainer cannot sign as another or to a peer it has no link to."""

    name: str
    send: dict[str, bytes]  # receiver's endpoint -> key of the link name -> receiver
    recv: dict[str, bytes]  # sender's name -> key of the link sender -> name

    @staticmethod
    def derive(
        master: bytes, name: str, to: Mapping[str, str] | None = None, senders: Iterable[str] = ()
    ) -> Links:
        """Process `name`'s links under `master`: to each receiver of `to` (name -> endpoint), from
        each of `senders` (names)."""
        return Links(
            name,
            {ep: link_key(master, name, peer) for peer, ep in (to or {}).items()},
            {peer: link_key(master, peer, name) for peer in senders},
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "send": dict(self.send), "recv": dict(self.recv)}

    @staticmethod
    def of(d: Links | dict[str, Any] | None) -> Links | None:
        """The Links of `to_dict` (or Links, or None, as they are)."""
        return d if d is None or isinstance(d, Links) else Links(d["name"], dict(d["send"]), dict(d["recv"]))


class Inbox:
    """The bound receiving end of one process. `recv(timeout_ms)` -> (header, arrays) or None.

    With `links`, a connection is admitted only when its peer logs in (ZAP/PLAIN, `runtime.transport.zap`,
    on the inbox's own ZeroMQ context) as a sender of `links.recv` with its link key's token, so nothing
    a peer without a key sends is ever queued, and no frame over `max_bytes` is (ZMQ_MAXMSGSIZE: its
    connection is dropped). A message must be signed with the key of its sender's link, and be new
    (`wire.LinkGuard`: the header's `cid` names that sender, `seq` newer than the last); one that is
    not is refused: logged, counted in `refused` (the last reason in `last_refused`) and skipped, so
    that no one without a key can stop a run (a call returns None after `REFUSALS_PER_CALL` of them,
    so that a flood does not hold its caller either). A signed message that is malformed (a peer's
    bug) raises WireError. No receive high-water mark: ZeroMQ would drop legitimate messages past it."""

    def __init__(
        self,
        endpoint: str,
        links: Links | None = None,
        context: zmq.Context | None = None,
        max_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.links = links
        self.own_ctx = None if links is None else zmq.Context()  # (the gate serves one context)
        self.gate = None if links is None else Gate(self.own_ctx, links.recv.__getitem__)
        self.sock = (self.own_ctx or context or zmq.Context.instance()).socket(zmq.PULL)
        self.sock.linger = 0
        self.sock.rcvhwm = 0  # never drop or stall a sender: the sender bounds what is in flight
        self.sock.maxmsgsize = max_bytes
        if self.gate is not None:
            Gate.guard(self.sock)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        shm = shm_dir(self.endpoint)
        self.segments = None if shm is None else ShmSegments(shm)
        self.guard = None if links is None else LinkGuard()
        self.refused, self.last_refused = 0, ""

    @property
    def refused_connections(self) -> int:
        """Logins the gate refused (a wrong or unknown token); a peer that does not log in at all is
        refused by ZeroMQ itself (mechanism mismatch), uncounted."""
        return 0 if self.gate is None else self.gate.refused

    def recv(self, timeout_ms: float = 0) -> tuple[dict, list[np.ndarray]] | None:
        """The next message, waiting at most `timeout_ms` (0: only if one is queued)."""
        got = self.recv_leased(timeout_ms)
        if got is None:
            return None
        header, arrays, release = got
        return header, arrays if release is None else copied(arrays, release)

    def recv_leased(
        self, timeout_ms: float = 0
    ) -> tuple[dict, list[np.ndarray], Callable[[], None] | None] | None:
        """`recv`, without the copy out of shared memory: (header, arrays, release), where a
        shared-memory message's arrays are read-only views that stay valid until `release()` (None
        for a message of ZeroMQ frames; see `ShmSegments.views`)."""
        deadline = time.monotonic() + timeout_ms / 1e3
        for _ in range(REFUSALS_PER_CALL):  # (so a flood of refused messages cannot hold the caller)
            if not self.sock.poll(max(0.0, deadline - time.monotonic()) * 1e3):
                return None
            try:
                header, arrays = self._verified(self.sock.recv_multipart(copy=False))
                break
            except AuthError as e:
                self.refused, self.last_refused = self.refused + 1, str(e)
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning("%s: refused %d message(s): %s", self.endpoint, self.refused, e)
        else:
            return None
        if "shm" not in header:
            return header, arrays, None
        if self.segments is None or arrays:
            raise WireError(
                "a shared-memory message reached an endpoint without a shared-memory "
                "directory (or carried frames as well)"
            )
        views, release = self.segments.views(header.pop("shm"))
        return header, views, release

    def _verified(self, frames: list[Any]) -> tuple[dict, list[np.ndarray]]:
        """(header, arrays) of a message that its sender's link key signed and that is new."""
        if self.links is None:
            return decode(frames)
        got = decode_signed(frames, key_of=self.links.recv.__getitem__)
        self.guard.check(got.sender, got.header)
        del got.header["cid"], got.header["seq"]
        return got.header, got.arrays

    def close(self) -> None:
        self._close_sockets()
        if self.segments is not None:
            self.segments.close()

    def _close_sockets(self) -> None:
        self.sock.close()
        if self.gate is not None:
            self.gate.close()
            self.own_ctx.term()


class Outbox:
    """PUSH sockets to named peers (connected lazily); `send(endpoint, header, arrays)`. With
    `links`, each socket logs in as `links.name` (zap.py) and every message is signed with the key
    of the link to its endpoint (WireError for an endpoint without a link) and numbered (`cid` =
    "name/instance", `seq`). When the process ends, what it queued for a peer goes out for up to
    `linger_ms`, for the `patient` endpoints (the driver's inbox) up to `PATIENT_LINGER_S`."""

    def __init__(
        self,
        links: Links | None = None,
        context: zmq.Context | None = None,
        linger_ms: int = 2000,
        shm: bool = True,
        patient: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.links, self.linger_ms, self.shm = links, linger_ms, shm
        self.patient = frozenset(patient)
        # with links every message carries this Outbox's id and number (Inbox refuses replays)
        self.cid = None if links is None else f"{links.name}/{os.urandom(8).hex()}"
        self.seq = 0
        self.ctx = context or zmq.Context.instance()
        self.socks: dict[str, zmq.Socket] = {}
        self.rings: dict[str, ShmRing | None] = {}

    def _key(self, endpoint: str) -> bytes | None:
        if self.links is None:
            return None
        key = self.links.send.get(endpoint)
        if key is None:
            raise WireError(f"{self.links.name} has no link to {endpoint!r} (the driver gave it no key)")
        return key

    def send(self, endpoint: str, header: dict[str, Any], arrays: list[Any] = ()) -> None:
        key = self._key(endpoint)
        if key is not None:
            self.seq += 1
            header = {**header, "cid": self.cid, "seq": self.seq}
        sock = self.socks.get(endpoint) or self._connect(endpoint, key)
        name = None if self.links is None else self.links.name
        if self.shm and arrays:
            ring = self._ring(endpoint)
            if ring is not None:
                laid = [wire_array(i, a, contiguous=False) for i, a in enumerate(arrays)]  # (put copies)
                if desc := ring.put(laid):
                    return self._send(sock, endpoint, encode({**header, "shm": desc}, (), key, name))
        self._send(sock, endpoint, encode(header, arrays, key, name))

    def _send(self, sock: zmq.Socket, endpoint: str, frames: list[Any]) -> None:
        try:
            sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise WireError(
                f"{self.links.name if self.links else 'this process'} could not send to {endpoint!r} for "
                f"{SEND_TIMEOUT_MS / 1e3:.0f} s: its inbox refuses this process's login (a link key of "
                "another run?)"
            ) from None

    def _connect(self, endpoint: str, key: bytes | None) -> zmq.Socket:
        sock = self.socks[endpoint] = self.ctx.socket(zmq.PUSH)
        # let queued messages out when the process finishes
        sock.linger = int(PATIENT_LINGER_S * 1000) if endpoint in self.patient else self.linger_ms
        sock.sndhwm = 0
        sock.sndtimeo = SEND_TIMEOUT_MS  # (no HWM: a send blocks only with no connection to queue in)
        if key is not None:
            zap.credentials(sock, self.links.name, key)
        sock.connect(endpoint)
        return sock

    def ring_full(self) -> int:
        """Messages sent as ZeroMQ frames because a receiver had not yet read far enough in its ring."""
        return sum(r.full for r in self.rings.values() if r is not None)

    def _ring(self, endpoint: str) -> ShmRing | None:
        if endpoint not in self.rings:
            shm = shm_dir(endpoint)
            try:
                self.rings[endpoint] = None if shm is None else ShmRing(shm, os.path.basename(endpoint))
            except OSError:
                self.rings[endpoint] = None  # e.g. /dev/shm full: ZeroMQ frames it is
        return self.rings[endpoint]

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.socks = {}
        for ring in self.rings.values():
            if ring is not None:
                ring.close()
        self.rings = {}


def deliver_pending(timeout: float = 5.0) -> bool:
    """Before a process ends: wait (at most `timeout` s) until ZeroMQ has sent what this process
    queued, by terminating the process-wide context (its sockets must be closed, each lingers up
    to its `linger`). True when done. A process must not exit before this: frames of 64 KiB or
    more go out zero-copy, and at interpreter exit pyzmq drops its references to their buffers
    while ZeroMQ's I/O thread may still be writing them — the write then faults ("Bad address
    (src/tcp.cpp:227)" and SIGABRT, or SIGSEGV), which killed trainers after their large last
    message (a trace's spans). False when a socket is still open (a thread stuck in a call):
    then the caller should end the process with `os._exit`, skipping that interpreter clean-up."""
    ctx = zmq.Context.instance()
    done = threading.Thread(target=ctx.term, name="hetps-zmq-term", daemon=True)
    done.start()
    done.join(timeout)
    return not done.is_alive()


def pack_tensors(values: list[tuple[str, Any]]) -> tuple[list[list], list[np.ndarray]]:
    """(descriptors, arrays) for a tensor message; see the module docstring."""
    descs, arrays = [], []
    for name, v in values:
        if isinstance(v, SparseRows):
            descs.append([name, int(v.height)])
            arrays += [np.asarray(v.rows), np.asarray(v.values)]
        else:
            descs.append([name, None])
            arrays.append(v)
    return descs, arrays


def unpack_tensors(descs: list[list], arrays: list[np.ndarray]) -> dict[str, Any]:
    """{name: array or SparseRows} from a tensor message's descriptors and arrays."""
    out, i = {}, 0
    for name, height in descs:
        if height is None:
            out[name] = arrays[i]
            i += 1
        else:
            out[name] = SparseRows(arrays[i], arrays[i + 1], height)
            i += 2
    return out
