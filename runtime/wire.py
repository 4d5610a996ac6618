"""The data-plane frame format: one message = a small JSON header + raw array buffers (+ an HMAC).

A message is a list of ZeroMQ multipart frames:

    [header JSON (utf-8), buffer 0, ..., buffer n-1, HMAC-SHA256 tag (only with a shared secret)]

The header is a JSON object; `encode` adds the key `"arrays"`: one `[dtype, shape]` per buffer, dtype
as numpy's explicit-byte-order string (`"<f4"`, `"<i8"`, `"|b1"`). Nothing is ever unpickled: a
receiver rebuilds arrays with `np.frombuffer` after checking every dtype against a numeric allow-list
and every buffer length against its shape, so a hostile peer can at worst earn an exception.

With a secret, the tag covers every other frame (each prefixed by its 8-byte length, so frames cannot
be re-cut) and is checked before the header is parsed. The tag authenticates the sender; it does not
stop a recorded message from being replayed, so a secret is no substitute for a private network.
Parameter servers and trainer-to-trainer channels share this format.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_HEADER_BYTES = 1 << 20
TAG_BYTES = 32
DTYPES = frozenset(np.dtype(t).str for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "<f2", "<f4", "<f8"))


class WireError(ValueError):
    """A message that does not follow the frame format (the text says which part is wrong)."""


class AuthError(WireError):
    """A message whose HMAC tag is missing or wrong for this endpoint's shared secret."""


def _tag(secret: bytes, frames: Sequence[Any]) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for f in frames:
        mac.update(len(f).to_bytes(8, "little"))
        mac.update(f)
    return mac.digest()


def _as_buffer(frame: Any) -> memoryview:
    """bytes, memoryview or zmq.Frame -> a flat byte view (no copy)."""
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = (),
           secret: bytes | None = None) -> list[Any]:
    """Frames for `header` and `arrays` (sent without copying when they are C-contiguous).

    Arrays must be in little-endian numeric form; big-endian ones are converted.
    """
    if "arrays" in header:
        raise WireError("header key 'arrays' is reserved for the array descriptors")
    descs, bufs = [], []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if a.dtype.str not in DTYPES:
            raise WireError(f"array {i} has dtype {a.dtype}; the wire carries only "
                            f"{sorted(DTYPES)}")
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        descs.append([a.dtype.str, list(a.shape)])
        bufs.append(memoryview(a).cast("B") if a.size else b"")
    frames: list[Any] = [json.dumps({**header, "arrays": descs}, separators=(",", ":")).encode()]
    frames += bufs
    if secret is not None:
        frames.append(_tag(secret, frames))
    return frames


def decode(frames: Sequence[Any], secret: bytes | None = None) -> tuple[dict[str, Any], list[np.ndarray]]:
    """(header, arrays) from frames; arrays are read-only views of the frames.

    Raises AuthError when `secret` is set and the tag is missing or wrong, WireError when the
    message is malformed (too few / many frames, bad JSON, a dtype off the allow-list, a buffer whose
    length does not match its shape).
    """
    bufs = [_as_buffer(f) for f in frames]
    if secret is not None:
        if len(bufs) < 2 or len(bufs[-1]) != TAG_BYTES:
            raise AuthError("message carries no HMAC tag, but this endpoint requires one "
                            "(is the sender configured with the shared secret?)")
        if not hmac.compare_digest(_tag(secret, bufs[:-1]), bytes(bufs[-1])):
            raise AuthError("message HMAC does not match: sender uses a different shared secret "
                            "or the frames were altered")
        bufs = bufs[:-1]
    if not bufs:
        raise WireError("empty message: expected a JSON header frame")
    if len(bufs[0]) > MAX_HEADER_BYTES:
        raise WireError(f"header frame is {len(bufs[0])} bytes, more than {MAX_HEADER_BYTES}")
    try:
        header = json.loads(bytes(bufs[0]))
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"header frame is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise WireError("header must be a JSON object with an 'arrays' list")
    descs = header.pop("arrays")
    if len(descs) != len(bufs) - 1:
        extra = " (an HMAC tag, but this endpoint has no secret?)" if len(bufs) - 1 == len(descs) + 1 else ""
        raise WireError(f"header describes {len(descs)} arrays but {len(bufs) - 1} buffer frames "
                        f"follow{extra}")
    return header, [_array(i, d, b) for i, (d, b) in enumerate(zip(descs, bufs[1:], strict=True))]


def _array(i: int, desc: Any, buf: memoryview) -> np.ndarray:
    ok = (isinstance(desc, list) and len(desc) == 2 and isinstance(desc[0], str)
          and isinstance(desc[1], list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in desc[1]))
    if not ok:
        raise WireError(f"array {i}: descriptor {desc!r} is not [dtype string, [non-negative dims]]")
    dtype, shape = desc
    if dtype not in DTYPES:
        raise WireError(f"array {i}: dtype {dtype!r} not allowed; allowed: {sorted(DTYPES)}")
    dt = np.dtype(dtype)
    count = math.prod(shape)
    if count * dt.itemsize != len(buf):
        raise WireError(f"array {i}: shape {shape} of {dtype} needs {count * dt.itemsize} bytes, "
                        f"frame has {len(buf)}")
    return np.frombuffer(buf, dtype=dt, count=count).reshape(shape)
