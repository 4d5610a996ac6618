"""Same-host tensors through shared memory: the rings an `Outbox` (runtime.transport.channels) and a
parameter server write, and the segments a receiver maps.

When the receiver's endpoint is an `ipc://` socket in a
local run directory whose shared-memory twin exists (`shm_dir_for`: /tmp/hetps-run-X ->
/dev/shm/hetps-run-X, made private by the local engine, which removes it with the run directory, as
its janitor does when the driver dies), an `Outbox` writes a message's arrays (from `SHM_MIN_BYTES`
together) into a ring segment it owns for that receiver, and sends over ZeroMQ only the signed
control message: the header plus `"shm": {"seg", "at", "n", "arrays": [[dtype, shape, offset,
bytes]]}`. The receiver maps the segment (once; it then unlinks its name, so the memory goes with the
two processes), checks the descriptor's types, dtypes and shapes in one pass (`msgspec.convert`,
the allow-list and limits of `runtime.transport.wire`), that the name is a plain file of its own directory
owned by this user, that the message lies inside the ring and every array's bytes match its shape,
copies the arrays out (`ShmSegments.arrays`; a parameter server in async mode reads them in place
instead, `ShmSegments.views`, until it has applied the request) and publishes how far it has read in
the segment's first 8 bytes, so the sender never overwrites what is unread (when the ring is full,
or the message over half of it, the message goes as ZeroMQ frames instead: sends never block). The
arrays themselves are not MAC'd: the segment is a 0600 file in a 0700 directory, so only this
user's processes can write it, and they can read the run's key as well (so reading in place, while
the sender could still write, trusts no one new; numpy bounds-checks every index it is given).
Other hosts, and endpoints without the twin, use ZeroMQ frames.
"""

from __future__ import annotations

import collections
import mmap
import os
import re
import stat
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import numpy as np

from runtime.transport.wire import Dims, Dtype, NonNegative, WireError, checked_view

SHM_ROOT = "/dev/shm"
SHM_MIN_BYTES = 16 << 10  # a message's arrays together; smaller ones go as ZeroMQ frames
SHM_RING_BYTES = 8 << 20  # per (sender, receiver) pair, mapped with its pages faulted in at once
_HEAD = 64  # segment = [bytes the receiver has consumed: uint64][padding] + the ring
_ALIGN = 64
_SEGMENT = re.compile(r"[0-9]+-[0-9a-f]{8}-[A-Za-z0-9_.-]{1,100}")


def shm_dir_for(run_dir: str) -> str:
    """The shared-memory twin of a local run directory: /tmp/hetps-run-X -> /dev/shm/hetps-run-X."""
    return os.path.join(SHM_ROOT, os.path.basename(os.path.normpath(run_dir)))


def shm_dir(endpoint: str) -> str | None:
    """The private shm directory for an `ipc://` endpoint of a local run, when it exists; else None."""
    if not endpoint.startswith("ipc://"):
        return None
    run_dir = os.path.dirname(endpoint[len("ipc://") :])
    if not os.path.basename(run_dir).startswith("hetps-run-"):
        return None
    path = shm_dir_for(run_dir)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    private = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
    return path if private else None


def _map(fd: int, size: int) -> mmap.mmap:
    """A shared mapping of `fd` with its pages faulted in now (MAP_POPULATE where there is one): a
    ring's first pass would otherwise take a page fault every 4 KiB, in both processes."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def _layout(arrays: list[np.ndarray]) -> tuple[list[int], int]:
    """Offsets of `arrays` in one message (each aligned to 64 bytes) and the message's length."""
    offsets, n = [], 0
    for a in arrays:
        offsets.append(n)
        n += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, n


_Offset = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]


class _ShmDesc(msgspec.Struct, forbid_unknown_fields=True):
    """A control message's `"shm"` descriptor, checked in one pass by `msgspec.convert`."""

    seg: str
    at: _Offset
    n: _Offset
    arrays: list[tuple[Dtype, Dims, NonNegative, NonNegative]]  # dtype, shape, offset, bytes


class ShmRing:
    """The sending end of one shared-memory segment to one receiver (see the module docstring)."""

    def __init__(self, directory: str, receiver: str, cap: int | None = None) -> None:
        self.name = f"{os.getpid()}-{os.urandom(4).hex()}-{receiver}"
        self.path = os.path.join(directory, self.name)
        self.cap = SHM_RING_BYTES if cap is None else cap
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, _HEAD + self.cap)
            self.map = _map(fd, _HEAD + self.cap)
        finally:
            os.close(fd)
        self.consumed = np.frombuffer(self.map, np.uint64, 1)
        self.data = np.frombuffer(self.map, np.uint8, offset=_HEAD)
        self.head = 0  # bytes written since the start (the ring position is head % cap)
        self.full = 0  # messages refused because the receiver had not read far enough

    def put(self, arrays: list[np.ndarray]) -> dict[str, Any] | None:
        """Write `arrays` (`wire.wire_array`s, contiguous or not: each is copied into the ring in C
        order) as one message; its descriptor, or None when it is under `SHM_MIN_BYTES` or does
        not fit now (send it as ZeroMQ frames then)."""
        offsets, n = _layout(arrays)
        if sum(a.nbytes for a in arrays) < SHM_MIN_BYTES or n > self.cap // 2:
            return None
        pos = self.head % self.cap
        start = self.head + (self.cap - pos if pos + n > self.cap else 0)  # a message never wraps
        if start + n - int(self.consumed[0]) > self.cap:
            self.full += 1
            return None  # the receiver has not read that far yet
        at = start % self.cap
        for a, off in zip(arrays, offsets, strict=True):
            if a.nbytes:
                self.data[at + off : at + off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        self.head = start + n
        return {
            "seg": self.name,
            "at": start,
            "n": n,
            "arrays": [
                [a.dtype.str, list(a.shape), off, a.nbytes] for a, off in zip(arrays, offsets, strict=True)
            ],
        }

    def close(self) -> None:
        """Unmap; unlink the name too once the receiver has read everything. A message it has not
        read yet (a process's last one, e.g. a trainer's trace spans, sent just before it exits)
        keeps the name for the receiver, which unlinks it when it maps it; the run's segment
        directory goes with the run either way."""
        if int(self.consumed[0]) >= self.head:
            try:
                os.unlink(self.path)  # (the receiver unlinks it once it has mapped it)
            except FileNotFoundError:
                pass
        del self.consumed, self.data
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere: the map closes with it


def copied(views: list[np.ndarray], release: Callable[[], None]) -> list[np.ndarray]:
    """Copies of a shared-memory message's views (`ShmSegments.views`), its bytes then handed back."""
    out = [a.copy() for a in views]
    release()
    return out


class ShmSegments:
    """The receiving end: the segments peers wrote into, mapped on first use."""

    MAX = 1024

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.maps: dict[str, tuple[mmap.mmap, np.ndarray, np.ndarray]] = {}
        self.open: dict[str, collections.deque] = {}  # per segment: [end, released] of unreleased reads

    def _open(self, name: str) -> tuple[mmap.mmap, np.ndarray, np.ndarray]:
        if not isinstance(name, str) or not _SEGMENT.fullmatch(name):
            raise WireError(f"shared-memory segment name {name!r:.120} is not a segment of this run")
        if len(self.maps) >= self.MAX:
            raise WireError(f"more than {self.MAX} shared-memory segments from peers; refused {name!r}")
        path = os.path.join(self.dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise WireError(f"shared-memory segment {path!r} cannot be opened: {e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size <= _HEAD:
                raise WireError(f"shared-memory segment {path!r} is not a regular file of this user")
            m = _map(fd, st.st_size)
        finally:
            os.close(fd)
        os.unlink(path)  # mapped now: the memory lives as long as the two processes map it
        entry = (m, np.frombuffer(m, np.uint64, 1), np.frombuffer(m, np.uint8, offset=_HEAD))
        self.maps[name] = entry
        return entry

    def arrays(self, desc: Any) -> list[np.ndarray]:
        """Copies of the arrays a control message describes, after bounds and shape checks."""
        return copied(*self.views(desc))

    def views(self, desc: Any) -> tuple[list[np.ndarray], Callable[[], None]]:
        """Read-only views of the arrays a control message describes, after bounds and shape checks,
        and the function that hands their bytes back to the sender: the views stay valid until it is
        called, and must not be used after. Messages of one sender are read in order and may be
        released in any order: the sender gets back the bytes of the messages released so far
        without an unreleased one before them (published as how far this end has read)."""
        try:
            d = msgspec.convert(desc, _ShmDesc)
        except msgspec.ValidationError as e:
            raise WireError(
                f"shared-memory descriptor {desc!r:.200} is not {{seg, at, n, arrays: [[dtype, "
                f"shape, offset, bytes], ...]}} with a dtype of the allow-list: {e}"
            ) from None
        _, consumed, data = self.maps.get(d.seg) or self._open(d.seg)
        at, n = d.at % data.size, d.n
        if at + n > data.size:
            raise WireError(
                f"shared-memory message [{at}, {at + n}) lies outside segment {d.seg!r} of {data.size} bytes"
            )
        out = []
        for i, (dtype, shape, off, nbytes) in enumerate(d.arrays):
            if off + nbytes > n:
                raise WireError(f"array {i}: bytes [{off}, {off + nbytes}) lie outside its message of {n}")
            view = checked_view(i, dtype, shape, memoryview(data[at + off : at + off + nbytes]))
            view.flags.writeable = False
            out.append(view)
        reads = self.open.setdefault(d.seg, collections.deque())
        entry = [d.at + n, False]
        reads.append(entry)

        def release() -> None:
            entry[1] = True
            while reads and reads[0][1]:
                consumed[0] = reads.popleft()[0]

        return out, release

    def close(self) -> None:
        self.maps = {}  # (each map closes when the last array view of it is gone)
