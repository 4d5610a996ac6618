"""Boundary tensors between two gpu trainers on one CUDA device, device to device (CUDA IPC).

Trainer types are separate processes; when a gpu trainer sends a tensor to a gpu trainer on the
same device (same host, same device: `device_key`, which each gpu trainer tells the others at its
start in a `DeviceOf` message), the tensor is not copied through the host:

- the sender (`IpcSender`) copies it on its copy stream, after the compute stream's work, into a
  *slot*: a device buffer of its own (`cupy.cuda.Memory`, a cudaMalloc outside cupy's pool, so that
  its IPC handle names the buffer itself, at offset 0); it records its interprocess event on that
  stream and sends a descriptor (`IpcPart`: its name, the event's handle the first time; per tensor
  the slot's id, dtype, shape and, the first time, the slot's memory handle) instead of the bytes. A
  slot is reused for the same (receiver, name, shape, dtype) once the receiver handed it back, at
  most `SLOTS` of them per key; with none free the sender waits for one (`wait`: the trainer reads
  its inbox meanwhile) up to the run's stall timeout, then fails naming the receiver;
- the receiver (`IpcReceiver`) opens each handle once (cached until it ends), makes its copy stream
  wait for the sender's event, copies each slot into an array of its own on that stream, makes its
  compute stream wait for those copies, and, once they are done, hands the slots back (`releasable`:
  a `Released` message to the sender).

Everything else (another device or host, a cpu peer, a row-sparse value, a peer that did not say
where it is yet, no IPC on this platform) goes through the host (`runtime.exec.device.Copies`).
Descriptors are typed records (msgspec structs, the allow-list and limits of
`runtime.transport.wire`), checked in one pass on arrival; nothing is unpickled. As with the
shared-memory rings, a peer is trusted with its own descriptors (it is one of the run's processes,
its messages signed): a lying shape would make the receiver read past the slot on the device.

cupy calls (cupy 13 / 14 source): `cupy_backends/cuda/api/runtime.pyx`: `ipcGetMemHandle(intptr_t
devPtr) -> bytes` (64 bytes), `ipcOpenMemHandle(bytes handle, unsigned int
flags=cudaIpcMemLazyEnablePeerAccess) -> intptr_t`, `ipcCloseMemHandle(intptr_t devPtr)`,
`ipcGetEventHandle(intptr_t event) -> bytes`, `ipcOpenEventHandle(bytes handle) -> intptr_t`,
`streamWaitEvent(intptr_t stream, intptr_t event, unsigned int flags=0)`,
`getDeviceProperties(device)["uuid"]`; `cupy/cuda/stream.pyx`: `Event(block=False,
disable_timing=False, interprocess=False)` (interprocess needs disable_timing); `cupy/cuda/memory.pyx`:
`Memory(size)`, `UnownedMemory(ptr, size, owner, device_id=-1)`, `MemoryPointer(mem, offset)`.
The test stand-in (tests/fake_cupy.py) models these across processes; on a GPU they are unverified.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from runtime.exec.device import on_device
from runtime.transport.messages import ProtocolError
from runtime.transport.wire import Dims, Dtype, NonNegative

log = logging.getLogger("hetps.device")

# device buffers per (receiver, tensor name, shape, dtype): a sender with none free waits
# (`HETPS_IPC_SLOTS`, read in each trainer process: for tests of that wait)
SLOTS = int(os.environ.get("HETPS_IPC_SLOTS") or 4)
_Hex = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{128})?$")]  # a 64-byte handle, or "" (sent before)
_Name = Annotated[str, msgspec.Meta(max_length=256)]


class IpcTensor(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One tensor in a sender's slot: the receiver copies `shape` x `dtype` from `offset` of it."""

    name: _Name
    slot: NonNegative
    dtype: Dtype
    shape: Dims
    handle: _Hex  # the slot's memory handle, "" when this receiver has it already
    offset: NonNegative = 0


class IpcPart(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The device-to-device part of a `Tensors` message (its header's "d")."""

    sender: _Name
    event: _Hex  # the sender's interprocess event's handle, "" when this receiver has it already
    tensors: list[IpcTensor]


def device_key(xp: Any) -> str:
    """This process's CUDA device, the same text in every process that uses it (host name, boot id,
    the device's UUID); "" when it cannot be told (then every tensor goes through the host)."""
    try:
        rt = xp.cuda.runtime
        uuid = bytes(rt.getDeviceProperties(rt.getDevice())["uuid"])
    except Exception:  # no uuid (an old CUDA), no device: no IPC
        return ""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}/{uuid.hex()}"


@dataclass
class _Slot:
    id: int
    mem: Any  # cupy.cuda.Memory (kept alive with the array)
    array: Any
    handle: bytes
    free: bool = False
    told: bool = False  # its receiver has its handle


class IpcSender:
    """A gpu trainer's slots for its device-to-device sends (see the module docstring); `stream`
    is its copy stream. Raises where this platform has no CUDA IPC (the caller keeps the host)."""

    def __init__(self, xp: Any, stream: Any, me: str) -> None:
        self.xp, self.stream, self.me = xp, stream, me
        self.event = xp.cuda.Event(interprocess=True, disable_timing=True)
        self.event_handle = bytes(xp.cuda.runtime.ipcGetEventHandle(self.event.ptr))
        self.pools: dict[tuple, list[_Slot]] = {}
        self.by_id: dict[int, tuple[str, _Slot]] = {}
        self.told: set[str] = set()  # receivers that have the event's handle
        self.stats = {"ipc_sent": 0, "ipc_sent_bytes": 0, "ipc_waits": 0, "ipc_slots": 0}

    def send(
        self, peer: str, values: list[tuple[str, Any]], wait: Callable[[float], None], timeout: float
    ) -> list:
        """`values` (dense device arrays) copied into slots for `peer`, after the compute that made
        them; the `IpcPart` for the message (as header values)."""
        slots = [self._slot(peer, name, v, wait, timeout) for name, v in values]
        compute = self.xp.cuda.get_current_stream()
        self.stream.wait_event(compute.record())
        with self.stream:
            for s, (_, v) in zip(slots, values, strict=True):
                self.xp.copyto(s.array, v)
        self.event.record(self.stream)
        # (kernels enqueued later run after these copies: memory of a value freed now and reused by
        # the pool cannot be written before it was copied; the host waits for nothing)
        compute.wait_event(self.event)
        tensors = [
            IpcTensor(name, s.id, v.dtype.str, list(v.shape), "" if s.told else s.handle.hex())
            for s, (name, v) in zip(slots, values, strict=True)
        ]
        for s in slots:
            s.told = True
        part = IpcPart(self.me, "" if peer in self.told else self.event_handle.hex(), tensors)
        self.told.add(peer)
        self.stats["ipc_sent"] += len(values)
        self.stats["ipc_sent_bytes"] += sum(int(v.nbytes) for _, v in values)
        return msgspec.to_builtins(part)

    def _slot(self, peer: str, name: str, v: Any, wait: Callable[[float], None], timeout: float) -> _Slot:
        """A free slot for `v` to `peer` (a new one while fewer than SLOTS; else wait for a release)."""
        pool = self.pools.setdefault((peer, name, tuple(v.shape), v.dtype.str), [])
        deadline = None
        while True:
            s = next((s for s in pool if s.free), None)
            if s is None and len(pool) < SLOTS:
                s = self._new_slot(v)
                pool.append(s)
                self.by_id[s.id] = (peer, s)
                self.stats["ipc_slots"] += 1
            if s is not None:
                s.free = False
                return s
            deadline = deadline or time.monotonic() + timeout
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"{self.me}: none of the {SLOTS} device buffers for {name!r} {tuple(v.shape)} sent to "
                    f"{peer} came back in {timeout:g} s: {peer} holds them (has it died or stopped?)"
                )
            self.stats["ipc_waits"] += 1
            wait(min(left, 1.0))

    def _new_slot(self, v: Any) -> _Slot:
        cuda = self.xp.cuda
        mem = cuda.Memory(int(v.nbytes))  # (its own cudaMalloc: the handle names this buffer, offset 0)
        array = self.xp.ndarray(v.shape, v.dtype, cuda.MemoryPointer(mem, 0))
        return _Slot(len(self.by_id), mem, array, bytes(cuda.runtime.ipcGetMemHandle(mem.ptr)))

    def release(self, peer: str, ids: list[int]) -> None:
        """`peer` has copied slots `ids` out: they may be written again."""
        for i in ids:
            owner, s = self.by_id.get(i, (None, None))
            if owner != peer or s.free:
                raise ProtocolError(f"{self.me}: {peer} released slot {i}, which it does not hold")
            s.free = True


class IpcReceiver:
    """A gpu trainer's end of its peers' device-to-device sends (see the module docstring);
    `stream` is its copy stream."""

    def __init__(self, xp: Any, stream: Any) -> None:
        self.xp, self.stream = xp, stream
        self.opened: dict[tuple[str, int], tuple[int, Any, tuple, str]] = {}  # ptr, memory, shape, dtype
        self.events: dict[str, int] = {}  # sender -> its interprocess event, opened here
        self.pending: list[tuple[Any, str, list[int]]] = []  # (copies' event, sender, slots) in flight
        self.stats = {"ipc_recv": 0, "ipc_recv_bytes": 0}

    def take(self, part: Any) -> tuple[str, dict[str, Any]]:
        """(sender, {name: device array of this process}) of a message's `IpcPart`: copied out of the
        sender's slots once its event is reached, the compute stream waiting for the copies."""
        try:
            p = msgspec.convert(part, IpcPart)
        except msgspec.ValidationError as e:
            raise ProtocolError(f"a device-to-device descriptor is malformed: {e}") from None
        rt = self.xp.cuda.runtime
        if p.event and p.sender not in self.events:
            self.events[p.sender] = rt.ipcOpenEventHandle(bytes.fromhex(p.event))
        if p.sender not in self.events:
            raise ProtocolError(f"device tensors from {p.sender} before its event's handle")
        rt.streamWaitEvent(self.stream.ptr, self.events[p.sender], 0)
        compute = self.xp.cuda.get_current_stream()
        out = {t.name: self.xp.empty(t.shape, t.dtype) for t in p.tensors}  # (the compute stream's pool)
        # (after the kernels enqueued so far: memory the pool handed out again may still be read by them)
        self.stream.wait_event(compute.record())
        with self.stream:
            for t in p.tensors:
                self.xp.copyto(out[t.name], self._view(p.sender, t))
        done = self.stream.record()
        compute.wait_event(done)
        self.pending.append((done, p.sender, [t.slot for t in p.tensors]))
        self.stats["ipc_recv"] += len(out)
        self.stats["ipc_recv_bytes"] += sum(int(v.nbytes) for v in out.values())
        return p.sender, out

    def _view(self, sender: str, t: IpcTensor) -> Any:
        """The sender's slot `t.slot` as an array of this process (its handle opened once)."""
        cuda, key, shape = self.xp.cuda, (sender, t.slot), tuple(t.shape)
        if t.handle and key not in self.opened:
            ptr = cuda.runtime.ipcOpenMemHandle(bytes.fromhex(t.handle))
            nbytes = t.offset + int(np.prod(shape)) * np.dtype(t.dtype).itemsize
            self.opened[key] = (ptr, cuda.UnownedMemory(ptr, nbytes, None), shape, t.dtype)
        got = self.opened.get(key)
        if got is None or got[2:] != (shape, t.dtype):
            raise ProtocolError(
                f"{sender}'s slot {t.slot} for {t.name!r}: no handle for it, or another shape"
            )
        return self.xp.ndarray(shape, t.dtype, cuda.MemoryPointer(got[1], t.offset))

    def releasable(self, block: bool = False) -> dict[str, list[int]]:
        """The slots whose copies out have completed (all of them with `block`: waits for the copy
        stream's events), by sender; they are forgotten here."""
        done: dict[str, list[int]] = {}
        keep = []
        for ev, sender, slots in self.pending:
            if block and not ev.done:
                ev.synchronize()
            if block or ev.done:
                done.setdefault(sender, []).extend(slots)
            else:
                keep.append((ev, sender, slots))
        self.pending = keep
        return done

    def close(self) -> None:
        """Close the handles this process opened."""
        for ptr, *_ in self.opened.values():
            self.xp.cuda.runtime.ipcCloseMemHandle(ptr)
        self.opened.clear()


class DeviceLinks:
    """A gpu trainer's device-to-device sends and receives, and where its gpu peers are."""

    def __init__(self, xp: Any, stream: Any, me: str) -> None:
        self.key = device_key(xp)
        self.peer_keys: dict[str, str] = {}  # gpu peer -> its device_key (from its DeviceOf)
        self.receiver = IpcReceiver(xp, stream)
        self.sender: IpcSender | None = None
        if self.key:
            try:
                self.sender = IpcSender(xp, stream, me)
            except Exception as e:  # (cupy's CUDARuntimeError: no CUDA IPC on this platform)
                log.warning("%s: no CUDA IPC here (%s): tensors to gpu peers go through the host", me, e)
                self.key = ""

    def direct(self, peer: str, value: Any) -> bool:
        """Whether `value` goes to `peer` device to device: a dense device array, to a peer that
        said it is on this process's device."""
        return bool(self.key) and self.peer_keys.get(peer) == self.key and _dense_device(value)

    def stats(self) -> dict[str, int]:
        return {**self.receiver.stats, **(self.sender.stats if self.sender else {})}


def _dense_device(v: Any) -> bool:
    return on_device(v) and not hasattr(v, "to_dense") and int(v.size) > 0
