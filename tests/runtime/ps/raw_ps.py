"""A hand-made parameter-server client for tests: a DEALER socket that signs like `PSClient` (its
name's per-client key, a session opened by hello, increasing sequence numbers) but sends whatever
frames it is given."""

from __future__ import annotations

import zmq

from runtime.transport import zap
from runtime.transport.wire import AuthError, client_key, decode, encode, sign


class Raw:
    def __init__(
        self, servers, key: bytes | None = None, cid: str = "raw", shard: int = 0, hello: bool = True
    ) -> None:
        self.name = cid[:60].replace("/", "|")
        self.key = client_key(servers.secret, self.name) if key is None else key
        self.cid, self.seq, self.to, self.sess = f"{self.name}/raw", 0, shard, None
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        zap.credentials(self.sock, self.name, client_key(servers.secret, self.name))  # (to connect at all)
        self.sock.connect(servers.endpoints[shard])
        if hello:
            reply = self.ask(self.sign({"op": "hello"}))
            assert reply["ok"], reply
            self.sess = reply["session"]

    def sign(self, header: dict, arrays: list = (), **fields) -> list:
        self.seq += 1
        h = {**header, "cid": self.cid, "seq": self.seq, "to": self.to, **fields}
        if self.sess is not None:
            h.setdefault("sess", self.sess)
        return encode(h, arrays, self.key, self.name)

    def signed_raw(self, header_bytes: bytes, *buffers: bytes) -> list:
        """Frames whose header is exactly `header_bytes` (e.g. not valid MessagePack), signed with the key."""
        return sign([header_bytes, *buffers], self.key, self.name)

    def ask(self, frames: list, timeout_ms: int = 10_000) -> dict:
        self.sock.send_multipart(frames)
        assert self.sock.poll(timeout_ms), "the shard did not answer (is it dead?)"
        reply = self.sock.recv_multipart()
        try:
            return decode(reply, self.key)[0]
        except AuthError:
            return decode(reply, None)[0]

    def close(self) -> None:
        self.sock.close()
