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

Same-host tensors go through shared memory (`runtime.transport.shm`): an `Outbox` writes a message's arrays
into a ring segment it owns for that receiver and sends only the signed control message; other hosts,
and endpoints without a shared-memory directory, use ZeroMQ frames.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from ops_registry import SparseRows
from runtime.transport.shm import ShmRing, ShmSegments, copied, shm_dir
from runtime.transport.wire import AuthError, ReplayGuard, WireError, decode, encode, wire_array

log = logging.getLogger("hetps.channels")
REFUSALS_PER_CALL = 100  # refused messages one `Inbox.recv` skips before it returns None
# how long a process that ends waits for its messages to a `patient` peer (the driver) to go out: a
# driver stopped (SIGSTOP, Ctrl-Z) meanwhile reads them once continued, so a run that finished is not
# judged failed for a trainer's last report lost at its exit
PATIENT_LINGER_S = 60.0


class Inbox:
    """The bound receiving end of one process. `recv(timeout_ms)` -> (header, arrays) or None.

    With a secret, a message that is not signed with it, or that repeats or reorders its sender's
    numbering (`Outbox` stamps `cid` / `seq`; a captured message sent again), is refused: logged,
    counted in `refused` (the last reason in `last_refused`) and skipped, so that no one without the
    key can stop a run (a call returns None after `REFUSALS_PER_CALL` of them, so that a flood does
    not hold its caller either). A signed message that is malformed (a peer's bug) raises WireError."""

    def __init__(
        self, endpoint: str, secret: bytes | None = None, context: zmq.Context | None = None
    ) -> None:
        self.secret = secret
        self.sock = (context or zmq.Context.instance()).socket(zmq.PULL)
        self.sock.linger = 0
        self.sock.rcvhwm = 0  # never drop or stall a sender: the sender bounds what is in flight
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        shm = shm_dir(self.endpoint)
        self.segments = None if shm is None else ShmSegments(shm)
        self.guard = None if secret is None else ReplayGuard()
        self.refused, self.last_refused = 0, ""

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
            frames = self.sock.recv_multipart(copy=False)
            try:
                header, arrays = decode(frames, self.secret)
                if self.guard is not None:
                    self.guard.check(header)
                    del header["cid"], header["seq"]
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

    def close(self) -> None:
        self.sock.close()
        if self.segments is not None:
            self.segments.close()


class Outbox:
    """PUSH sockets to named peers (connected lazily); `send(endpoint, header, arrays)`. When the
    process ends, what it queued for a peer goes out for up to `linger_ms`, for the `patient`
    endpoints (the driver's inbox) up to `PATIENT_LINGER_S`."""

    def __init__(
        self,
        secret: bytes | None = None,
        context: zmq.Context | None = None,
        linger_ms: int = 2000,
        shm: bool = True,
        patient: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.secret, self.linger_ms, self.shm = secret, linger_ms, shm
        self.patient = frozenset(patient)
        # with a secret every message carries this Outbox's id and number (Inbox refuses replays)
        self.cid, self.seq = os.urandom(8).hex(), 0
        self.ctx = context or zmq.Context.instance()
        self.socks: dict[str, zmq.Socket] = {}
        self.rings: dict[str, ShmRing | None] = {}

    def send(self, endpoint: str, header: dict[str, Any], arrays: list[Any] = ()) -> None:
        if self.secret is not None:
            self.seq += 1
            header = {**header, "cid": self.cid, "seq": self.seq}
        sock = self.socks.get(endpoint)
        if sock is None:
            sock = self.socks[endpoint] = self.ctx.socket(zmq.PUSH)
            # let queued messages out when the process finishes
            sock.linger = int(PATIENT_LINGER_S * 1000) if endpoint in self.patient else self.linger_ms
            sock.sndhwm = 0
            sock.connect(endpoint)
        if self.shm and arrays:
            ring = self._ring(endpoint)
            if ring is not None:
                laid = [wire_array(i, a, contiguous=False) for i, a in enumerate(arrays)]  # (put copies)
                if desc := ring.put(laid):
                    sock.send_multipart(encode({**header, "shm": desc}, (), self.secret))
                    return
        sock.send_multipart(encode(header, arrays, self.secret), copy=False)

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
