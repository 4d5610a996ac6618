"""Which array library a trainer type computes with.

`cpu` trainers use numpy. `gpu` trainers use cupy on a CUDA device; on a machine without one they
run only when emulation is allowed explicitly, and that is always logged, so nobody mistakes an
emulated run's speed for a GPU's.

Test-only hook: when the environment variable `HETPS_FAKE_CUPY` names a module (the tests use
`fake_cupy`, a strict host-memory stand-in for cupy), that module is imported in place of cupy.
Trainer processes inherit the variable. Never set it outside tests: nothing then runs on a GPU.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ops_registry.base import cupyx_of
from transpiler.config import kind_of

log = logging.getLogger("hetps.device")


def cupy_module() -> Any:
    """cupy, or the test stand-in named by `HETPS_FAKE_CUPY` (see the module docstring)."""
    return importlib.import_module(os.environ.get("HETPS_FAKE_CUPY") or "cupy")


def cuda_available() -> bool:
    try:
        return cupy_module().cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "no CUDA here"
        return False


def array_module(
    trainer_type: str,
    device_map: dict[str, str] | None = None,
    allow_emulation: bool = False,
    announce: bool = True,
) -> tuple[Any, str]:
    """(xp, description) for `trainer_type`; `device_map` maps trainer types to "cpu" | "gpu"
    (default: a type named like "gpu*" is a GPU type, everything else CPU). Emulation is logged
    unless `announce` is False (trainer processes: the driver announced it once for the run)."""
    if kind_of(trainer_type, device_map) == "cpu":
        return np, "cpu (numpy)"
    if cuda_available():
        cupy = cupy_module()
        return cupy, f"gpu (cupy, CUDA device {cupy.cuda.runtime.getDevice()})"
    if not allow_emulation:
        raise RuntimeError(
            f"trainer type {trainer_type!r} needs a CUDA GPU (cupy) and none was found; install "
            "hetps[gpu] on a CUDA machine, or pass allow_emulation=True to run it on CPU kernels"
        )
    if announce:
        log.warning(
            "trainer type %r: no CUDA device, EMULATING the GPU trainer with CPU (numpy) kernels",
            trainer_type,
        )
    return np, "gpu EMULATED on cpu (numpy)"


@dataclass
class Crossings:
    """Host <-> device copies this process made through hetps (`to_device`, `to_host`, `Copies`): how
    many, and their bytes, each way. A gpu trainer reports them in its stats (`History.trainers`)."""

    h2d: int = 0
    h2d_bytes: int = 0
    d2h: int = 0
    d2h_bytes: int = 0

    def add(self, to_device: bool, nbytes: int) -> None:
        if to_device:
            self.h2d += 1
            self.h2d_bytes += nbytes
        else:
            self.d2h += 1
            self.d2h_bytes += nbytes

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


CROSSINGS = Crossings()


def on_device(v: Any) -> bool:
    """Whether `v` is a device array (it has `__cuda_array_interface__`; looked up on its type
    first: on the array that property builds a dict)."""
    return hasattr(type(v), "__cuda_array_interface__") or hasattr(v, "__cuda_array_interface__")


def to_host(v: Any) -> Any:
    """A numpy array of `v`, copied off the GPU for cupy arrays (counted in `CROSSINGS`); a row-sparse
    value (`SparseRows`) is returned as it is (its parts stay where they are)."""
    if on_device(v):
        host = v.get()
        CROSSINGS.add(False, host.nbytes)
        return host
    if hasattr(v, "to_dense"):
        return v
    return np.asarray(v)


def to_device(xp: Any, v: Any) -> Any:
    """`v` on `xp`'s device (a host array copied there, counted in `CROSSINGS`; a device array, or
    anything on numpy, as it is); a row-sparse value part by part."""
    if xp is np or on_device(v):
        return v
    if hasattr(v, "to_dense"):
        return type(v)(to_device(xp, v.rows), to_device(xp, v.values), v.height)
    host = np.asarray(v)
    CROSSINGS.add(True, host.nbytes)
    return xp.asarray(host)


class Copies:
    """Host <-> device copies of a gpu trainer's boundary tensors on a stream of their own, through
    pinned staging buffers (the pattern of TorchRec's `TrainPipelineSparseDist`): `to_device` only
    enqueues its copy (after the kernels enqueued so far: its destination may be memory they read)
    and makes the compute stream wait for it, so the host goes on while it copies; `to_host` waits
    for the compute that made the value, then for its copy only (not for the whole device). `to_device_all` /
    `to_host_all` do it for a message's tensors with one event and one wait for all of them. Every
    copy is counted in `CROSSINGS`. A pinned buffer is reused once the copy out of it has completed."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.cupyx = cupyx_of(xp)
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.free: dict[tuple, list[np.ndarray]] = {}
        self.busy: list[tuple[Any, tuple, np.ndarray]] = []  # (event, key, buffer) of copies in flight

    def _reclaim(self) -> None:
        """The pinned buffers whose copies out of them have completed go back to the pool."""
        done = [b for b in self.busy if b[0].done]
        for b in done:
            self.busy.remove(b)
            self.free.setdefault(b[1], []).append(b[2])

    def _pinned(self, shape: tuple, dtype: Any) -> tuple[tuple, np.ndarray]:
        key = (tuple(shape), np.dtype(dtype).str)
        free = self.free.get(key)
        return key, free.pop() if free else self.cupyx.empty_pinned(shape, dtype)

    def to_device(self, v: Any) -> Any:
        """`v` (a host array, or `SparseRows` of them) on the device, its copy enqueued on the copy
        stream; kernels on the compute stream run after it."""
        return self.to_device_all({"": v})[""]

    def to_device_all(self, values: dict[str, Any]) -> dict[str, Any]:
        """`to_device` of each value (a message's tensors): their copies enqueued on the copy stream,
        one event after them that the compute stream waits for."""
        if self.busy:
            self._reclaim()
        compute = self.xp.cuda.get_current_stream()
        # The destinations come from cupy's pool, whose blocks freed by the compute stream's arrays
        # may still be read by kernels enqueued there (cupy has no `record_stream`): the copies wait
        # for them. (What this costs: a copy overlaps the host's work, not kernels enqueued before.)
        self.stream.wait_event(compute.record())
        staged: list[tuple[tuple, np.ndarray]] = []
        out = {name: self._enqueue(v, staged) for name, v in values.items()}
        if staged:
            event = self.stream.record()
            compute.wait_event(event)
            self.busy.extend((event, key, buf) for key, buf in staged)
        return out

    def _enqueue(self, v: Any, staged: list) -> Any:
        """`v`'s copy to the device enqueued on the copy stream through a pinned buffer (appended to
        `staged`, busy until the copy completes)."""
        if on_device(v):
            return v
        if hasattr(v, "to_dense"):
            return type(v)(self._enqueue(v.rows, staged), self._enqueue(v.values, staged), v.height)
        host = np.asarray(v)
        key, buf = self._pinned(host.shape, host.dtype)
        np.copyto(buf, host)
        dev = self.xp.empty(host.shape, host.dtype)
        dev.set(buf, stream=self.stream)
        staged.append((key, buf))
        CROSSINGS.add(True, host.nbytes)
        return dev

    def to_host(self, v: Any) -> Any:
        """A numpy copy of device array `v` (anything else as `to_host` gives it), copied on the copy
        stream once the compute stream has made it."""
        return self.to_host_all([v])[0]

    def to_host_all(self, values: list[Any]) -> list[Any]:
        """`to_host` of each value (what a segment sends; `SparseRows` part by part): the copy
        stream waits for the compute stream once, every copy is enqueued, the host waits once."""
        dev: list[Any] = []
        for v in values:
            _device_parts(v, dev)
        got = iter(self._d2h(dev))
        return [_host_parts(v, got) for v in values]

    def _d2h(self, arrays: list[Any]) -> list[np.ndarray]:
        """Numpy copies of device arrays, through pinned buffers, on the copy stream."""
        if not arrays:
            return []
        # (a strided one made contiguous on the compute stream first, before the event: one plain copy)
        arrays = [a if a.flags.c_contiguous else self.xp.ascontiguousarray(a) for a in arrays]
        self.stream.wait_event(self.xp.cuda.get_current_stream().record())
        bufs = []
        for a in arrays:
            key, buf = self._pinned(a.shape, a.dtype)
            a.get(stream=self.stream, out=buf, blocking=False)
            bufs.append((key, buf))
            CROSSINGS.add(False, a.nbytes)
        self.stream.synchronize()  # (these copies only, not the whole device)
        out = [buf.copy() for _, buf in bufs]  # (the sender may keep the array: the buffer goes back)
        for key, buf in bufs:
            self.free.setdefault(key, []).append(buf)
        return out


def _device_parts(v: Any, into: list[Any]) -> None:
    """The device arrays of `v` (itself, or a `SparseRows`' parts), appended to `into`."""
    if hasattr(v, "to_dense"):
        _device_parts(v.rows, into)
        _device_parts(v.values, into)
    elif on_device(v):
        into.append(v)


def _host_parts(v: Any, got: Any) -> Any:
    """`v` on the host: its device arrays the next ones of `got` (in `_device_parts`' order)."""
    if hasattr(v, "to_dense"):
        return type(v)(_host_parts(v.rows, got), _host_parts(v.values, got), v.height)
    return next(got) if on_device(v) else to_host(v)
