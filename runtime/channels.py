"""Trainer-to-trainer messaging: one ZeroMQ PULL socket per process, PUSH sockets to its peers.

Every process of a run (trainer or driver) binds one inbox (`Inbox`) at an address the engine gives
it (`ipc://` on the local engine) and sends to others through an `Outbox`, which connects one PUSH
socket per destination on first use. Messages use the data-plane frame format of `runtime.wire`
(JSON header + raw array buffers, optional MAC; never pickle). Sends never block a trainer: a PUSH
socket queues up to its high-water mark, and a trainer never has more than `micro_batches`
micro-batches in flight, so queues stay short. Arrays go out without a copy (`copy=False`): a sender
must not write into an array after sending it (the executor makes fresh arrays for every op).

ZeroMQ keeps the order of messages between one sender and one receiver, which the trainers rely on:
a step's announcement reaches a trainer before that step's tensors from the same sender.

Tensor messages carry one micro-batch's tensors for one destination:
    header {"k": "t", "s": step, "o": origin trainer index, "m": micro-batch, "v": [[name, height]]}
`height` is None for a dense array; for a row-sparse gradient (`SparseRows`) it is the height and the
message carries two arrays (rows, values) for that name.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import zmq

from ops_registry import SparseRows

from .wire import decode, encode


class Inbox:
    """The bound receiving end of one process. `recv(timeout_ms)` -> (header, arrays) or None."""

    def __init__(self, endpoint: str, secret: bytes | None = None,
                 context: zmq.Context | None = None) -> None:
        self.secret = secret
        self.sock = (context or zmq.Context.instance()).socket(zmq.PULL)
        self.sock.linger = 0
        self.sock.rcvhwm = 0  # never drop or stall a sender: the sender bounds what is in flight
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_ms: float = 0) -> tuple[dict, list[np.ndarray]] | None:
        """The next message, waiting at most `timeout_ms` (0: only if one is queued)."""
        if not self.sock.poll(timeout_ms):
            return None
        return decode(self.sock.recv_multipart(copy=False), self.secret)

    def close(self) -> None:
        self.sock.close()


class Outbox:
    """PUSH sockets to named peers (connected lazily); `send(endpoint, header, arrays)`."""

    def __init__(self, secret: bytes | None = None, context: zmq.Context | None = None,
                 linger_ms: int = 2000) -> None:
        self.secret, self.linger_ms = secret, linger_ms
        self.ctx = context or zmq.Context.instance()
        self.socks: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, header: dict[str, Any], arrays: list[Any] = ()) -> None:
        sock = self.socks.get(endpoint)
        if sock is None:
            sock = self.socks[endpoint] = self.ctx.socket(zmq.PUSH)
            sock.linger = self.linger_ms  # let queued messages out when the process finishes
            sock.sndhwm = 0
            sock.connect(endpoint)
        sock.send_multipart(encode(header, arrays, self.secret), copy=False)

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.socks = {}


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
