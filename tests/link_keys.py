"""Link keys for tests of inboxes (runtime.transport.channels), as the driver hands them out: a
receiver "b" that hears senders "a" and "c", under one master secret; and a raw sender that logs in
(or not) and sends hand-made frames, as a hostile peer would."""

from __future__ import annotations

import os

import zmq

from runtime.transport import zap
from runtime.transport.channels import Links
from runtime.transport.wire import encode, link_key
from runtime.transport.zap import Gate

MASTER = os.urandom(32)


def inbox_links(name: str = "b", senders: tuple[str, ...] = ("a", "c")) -> Links:
    return Links.derive(MASTER, name, senders=senders)


def outbox_links(*eps: str, name: str = "a", receiver: str = "b") -> Links:
    """Sender `name`'s links: every endpoint of `eps` is (a place of) `receiver` (a tap records what
    `receiver` would get)."""
    key = link_key(MASTER, name, receiver)
    return Links(name, {ep: key for ep in eps}, {})


def signed(header: dict, arrays: list = (), sender: str = "a", receiver: str = "b", key: bytes | None = None):
    """Frames of a message signed as `sender` (with `key`, default: the real key of its link)."""
    return encode(header, arrays, key or link_key(MASTER, sender, receiver), sender)


def raw_push(ep: str, *messages: list, login: str | None = "a", receiver: str = "b") -> None:
    """Send `messages` (lists of frames) in order through one raw socket logged in as `login` with
    its link key's token (None: no login, a peer without a key)."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.linger, sock.sndhwm = 1000, 0
    if login is not None:
        zap.credentials(sock, login, link_key(MASTER, login, receiver))
    sock.connect(ep)
    try:
        for frames in messages:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)  # (a refused login leaves no pipe to queue in)
    except zmq.Again:
        pass
    finally:
        sock.close()


class Tap:
    """A raw PULL socket bound at `ep` that an Outbox logs in to as it would to receiver "b" (a login
    gate on its own context), as an eavesdropper in b's place: `poll`, `recv_multipart`, `close`."""

    def __init__(self, ep: str, receiver: str = "b") -> None:
        self.ctx = zmq.Context()
        self.gate = Gate(self.ctx, lambda name: link_key(MASTER, name, receiver))
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.linger = 0
        Gate.guard(self.sock)
        self.sock.bind(ep)
        self.poll, self.recv_multipart = self.sock.poll, self.sock.recv_multipart

    def close(self) -> None:
        self.sock.close()
        self.gate.close()
        self.ctx.term()
