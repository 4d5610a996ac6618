"""The data-plane frame format: one message = a small MessagePack header + raw array buffers (+ a MAC).

A message is a list of ZeroMQ multipart frames:

    [header frame, buffer 0, ..., buffer n-1, MAC frame (only with a shared secret)]

The header frame is MessagePack (msgspec) of a two-element array `[header, arrays]`: `header` a map
of string keys (values: nil, bool, int, float, string, arrays and maps of them), `arrays` one
`[dtype, shape]` per buffer, dtype as numpy's explicit-byte-order string (`"<f4"`, `"<i8"`, `"|b1"`).
Nothing is ever unpickled: the header frame is decoded by one typed msgspec decoder, which checks in
the same pass (in C) that the header is a map of string keys nested at most `MAX_HEADER_DEPTH`
levels, every dtype is on the numeric allow-list and every shape is a list of at most `MAX_DIMS`
non-negative ints; a receiver then rebuilds arrays with `np.frombuffer` after checking every
buffer's length against its shape, so a hostile peer can at worst earn an exception. (It was JSON
plus Python-level depth and descriptor checks: 3-5x the CPU per message, measured in
benchmarks/ps_messages.py.)

With a secret, the MAC covers every other frame (each prefixed by its 8-byte length, so frames cannot
be re-cut) and is checked before the header is parsed. The MAC frame is a random 16-byte nonce and a
16-byte tag. Messages of up to `SMALL_MAC_BYTES` (every control message, header and small arrays)
are tagged by keyed BLAKE2b (key: BLAKE2b of the secret; the nonce as its salt), which costs ~1 µs
in the stdlib; larger ones by Poly1305 under a one-time key BLAKE2b(secret, nonce) (`cryptography`'s
Poly1305, the MAC of ChaCha20-Poly1305 / NaCl, keyed per message as they do): ~6x faster than
HMAC-SHA256 on large tensors even with the CPU's SHA instructions and ~10x faster than BLAKE2b, but
it costs 2–12 µs to set up per message (an OpenSSL key object), 3-4x keyed BLAKE2b on a small one.
Sender and receiver pick the same one from the frames' total length, which the MAC covers.

Per-client keys: a receiver that holds a master secret (a parameter server) may give each client its
own key, `client_key(master, name)`, which the driver derives and hands to that client alone. Such a
client's MAC frame carries its name after the tag (`sign(..., sender=name)`), the receiver derives
the key from the name and checks the tag under it, and `Signed.sender` is the name: a client can
sign only as itself, so a holder of one client's key cannot claim another client's identity.

Per-link keys: a process's inbox (`channels.Inbox`) accepts a message only under the key of the
link from its sender to it, `link_key(master, sender, receiver)`, which the driver derives from the
run's master secret and hands to the two ends of that link alone; the MAC frame names the sender as
above, so a trainer signs only as itself and only to the peers it has links to.

The MAC authenticates the sender; on its own
it does not stop a recorded message from being replayed: a receiver that must refuse replays checks
the header's sender id `cid` and sequence number `seq` — a parameter server with `Sessions`, every
trainer's and driver's `channels.Inbox` with a `LinkGuard`. Both fail closed: a sender they do not
remember is refused, never trusted. Parameter servers and trainer-to-trainer channels share this format.

Limits (each a WireError naming it): a message of more than `max_bytes` when the receiver gives one
(the parameter server does: `MAX_MESSAGE_BYTES` by default), a header frame of more than
`MAX_HEADER_BYTES` or nested deeper than `MAX_HEADER_DEPTH`, an array of more than `MAX_DIMS`
dimensions or of more elements than memory can address.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import msgspec
import numpy as np
from cryptography.hazmat.primitives.poly1305 import Poly1305

from ops_registry.errors import HetpsError

MAX_MESSAGE_BYTES = 1 << 30  # all frames of one request to a parameter server together
MAX_HEADER_BYTES = 1 << 20
# nesting of the header's maps and arrays (the header itself: 1); hetps's deepest message has 7
# (a shard's description of its tables). The typed decoder's construction doubles with each level: 0.05 s
# of every process's import at 10, 0.9 s at 16.
MAX_HEADER_DEPTH = 10
MAX_DIMS = 32  # dimensions of one array (numpy allows 64)
MAX_SENDERS = 4096  # sender ids a `Sessions` or a `LinkGuard` remembers
MAX_IDS_PER_NAME = 64  # a `LinkGuard`'s sender ids (Outbox instances) per link name
MAX_NAME_BYTES = 64  # a per-client key's name, carried in the MAC frame
NONCE_BYTES = 16
TAG_BYTES = NONCE_BYTES + 16  # the MAC frame: nonce + tag
SMALL_MAC_BYTES = 64 << 10  # messages up to this many bytes (length prefixes included) get a BLAKE2b tag
DTYPES = frozenset(
    np.dtype(t).str
    for t in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "<f2",
        "<f4",
        "<f8",
    )
)


def _value_type(levels: int) -> Any:
    """The type of a header value holding at most `levels` levels of arrays and maps."""
    t: Any = Union[None, bool, int, float, str]  # noqa: UP007 (a runtime type for msgspec)
    for _ in range(levels):
        t = Union[None, bool, int, float, str, list[t], dict[str, t]]  # noqa: UP007
    return t


NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Dtype = Literal[tuple(sorted(DTYPES))]  # msgspec types of an array descriptor's dtype and shape
Dims = Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_DIMS)]


class _Frame(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The header frame: [header, [[dtype, shape], ...]], validated in one pass by `_DECODER`."""

    header: dict[str, _value_type(MAX_HEADER_DEPTH - 1)]
    arrays: list[tuple[Dtype, Dims]]


_DECODER = msgspec.msgpack.Decoder(_Frame)


def _numpy_scalar(obj: Any) -> Any:
    """Header values that are numpy scalars travel as the Python number they hold."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"a message header cannot carry {type(obj).__name__} values")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_numpy_scalar)


class WireError(HetpsError, ValueError):
    """A message that does not follow the frame format (the text says which part is wrong)."""


class AuthError(WireError):
    """A message whose MAC is missing or wrong for this endpoint's shared secret."""


class ReplayError(AuthError):
    """An authentic message whose sequence number is not newer than the last one of its sender."""


@functools.lru_cache(maxsize=16)
def _mac_key(secret: bytes) -> bytes:
    """A 64-byte BLAKE2b key from a shared secret of any length."""
    return hashlib.blake2b(secret, digest_size=64, person=b"hetps-wire-key").digest()


def _tag(secret: bytes, frames: Sequence[Any], nonce: bytes) -> bytes:
    """The MAC frame of `frames`: `nonce` + their tag (keyed BLAKE2b for a small message, else
    Poly1305 under the one-time key of `nonce`; see the module docstring)."""
    key = _mac_key(secret)
    if sum(len(f) for f in frames) + 8 * len(frames) <= SMALL_MAC_BYTES:
        return (
            nonce
            + _feed(
                hashlib.blake2b(key=key, salt=nonce, digest_size=16, person=b"hetps-wire-tag"), frames
            ).digest()
        )
    one_time = hashlib.blake2b(nonce, key=key, digest_size=32, person=b"hetps-wire-mac").digest()
    return nonce + _feed(Poly1305(one_time), frames).finalize()


@functools.lru_cache(maxsize=4096)
def client_key(master: bytes, name: str) -> bytes:
    """The key of client `name` under a receiver's `master` secret (see the module docstring)."""
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        raise WireError(f"a client name must be 1 to {MAX_NAME_BYTES} bytes, got {name!r:.100}")
    return hashlib.blake2b(
        name.encode(), key=_mac_key(master), digest_size=32, person=b"hetps-client"
    ).digest()


@functools.lru_cache(maxsize=4096)
def link_key(master: bytes, sender: str, receiver: str) -> bytes:
    """The key of the link from process `sender` to process `receiver` under the run's `master`
    secret (see the module docstring): the driver derives it, only the two ends hold it."""
    for name in (sender, receiver):
        if not name or len(name.encode()) > MAX_NAME_BYTES or "/" in name:
            raise WireError(f"a link's end must be 1 to {MAX_NAME_BYTES} bytes, no '/', got {name!r:.100}")
    return hashlib.blake2b(
        f"{sender}/{receiver}".encode(), key=_mac_key(master), digest_size=32, person=b"hetps-link"
    ).digest()


def _feed(mac: Any, frames: Sequence[Any]) -> Any:
    """`mac` updated with every frame, each prefixed by its length (8 bytes, little-endian)."""
    for f in frames:
        mac.update(len(f).to_bytes(8, "little"))
        mac.update(f)
    return mac


def _as_buffer(frame: Any) -> memoryview:
    """bytes, memoryview or zmq.Frame -> a flat byte view (no copy)."""
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


def encode(
    header: dict[str, Any],
    arrays: Sequence[np.ndarray] = (),
    secret: bytes | None = None,
    sender: str | None = None,
) -> list[Any]:
    """Frames for `header` and `arrays` (sent without copying when they are C-contiguous).

    Arrays must be in little-endian numeric form; big-endian ones are converted. WireError when the
    header cannot travel (a value that is not nil, bool, int of 64 bits, float, string, list or map
    with string keys).
    """
    descs, bufs = [], []
    for i, a in enumerate(arrays):
        a = wire_array(i, a)
        descs.append((a.dtype.str, a.shape))
        bufs.append(memoryview(a).cast("B") if a.size else b"")
    try:
        frames: list[Any] = [_ENCODER.encode((header, descs))]
    except (TypeError, OverflowError) as e:
        raise WireError(f"message header cannot be encoded: {e}") from None
    frames += bufs
    return frames if secret is None else sign(frames, secret, sender)


def header_frame(header: Any, descs: Any = ()) -> bytes:
    """A raw header frame of any content (tests and benchmarks build hostile messages with it)."""
    return _ENCODER.encode((header, descs))


def wire_array(i: int, a: Any, contiguous: bool = True) -> np.ndarray:
    """Array `i` of a message as the wire carries it: C-contiguous (unless `contiguous` is False:
    for a copy into shared memory, which lays it out itself), little-endian, an allowed dtype
    (WireError otherwise); no copy when it already is."""
    a = np.asarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if a.dtype.str not in DTYPES:
        raise WireError(f"array {i} has dtype {a.dtype}; the wire carries only {sorted(DTYPES)}")
    return a if a.flags.c_contiguous or not contiguous else a.copy(order="C")


def sign(frames: Sequence[Any], secret: bytes, sender: str | None = None) -> list[Any]:
    """`frames` with their MAC frame appended, under a fresh random nonce (what `encode` does with a
    secret; also lets tests and benchmarks sign frames that `encode` would never produce); `sender`:
    the name of a per-client key `secret` (`client_key`), carried after the tag."""
    tag = _tag(secret, frames, os.urandom(NONCE_BYTES))
    return [*frames, tag if sender is None else tag + sender.encode()]


def decode(
    frames: Sequence[Any], secret: bytes | None = None, *, max_bytes: int | None = None
) -> tuple[dict[str, Any], list[np.ndarray]]:
    """(header, arrays) from frames; arrays are read-only views of the frames.

    Raises AuthError when `secret` is set and the tag is missing or wrong, WireError when the
    message is malformed (too few / many frames, a header frame that is not a valid header, a dtype
    off the allow-list, a buffer whose length does not match its shape) or over a limit (see the
    module docstring).
    """
    signed = decode_signed(frames, () if secret is None else (secret,), max_bytes=max_bytes)
    return signed.header, signed.arrays


@dataclass
class Signed:
    """A decoded message and which of the receiver's keys signed it (None: unsigned)."""

    header: dict[str, Any]
    arrays: list[np.ndarray]
    key: int | None
    sender: str | None = None  # the name of the per-client key that signed it


def decode_signed(
    frames: Sequence[Any],
    keys: Sequence[bytes] = (),
    *,
    max_bytes: int | None = None,
    master: bytes | None = None,
    key_of: Callable[[str], bytes] | None = None,
) -> Signed:
    """`decode` for an endpoint that accepts several keys (e.g. a data key and an admin key): the
    message must be signed by one of `keys` (none: unsigned), and `Signed.key` says which. With
    `master`, a message may instead be signed by a per-client key (`client_key(master, name)`; then
    `Signed.key` is None and `Signed.sender` the name); with `key_of`, by the key `key_of(name)` of
    the name it carries (KeyError: no such sender; an inbox's link keys)."""
    bufs = [_as_buffer(f) for f in frames]
    if max_bytes is not None and (total := sum(len(b) for b in bufs)) > max_bytes:
        raise WireError(f"message is {total} bytes, more than the limit of {max_bytes} (max_message_bytes)")
    if master is not None:
        key_of = functools.partial(client_key, master)
    key = sender = None
    if keys or key_of is not None:
        key, sender = _verify(bufs, keys, key_of)
        bufs = bufs[:-1]
    if not bufs:
        raise WireError("empty message: expected a header frame")
    if len(bufs[0]) > MAX_HEADER_BYTES:
        raise WireError(f"header frame is {len(bufs[0])} bytes, more than {MAX_HEADER_BYTES}")
    try:
        frame = _DECODER.decode(bufs[0])
    except msgspec.ValidationError as e:
        raise WireError(_invalid(str(e))) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise WireError(f"header frame is not MessagePack: {e}") from None
    descs = frame.arrays
    if len(descs) != len(bufs) - 1:
        extra = " (a MAC tag, but this endpoint has no secret?)" if len(bufs) - 1 == len(descs) + 1 else ""
        raise WireError(
            f"header describes {len(descs)} arrays but {len(bufs) - 1} buffer frames follow{extra}"
        )
    arrays = [checked_view(i, *desc, b) for i, (desc, b) in enumerate(zip(descs, bufs[1:], strict=True))]
    return Signed(frame.header, arrays, key, sender)


def _verify(
    bufs: list[memoryview], keys: Sequence[bytes], key_of: Callable[[str], bytes] | None
) -> tuple[int | None, str | None]:
    """(which of `keys` signed `bufs`, or None and the name of the `key_of` key that did); AuthError
    when none did."""
    last = len(bufs[-1]) if len(bufs) >= 2 else 0
    if last < TAG_BYTES or (last > TAG_BYTES and (key_of is None or last > TAG_BYTES + MAX_NAME_BYTES)):
        raise AuthError(
            "message carries no MAC tag, but this endpoint requires one "
            "(is the sender configured with the shared secret?)"
        )
    tag = bytes(bufs[-1])
    nonce, candidates, sender = tag[:NONCE_BYTES], list(enumerate(keys)), None
    if last > TAG_BYTES:
        try:
            sender = tag[TAG_BYTES:].decode("ascii")
            candidates = [(None, key_of(sender))]
        except UnicodeDecodeError:
            raise AuthError("message MAC frame names its sender in other than ASCII") from None
        except KeyError:
            raise AuthError(f"message signed as {sender!r}, which has no link to this endpoint") from None
        tag = tag[:TAG_BYTES]
    key = next((i for i, k in candidates if hmac.compare_digest(_tag(k, bufs[:-1], nonce), tag)), False)
    if key is False:
        raise AuthError(
            "message MAC does not match: sender uses a different shared secret or the frames were altered"
        )
    return key, sender


def _invalid(why: str) -> str:
    """The reason a header frame that is MessagePack failed `_DECODER`'s checks (msgspec's text)."""
    if why.startswith("Expected `bool | int | float | str | null`, got `"):  # (only the deepest level)
        return f"header is nested deeper than {MAX_HEADER_DEPTH} levels ({why})"
    if "`$[1]" in why:
        return (
            f"array descriptor refused: {why}; each must be [dtype, shape], dtype one of "
            f"{sorted(DTYPES)}, shape at most {MAX_DIMS} non-negative ints"
        )
    return (
        f"header frame is not [header, array descriptors] with the header a map of string keys "
        f"(values nil, bool, int, float, string, arrays, maps): {why}"
    )


def checked_view(i: int, dtype: str, shape: list[int], buf: memoryview) -> np.ndarray:
    """Array `i` as a view of `buf`, for a descriptor already checked against the allow-list and the
    limits (`Dtype`, `Dims`): WireError unless `buf` holds exactly `shape` of `dtype`."""
    dt = np.dtype(dtype)
    count = math.prod(shape)
    if count * dt.itemsize != len(buf):
        raise WireError(
            f"array {i}: shape {shape} of {dtype} needs {count * dt.itemsize} bytes, frame has {len(buf)}"
        )
    try:
        return np.frombuffer(buf, dtype=dt, count=count).reshape(shape)
    except (ValueError, OverflowError) as e:  # e.g. [0, 2**63]: no bytes, but no such numpy shape
        raise WireError(f"array {i}: shape {shape} is not a valid array shape: {e}") from None


class LinkGuard:
    """An inbox's replay guard, failing closed. Every message's MAC names its sender (the link whose
    key verified it, `decode_signed`'s `key_of`); its header's sender id `cid` = "name/instance"
    (an `Outbox`'s own id) must carry that name — a message claiming another sender is refused —
    and its `seq` must be newer than the last one accepted from that id. Memory is bounded and
    nothing is forgotten: at most `max_senders` ids in all and `max_ids` per name; a new id past
    either bound is refused (a forgotten id's captured messages would be accepted again)."""

    def __init__(self, max_senders: int = MAX_SENDERS, max_ids: int = MAX_IDS_PER_NAME) -> None:
        self.max_senders, self.max_ids = max_senders, max_ids
        self.last: dict[str, int] = {}  # cid -> last seq
        self.per_name: dict[str, int] = {}

    def check(self, sender: str | None, header: dict[str, Any]) -> None:
        """ReplayError unless `header` (of a message the link key of `sender` verified) is new."""
        cid, seq = header.get("cid"), _seq(header)
        name = Sessions.name_of(cid)
        if name != sender:
            raise ReplayError(
                f"message claims sender {cid!r:.80} but is signed with the link key of "
                f"{sender!r:.80}; refused"
            )
        last = self.last.get(cid)
        if last is None:
            if self.per_name.get(name, 0) >= self.max_ids or len(self.last) >= self.max_senders:
                raise ReplayError(
                    f"sender id {cid!r:.80} is one too many (at most {self.max_ids} per sender, "
                    f"{self.max_senders} in all, none forgotten); refused"
                )
            self.per_name[name] = self.per_name.get(name, 0) + 1
        elif seq <= last:
            raise ReplayError(
                f"sender {cid!r:.80} sent sequence number {seq} after {last}: a replayed "
                "or reordered message; refused"
            )
        self.last[cid] = seq


MAX_SESSIONS_PER_NAME = 256  # a client name's sessions a `Sessions` keeps (its oldest forgotten first)


class Sessions:
    """A server's replay guard that fails closed. A client (header `cid` = "name/instance", the
    name its per-client key was derived for) opens a session with a hello (`open`: a fresh random
    session id, which the reply carries); every later request must carry it (`sess`) and a
    sequence number (`seq`) newer than the last one accepted (`check`). A sender it does not know —
    never seen, or forgotten — is refused and must say hello again, so a captured request is never
    accepted after its sender was forgotten. It keeps at most `max_senders` sessions and at most
    MAX_SESSIONS_PER_NAME per name, forgetting the least recently used first (a name's own first),
    so one client's key cannot make the server forget the sessions of other clients."""

    def __init__(self, max_senders: int = MAX_SENDERS) -> None:
        self.max_senders = max_senders
        self.live: OrderedDict[str, list] = OrderedDict()  # cid -> [session id, last seq]
        self.per_name: dict[str, int] = {}

    @staticmethod
    def name_of(cid: Any) -> str:
        if not isinstance(cid, str) or "/" not in cid:
            raise ReplayError(f"a signed request needs a sender id 'cid' = 'name/instance', got {cid!r:.80}")
        return cid.split("/", 1)[0]

    @staticmethod
    def seq_of(header: dict[str, Any]) -> int:
        return _seq(header)

    def open(self, header: dict[str, Any]) -> str:
        """A new session for the hello `header`'s sender (ReplayError when it has one: a replayed hello)."""
        cid, seq = header.get("cid"), _seq(header)
        name = self.name_of(cid)
        if cid in self.live:
            raise ReplayError(f"sender {cid!r:.80} said hello twice: a replayed hello; refused")
        if self.per_name.get(name, 0) >= MAX_SESSIONS_PER_NAME:
            self._forget(next(c for c in self.live if self.name_of(c) == name))
        while len(self.live) >= self.max_senders:
            self._forget(next(iter(self.live)))
        session = os.urandom(8).hex()
        self.live[cid] = [session, seq]
        self.per_name[name] = self.per_name.get(name, 0) + 1
        return session

    def check(self, header: dict[str, Any]) -> None:
        """ReplayError unless the request belongs to a live session and is newer than its last."""
        cid, seq = header.get("cid"), _seq(header)
        got = self.live.get(cid) if isinstance(cid, str) else None
        if got is None or header.get("sess") != got[0]:
            raise ReplayError(
                f"sender {cid!r:.80} has no session here (never said hello, or forgotten among "
                f"more than {self.max_senders} senders): it must say hello again; refused"
            )
        if seq <= got[1]:
            raise ReplayError(
                f"sender {cid!r:.80} sent sequence number {seq} after {got[1]}: a replayed "
                "or reordered message; refused"
            )
        got[1] = seq
        self.live.move_to_end(cid)

    def _forget(self, cid: str) -> None:
        del self.live[cid]
        name = self.name_of(cid)
        self.per_name[name] -= 1
        if not self.per_name[name]:
            del self.per_name[name]


def _seq(header: dict[str, Any]) -> int:
    seq = header.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool):
        raise ReplayError(f"a signed message needs a sequence number 'seq' (int), got {seq!r:.80}")
    return seq
