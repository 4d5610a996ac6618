"""Authentication of a connection before any of its messages: ZeroMQ's ZAP with the PLAIN mechanism.

A message's MAC (wire.py) is checked once ZeroMQ has received the whole message, so without more an
unauthenticated peer could make a server buffer any number of frames, each up to its
`ZMQ_MAXMSGSIZE`, before the first is read. With a `Gate` on a bound socket, ZeroMQ asks the gate's
handler (a thread on the socket's context, ZAP's `inproc://zeromq.zap.01` endpoint) about every
new connection during its handshake, and drops it unless the peer's PLAIN user name is a client
name and its password that name's token, `token(key)` of its per-client key
(`wire.client_key(master, name)`; at a trainer's or the driver's inbox, of its link key
`wire.link_key(master, name, receiver)`): nothing a peer without a key sends is ever queued.

The password travels in the clear in the handshake (PLAIN has no encryption), so a token guards
memory, not messages: every message still carries its MAC, and a token a peer has seen lets it
connect but not sign.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from collections.abc import Callable

import zmq

log = logging.getLogger("hetps.zap")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
POLL_MS = 100  # how often the handler looks whether it should stop


def token(key: bytes) -> bytes:
    """The PLAIN password of a client whose per-client key is `key`."""
    return hashlib.blake2b(key, digest_size=16, person=b"hetps-zap").hexdigest().encode()


def credentials(sock: zmq.Socket, name: str, key: bytes) -> None:
    """Make `sock` (before it connects) log in as client `name` with key `key`."""
    sock.plain_username = name.encode()
    sock.plain_password = token(key)


class Gate:
    """The ZAP handler of one context, for the sockets `guard` puts behind it; `close` stops it."""

    def __init__(self, ctx: zmq.Context, key_of: Callable[[str], bytes]) -> None:
        self.key_of, self.refused = key_of, 0
        self.sock = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.bind(ZAP_ENDPOINT)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="hetps-zap", daemon=True)
        self.thread.start()

    @staticmethod
    def guard(sock: zmq.Socket) -> None:
        """Put bound socket `sock` (before it binds) behind the gate of its context."""
        sock.plain_server = True
        sock.zap_domain = b"hetps"

    def _serve(self) -> None:
        try:
            while not self.stop.is_set():
                if self.sock.poll(POLL_MS):
                    self.sock.send_multipart(self._answer(self.sock.recv_multipart()))
        finally:
            self.sock.close()

    def _answer(self, req: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (RFC 27): 200 for a known client's token, else 400."""
        version, rid = (req + [b"", b""])[:2]
        ok = False
        if len(req) >= 8 and req[5] == b"PLAIN":
            try:
                name = req[6].decode("ascii")
                ok = bool(name) and hmac.compare_digest(token(self.key_of(name)), req[7])
            except (UnicodeDecodeError, ValueError, LookupError):  # (not a client: no key)
                ok = False
        if not ok:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                peer = req[3].decode("ascii", "replace") if len(req) > 3 else "?"
                log.warning(
                    "refused a connection (%d so far), from %r: not a client of this run", self.refused, peer
                )
        return [version, rid, b"200" if ok else b"400", b"OK" if ok else b"unknown client", b"", b""]

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
