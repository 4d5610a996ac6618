"""A strict stand-in for cupy, for tests: "device" arrays live in host memory but cannot mix with host
arrays, as on a GPU.

`np.asarray(dev)`, `np.add(dev, host)`, `dev + host`, `dev[...] = host` and passing a host array to
any `fake_cupy` function other than `asarray` / `array` raise `TypeError`, as cupy does (cupy's
"Implicit conversion to a NumPy array is not allowed"). The only crossings are `asarray` / `array`
(host -> device) and `asnumpy` / `ndarray.get()` (device -> host); `COUNTS` tallies each direction's
crossings and bytes (`float(dev)`, `bool(dev)`, `.item()`, `.tolist()` too: cupy syncs and copies
for them). Python and numpy scalars mix freely, as in cupy; host integer arrays are accepted as
indices, as cupy accepts them.

Streams are modelled as far as hetps relies on them: `ndarray.set(pinned, stream=s)` on a stream
other than the compute (null) stream leaves the array *pending* until the compute stream waited for
an event recorded on `s` after the copy (`get_current_stream().wait_event(e)`) or `s` was synchronized;
reading a pending array raises `RuntimeError` (on a GPU it would read a half-copied buffer).
`cupyx.empty_pinned` buffers are remembered, and copies from or into them counted apart
(`h2d_pinned`, `d2h_pinned`). With `HETPS_FAKE_CUPY_COUNTS` naming a folder, every process that
uses the stand-in keeps its counts in a file there as they change (`<pid>.counts`, int64s in the
order of `Counts`' fields, read with `read_counts`): trainer processes end with `os._exit`, which
runs no exit hook.

CUDA IPC across processes (`cuda.Memory`, `runtime.ipcGetMemHandle` / `ipcOpenMemHandle`,
interprocess events, `runtime.streamWaitEvent`) is modelled with files of the folder that
`HETPS_FAKE_CUPY_IPC` names (see the section "CUDA IPC" below); those copies count as `d2d_ipc`.

This checks hetps's device logic (which values cross, and where), not cupy itself: kernels run on
numpy underneath. Use it through `HETPS_FAKE_CUPY=fake_cupy` (see `runtime.exec.device`), which
spawned trainer processes inherit.
"""

from __future__ import annotations

import operator
import os
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.special


@dataclass
class Counts:
    h2d: int = 0
    h2d_bytes: int = 0
    d2h: int = 0
    d2h_bytes: int = 0
    h2d_pinned: int = 0  # of h2d: copies out of a cupyx.empty_pinned buffer on a non-null stream
    d2h_pinned: int = 0  # of d2h: copies into a pinned buffer on a non-null stream
    d2d_ipc: int = 0  # device -> device copies out of another process's buffer (CUDA IPC): no host crossing
    d2d_ipc_bytes: int = 0

    def reset(self) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, 0)

    def d2h_add(self, nbytes: int, pinned: bool = False) -> None:
        self.d2h += 1
        self.d2h_bytes += nbytes
        self.d2h_pinned += pinned
        _mirror()

    def h2d_add(self, nbytes: int, pinned: bool = False) -> None:
        self.h2d += 1
        self.h2d_bytes += nbytes
        self.h2d_pinned += pinned
        _mirror()


COUNTS = Counts()
_PINNED: set[int] = set()  # data addresses of the pinned buffers handed out (kept alive in _KEEP)
_KEEP: list[np.ndarray] = []


_FILE: list = []  # this process's counts file (a memory map), once it counts anything


_ENV = getattr(os.environ, "_data", None)  # (os.environ's own dict: a miss there costs no KeyError)
_KEY = os.fsencode("HETPS_FAKE_CUPY_COUNTS") if os.name == "posix" else None


def _mirror() -> None:
    if _KEY is not None and _ENV is not None and _KEY not in _ENV:  # (the usual case: nothing to mirror)
        return
    folder = os.environ.get("HETPS_FAKE_CUPY_COUNTS")
    if not folder:
        return
    if not _FILE:
        path = Path(folder) / f"{os.getpid()}.counts"
        _FILE.append(np.memmap(path, np.int64, "w+", shape=(len(Counts.__dataclass_fields__),)))
    _FILE[0][:] = list(COUNTS.__dict__.values())


def read_counts(folder: str | Path) -> dict[int, Counts]:
    """The counts of each process that used the stand-in under `HETPS_FAKE_CUPY_COUNTS=folder`, by pid."""
    return {
        int(f.stem): Counts(*(int(x) for x in np.fromfile(f, np.int64)))
        for f in sorted(Path(folder).glob("*.counts"))
    }


def _host_error(what: Any) -> TypeError:
    return TypeError(
        f"fake_cupy: a host {type(what).__name__} was mixed with device arrays; cross explicitly "
        "with xp.asarray (host -> device) or .get() / xp.asnumpy (device -> host)"
    )


def _unwrap(v: Any) -> Any:
    """The numpy value under device values; host arrays (not numpy scalars) raise."""
    if isinstance(v, ndarray):
        if v._pend is not None:
            v._settled()
        if _IPC_ROOTS and id(_root(v._a)) in _IPC_ROOTS:
            _IPC_ROOTS[id(_root(v._a))].touched()
        return v._a
    if isinstance(v, np.ndarray):
        raise _host_error(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_unwrap(x) for x in v)
    if isinstance(v, dict):
        return {k: _unwrap(x) for k, x in v.items()}
    return v


def _unwrap_index(v: Any) -> Any:
    """An index: device arrays unwrapped; host integer/bool arrays accepted (cupy copies them)."""
    if isinstance(v, ndarray):
        return _unwrap(v)
    if isinstance(v, tuple):
        return tuple(_unwrap_index(x) for x in v)
    if isinstance(v, np.ndarray) and _CAPTURE:
        _sync("a host index array (copied to the device)")
    return v


def _wrap(v: Any) -> Any:
    """Device values of numpy results: a numpy scalar (a full reduction) becomes a 0-d device array,
    as cupy returns."""
    if isinstance(v, np.ndarray):
        return ndarray(v)
    if isinstance(v, np.generic):
        return ndarray(np.asarray(v))
    if isinstance(v, tuple):
        return tuple(_wrap(x) for x in v)
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    return v


RECORD: list | None = None  # a list: every kernel call (fn, args, kwargs) is appended (see `replay`)


def _call(fn: Any, args: tuple, kwargs: dict) -> Any:
    if _IPC_ROOTS:
        return _ipc_call(fn, args, kwargs)
    return _wrap(_run(fn, _unwrap(args), _unwrap(kwargs)))


KERNEL_S = [0.0]  # with TIME_KERNELS: CPU seconds inside kernels (numpy underneath), summed
TIMED = [0]  # with TIME_KERNELS: the timed calls (kernels and graph launches), each two timer reads
TIME_KERNELS = False


def _run(fn: Any, args: tuple, kwargs: dict) -> Any:
    """One kernel on numpy values: recorded (`RECORD`), and captured while a stream captures."""
    if RECORD is not None:
        RECORD.append((fn, args, kwargs))
    if _CAPTURE:
        return _CAPTURE[0].kernel(fn, args, kwargs)
    if TIME_KERNELS:
        TIMED[0] += 1
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            KERNEL_S[0] += time.process_time() - t0
    return fn(*args, **kwargs)


def replay(calls: list, times: int = 1) -> float:
    """CPU seconds the recorded kernel calls (`RECORD`) take, run `times` times back to back: the
    stand-in's "device" time of what was recorded, without any of the host work around it."""
    t0 = time.process_time()
    for _ in range(times):
        for fn, args, kwargs in calls:
            fn(*args, **kwargs)
    return time.process_time() - t0


class ndarray:  # noqa: N801  (cupy's name)
    """A device array: a numpy array that refuses implicit conversion to the host."""

    __slots__ = ("_a", "_pend")
    __array_priority__ = 1000

    def __init__(self, a: Any, dtype: Any = None, memptr: Any = None) -> None:
        if memptr is not None:  # cupy.ndarray(shape, dtype, memptr): a view of an allocation of its own
            a = memptr.view(a, dtype)
        self._a = a
        self._pend: tuple[_Stream, int] | None = None  # (stream, its op) of a copy not waited for

    def _settled(self) -> None:
        """Refuse a read of this array on the compute stream before its copy was waited for."""
        stream, seq = self._pend
        if stream.synced < seq and cuda.Stream.null.waited.get(stream, 0) < seq:
            raise RuntimeError(
                "fake_cupy: a device array was read before its copy on another stream was waited "
                "for (record an event after the copy and make the compute stream wait_event it)"
            )
        self._pend = None

    # --- crossings and the refusals
    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
        _sync("a device -> host copy (get)")
        a = _unwrap(self)
        pinned = out is not None and _is_pinned(out) and stream not in (None, cuda.Stream.null)
        COUNTS.d2h_add(a.nbytes, pinned)
        if out is None:
            return a.copy()
        if not isinstance(out, np.ndarray) or out.shape != a.shape or out.dtype != a.dtype:
            raise ValueError("fake_cupy: get(out=) needs a host array of the same shape and dtype")
        _run(np.copyto, (out, a), {})  # (the DMA: device work)
        if stream is not None and blocking:
            stream.synchronize()
        return out

    def set(self, arr: Any, stream: Any = None) -> None:
        """Host -> device into this array, on `stream` (pending until waited for, off the null one)."""
        _sync("a host -> device copy (set)")
        if not isinstance(arr, np.ndarray) or arr.shape != self._a.shape:
            raise ValueError("fake_cupy: set() needs a host array of the array's shape")
        _run(np.copyto, (self._a, arr.astype(self._a.dtype, copy=False)), {})  # (the DMA: device work)
        off_null = stream is not None and stream is not cuda.Stream.null
        COUNTS.h2d_add(arr.nbytes, off_null and _is_pinned(arr))
        if off_null:
            stream.seq += 1
            self._pend = (stream, stream.seq)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
            "NumPy array explicitly."
        )

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        return _call(getattr(ufunc, method), inputs, kwargs)  # a host operand raises in _unwrap

    def __array_function__(self, func: Any, types_: Any, args: tuple, kwargs: dict) -> Any:
        return _call(func, args, kwargs)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self._a.shape, "typestr": self._a.dtype.str, "data": (0, False), "version": 3}

    # --- plain attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    T = property(lambda self: ndarray(self._a.T))
    flags = property(lambda self: self._a.flags)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        return (_wrap(x) for x in self._a)

    def __repr__(self) -> str:
        return f"fake_cupy.{self._a!r}"

    # implicit device -> host copies (cupy syncs and copies for them): counted
    def _scalar(self) -> np.ndarray:
        _sync("a device value read on the host (bool / float / int / item / tolist)")
        a = _unwrap(self)
        COUNTS.d2h_add(a.nbytes)
        return a

    def __bool__(self) -> bool:
        return bool(self._scalar())

    def __float__(self) -> float:
        return float(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def __index__(self) -> int:
        return self._scalar().__index__()

    def item(self) -> Any:
        return self._scalar().item()

    def tolist(self) -> Any:
        return self._scalar().tolist()

    def __getitem__(self, key: Any) -> Any:
        return _wrap(_run(operator.getitem, (_unwrap(self), _unwrap_index(key)), {}))

    def __setitem__(self, key: Any, value: Any) -> None:
        _run(operator.setitem, (_unwrap(self), _unwrap_index(key), _unwrap(value)), {})

    def __getattr__(self, name: str) -> Any:  # methods: reshape, astype, sum, ...
        if name.startswith("__"):  # no __array_interface__ / __array_struct__: numpy must not see in
            raise AttributeError(name)
        attr = getattr(_unwrap(self), name)
        if not callable(attr):
            return _wrap(attr)
        return lambda *args, **kwargs: _call(attr, args, kwargs)

    def __getstate__(self) -> Any:
        raise TypeError("fake_cupy: a device array cannot be pickled; copy it to the host with .get()")


def _operator(name: str) -> Any:
    def op(self: ndarray, *args: Any) -> Any:
        return _call(getattr(_unwrap(self), name), args, {})

    return op


for _name in (
    "add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod pow rpow matmul rmatmul "
    "neg pos abs invert and rand or ror xor rxor lshift rshift eq ne lt le gt ge "
    "iadd isub imul itruediv ifloordiv imod ipow iand ior ixor"
).split():
    setattr(ndarray, f"__{_name}__", _operator(f"__{_name}__"))
ndarray.__hash__ = None  # type: ignore[assignment]


class _Ufunc:
    def __init__(self, u: np.ufunc) -> None:
        self._u = u
        self.__name__ = u.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call(self._u, args, kwargs)

    def __getattr__(self, name: str) -> Any:  # reduce, accumulate, outer, at, nin, ...
        attr = getattr(self._u, name)
        return (lambda *a, **k: _call(attr, a, k)) if callable(attr) else attr


def _namespace(mod: Any) -> Any:
    """A module-like proxy of numpy module `mod` whose functions take and return device arrays."""

    def lookup(name: str) -> Any:
        attr = getattr(mod, name)
        if isinstance(attr, np.ufunc):
            return _Ufunc(attr)
        if isinstance(attr, type) or isinstance(attr, types.ModuleType) and attr is not mod:
            return attr  # dtypes, finfo, iinfo, ...
        if callable(attr):
            return lambda *a, **k: _call(attr, a, k)
        return attr  # pi, inf, newaxis, ...

    return lookup


_lookup = _namespace(np)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _lookup(name)


def asarray(a: Any, dtype: Any = None, order: Any = None) -> ndarray:
    """Host -> device (a device array stays where it is)."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    _sync("a host -> device copy (asarray of a host value)")
    host = np.asarray(a, dtype=dtype, order=order)
    COUNTS.h2d_add(host.nbytes)
    return ndarray(host.copy())


def array(a: Any, dtype: Any = None, copy: bool = True, order: Any = "K", ndmin: int = 0) -> ndarray:
    if isinstance(a, ndarray):
        return ndarray(np.array(_unwrap(a), dtype=dtype, copy=copy, order=order, ndmin=ndmin))
    return asarray(np.array(a, dtype=dtype, order=order, ndmin=ndmin))


def asnumpy(a: Any) -> np.ndarray:
    """Device -> host (a host value is returned as numpy)."""
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def get_array_module(*args: Any) -> Any:
    return sys.modules[__spec__.name] if any(isinstance(a, ndarray) for a in args) else np


class _Generator:
    def __init__(self, seed: Any = None) -> None:
        self._g = np.random.default_rng(seed)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._g, name)
        return lambda *a, **k: _call(attr, a, k)


random = types.SimpleNamespace(default_rng=_Generator, __name__="fake_cupy.random")


def _scatter(u: np.ufunc) -> Any:
    def scatter(a: ndarray, slices: Any, value: Any) -> None:
        if not isinstance(a, ndarray):
            raise _host_error(a)
        _run(u.at, (a._a, _unwrap_index(slices), _unwrap(value)), {})

    return scatter


_special = types.SimpleNamespace(
    erf=lambda x: _call(scipy.special.erf, (x,), {}),
    expit=lambda x: _call(scipy.special.expit, (x,), {}),
)
cupyx = types.SimpleNamespace(
    scatter_add=_scatter(np.add),
    scatter_max=_scatter(np.maximum),
    scatter_min=_scatter(np.minimum),
    scipy=types.SimpleNamespace(special=_special),
)


class _Runtime:
    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802  (cupy's name)
        return 1

    @staticmethod
    def getDevice() -> int:  # noqa: N802
        return 0

    @staticmethod
    def getDeviceProperties(i: int) -> dict:  # noqa: N802
        """`uuid`: the same device for every process, or one of its own for each with
        `HETPS_FAKE_CUPY_UUID=per-process` (trainers on different devices)."""
        own = os.environ.get("HETPS_FAKE_CUPY_UUID") == "per-process"
        return {
            "name": b"fake_cupy device",
            "uuid": (f"p{os.getpid()}" if own else "dev0").encode().ljust(16),
        }


_STREAMS: list = []


def _is_pinned(a: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] in _PINNED


def _empty_pinned(shape: Any, dtype: Any = np.float64) -> np.ndarray:
    """A host buffer standing for page-locked memory (remembered, so copies through it count apart)."""
    a = np.empty(shape, dtype)
    _KEEP.append(a)
    _PINNED.add(a.__array_interface__["data"][0])
    return a


cupyx.empty_pinned = _empty_pinned


class _Stream:
    """A stream: `seq` counts the copies enqueued on it, `synced` how far the host knows them done,
    `waited` how far this stream waited for each other stream's (through events)."""

    def __init__(self, null: bool = False, non_blocking: bool = False) -> None:
        self.seq, self.synced, self.waited = 0, 0, {}
        self.null = null
        self.ipc_waited: dict[int, int] = {}  # interprocess event id -> the count this stream waited for
        self.ptr = _new_ptr(self, 1)
        _STREAMS.append(self)

    def synchronize(self) -> None:
        _sync("Stream.synchronize")
        self.synced = self.seq

    def record(self, event: Any = None) -> _Event:
        event = event or _Event()
        event.record(self)
        return event

    def wait_event(self, event: _Event) -> None:
        if event.stream is not None and event.stream is not self:
            self.waited[event.stream] = max(self.waited.get(event.stream, 0), event.seq)

    def __hash__(self) -> int:
        return id(self)

    def __enter__(self) -> _Stream:  # the current stream inside the block, as in cupy
        _CURRENT.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _CURRENT.pop()

    # -- stream capture (CUDA graphs)
    def begin_capture(self, mode: Any = None) -> None:
        """Kernels on this stream are recorded into a graph, not run (`end_capture` gives it)."""
        if self.null:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: the null stream cannot capture")
        if _CAPTURE:
            raise CUDARuntimeError("cudaErrorIllegalState: a stream is capturing already")
        _CAPTURE.append(_Capture(self))

    def is_capturing(self) -> bool:
        return bool(_CAPTURE) and _CAPTURE[0].stream is self

    def end_capture(self) -> _Graph:
        """The captured graph; raises, the capture dropped, when a sync invalidated it."""
        if not self.is_capturing():
            raise CUDARuntimeError("cudaErrorIllegalState: this stream is not capturing")
        cap = _CAPTURE.pop()
        cap.undo()
        if cap.invalid:
            raise CUDARuntimeError(f"cudaErrorStreamCaptureInvalidated: {cap.invalid}")
        return _Graph(cap.calls)


class _Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        if interprocess and not disable_timing:  # (as cupy)
            raise ValueError("Timing must be disabled for interprocess events")
        self.stream, self.seq = None, 0
        self.ipc = _IpcCount() if interprocess and _ipc_dir() is not None else None
        self._ptr = 0

    @property
    def ptr(self) -> int:
        if not self._ptr:
            self._ptr = _new_ptr(self, 1)
        return self._ptr

    def record(self, stream: _Stream | None = None) -> None:
        self.stream = stream or _NULL
        self.seq = self.stream.seq
        if self.ipc is not None:  # (what this stream wrote into IPC buffers is covered by this record)
            self.ipc.count[0] += 1
            for m in _IPC_ROOTS.values():
                if m.owned and m.hdr[0] and m.stream is self.stream:
                    m.hdr[1], m.hdr[2], m.hdr[0] = self.ipc.id, self.ipc.count[0], 0

    def synchronize(self) -> None:
        _sync("Event.synchronize")
        if self.stream is not None:
            self.stream.synced = max(self.stream.synced, self.seq)

    @property
    def done(self) -> bool:  # (the stand-in's copies are done when enqueued)
        return True


class CUDARuntimeError(RuntimeError):
    """What cupy raises for a CUDA error (`cupy.cuda.runtime.CUDARuntimeError`)."""


_CAPTURE: list = []  # the one capture in progress (_Capture), if any


def _sync(what: str) -> None:
    """A host synchronisation or host copy: refused while a stream captures, as CUDA refuses it
    (and the capture is invalidated: `end_capture` raises)."""
    if _CAPTURE:
        msg = f"operation not permitted when stream is capturing: {what}"
        _CAPTURE[0].invalid = _CAPTURE[0].invalid or msg
        raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: {msg}")


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _arrays(v: Any) -> list[np.ndarray]:
    if isinstance(v, np.ndarray):
        return [v]
    if isinstance(v, (list, tuple)):
        return [a for x in v for a in _arrays(x)]
    if isinstance(v, dict):
        return [a for x in v.values() for a in _arrays(x)]
    return []


class _Capture:
    """A capture in progress: its kernels (fn, args, kwargs, results), as a graph replays them. As
    on a GPU, nothing captured takes effect: a kernel runs (for its results' shapes) on memory
    that `undo` puts back as it was (what existed before) or poisons (NaN: what the capture made)."""

    def __init__(self, stream: _Stream) -> None:
        self.stream, self.calls, self.invalid = stream, [], ""
        self.saved: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # memory from before: its contents
        self.made: dict[int, np.ndarray] = {}  # memory the capture allocated (the graph's own)

    def kernel(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        if _CURRENT[-1] is not self.stream:
            msg = "a kernel on another stream than the capturing one (use `with stream:`)"
            self.invalid = self.invalid or msg
            raise CUDARuntimeError(f"cudaErrorStreamCaptureImplicit: {msg}")
        for a in _arrays((getattr(fn, "__self__", None), args, kwargs)):  # (a method's own array too)
            r = _root(a)
            if id(r) not in self.made and id(r) not in self.saved:
                self.saved[id(r)] = (r, r.copy())
        res = fn(*args, **kwargs)
        if isinstance(res, np.generic):
            res = np.asarray(res)
        for a in _arrays(res):
            r = _root(a)
            if id(r) not in self.saved:
                self.made[id(r)] = r
        self.calls.append((fn, args, kwargs, res))
        return res

    def undo(self) -> None:
        for r in self.made.values():
            if r.dtype.kind in "fc":
                r.fill(np.nan)
        for r, before in self.saved.values():
            np.copyto(r, before)


def _into(rec: Any, res: Any) -> None:
    """A replayed kernel's results into the memory its capture gave it."""
    if isinstance(rec, np.ndarray):
        if res is not rec:
            np.copyto(rec, res)
    elif isinstance(rec, (list, tuple)):
        for a, b in zip(rec, res, strict=True):
            _into(a, b)


class _Graph:
    """A captured graph (`cupy.cuda.graph.Graph`): `launch` runs its kernels again, on the memory
    they were captured with (inputs: what that memory holds now)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.launches = 0

    def launch(self, stream: Any = None) -> None:
        if _CAPTURE:
            raise CUDARuntimeError("fake_cupy: a graph launched while a stream captures (not modelled)")
        t0 = time.process_time()
        for fn, args, kwargs, rec in self.calls:
            if RECORD is not None:
                RECORD.append((fn, args, kwargs))
            _into(rec, fn(*args, **kwargs))
        if TIME_KERNELS:
            TIMED[0] += 1
            KERNEL_S[0] += time.process_time() - t0
        self.launches += 1

    def upload(self, stream: Any = None) -> None:
        pass


class _MemoryPool:
    """`cupy.cuda.MemoryPool` as far as hetps uses it (a private pool for a graph's memory)."""

    def malloc(self, size: int) -> Any:
        raise NotImplementedError("fake_cupy: arrays are numpy's; the pool only stands in")

    def used_bytes(self) -> int:
        return 0


class _UsingAllocator:
    def __init__(self, allocator: Any = None) -> None:
        self.allocator = allocator

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


# --- CUDA IPC: cupy.cuda.Memory, runtime.ipcGetMemHandle / ipcOpenMemHandle, interprocess events ---
# With HETPS_FAKE_CUPY_IPC naming a folder, a `cuda.Memory` allocation is a file there, mapped shared:
# its IPC handle is the file's name (64 bytes, as CUDA's), so another process opens the same memory.
# Its first `_HDR` bytes (not part of the memory) say whether it was written since the last record of
# an interprocess event on the stream that wrote it, and which event and count cover its contents; an
# interprocess event is a file holding how often it was recorded. A process that reads another's
# buffer on a stream that has not waited (`runtime.streamWaitEvent`) for that count is refused (on a
# GPU it would read a half-written buffer); the arrays the same kernel writes are pending on that
# stream (read before the compute stream waited for it: refused). Such copies are counted in
# `d2d_ipc` (no host crossing). Without the folder, `ipcGetMemHandle` raises cudaErrorNotSupported.

_HDR = 64  # int64 [written since its last stamp, event id, event count] before an allocation's memory
_PTRS: dict[int, Any] = {}  # fake device pointers -> their allocation, event or stream
_IPC_ROOTS: dict[int, Any] = {}  # id of a shared allocation's map -> the _Memory (kernels check it)
_NEXT = [1 << 40, 0]  # the next fake pointer, the last file number of this process


def _new_ptr(obj: Any, span: int = 1 << 40) -> int:
    ptr = _NEXT[0]
    _NEXT[0] += span
    _PTRS[ptr] = obj
    return ptr


def _ipc_dir() -> Path | None:
    folder = os.environ.get("HETPS_FAKE_CUPY_IPC")
    return Path(folder) if folder else None


def _handle(name: str) -> bytes:
    return name.encode().ljust(64, b"\0")


def _name_of(handle: bytes) -> str:
    name = bytes(handle).rstrip(b"\0").decode("ascii")
    if len(handle) != 64 or not name[1:].replace("-", "").isdigit():
        raise CUDARuntimeError("cudaErrorInvalidValue: not an IPC handle")
    return name


class _IpcCount:
    """An interprocess event's record count, in a file of the IPC folder (own, or opened: `name`)."""

    def __init__(self, name: str | None = None) -> None:
        mode = "r+" if name is not None else "w+"
        if name is None:
            _NEXT[1] += 1
            name = f"e{os.getpid()}{_NEXT[1]:06d}"
        self.name, self.id = name, int(name[1:])
        self.count = np.memmap(_ipc_dir() / name, np.int64, mode, shape=(1,))


class _Memory:
    """`cupy.cuda.Memory(size)`: an allocation of its own (not the pool's); shared (a file of the IPC
    folder) when there is one; `owned` False: another process's, opened by its handle."""

    def __init__(self, size: int, name: str | None = None) -> None:
        folder, self.size, self.owned = _ipc_dir(), int(size), name is None
        if name is None and folder is not None:
            _NEXT[1] += 1
            name = f"m{os.getpid()}-{_NEXT[1]}"
        self.name = name
        if name is None:
            self.map = np.zeros(_HDR + self.size, np.uint8)
        else:
            mode = "w+" if self.owned else "r+"
            self.map = np.memmap(folder / name, np.uint8, mode, shape=(_HDR + self.size,))
            _IPC_ROOTS[id(self.map)] = self
        self.hdr = self.map[:_HDR].view(np.int64)
        self.stream: _Stream | None = None  # (owned) the stream that last wrote it
        self.ptr = _new_ptr(self)

    def touched(self) -> None:
        """A kernel uses this memory: the owner's use marks it written on the current stream; another
        process's is refused unless its stream waited for the event count covering the last write."""
        if self.owned:
            self.hdr[0], self.stream = 1, _CURRENT[-1]
            return
        written, event, count = (int(x) for x in self.hdr[:3])
        if written or not count or _CURRENT[-1].ipc_waited.get(event, 0) < count:
            raise RuntimeError(
                "fake_cupy: a buffer of another process (CUDA IPC) was read before this stream waited "
                "for the interprocess event its writer recorded after writing it (streamWaitEvent)"
            )


class _MemoryPointer:
    """`cupy.cuda.MemoryPointer(mem, offset)`."""

    def __init__(self, mem: _Memory, offset: int) -> None:
        self.mem, self.offset, self.ptr = mem, int(offset), mem.ptr + int(offset)

    def view(self, shape: Any, dtype: Any) -> np.ndarray:
        dtype, shape = np.dtype(dtype), tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        start = _HDR + self.offset
        end = start + int(np.prod(shape)) * dtype.itemsize
        if self.offset < 0 or end > _HDR + self.mem.size:
            raise ValueError("fake_cupy: the array does not fit in its memory")
        return self.mem.map[start:end].view(dtype).reshape(shape)


def _unowned(ptr: int, size: int, owner: Any, device_id: int = -1) -> _Memory:
    """`cupy.cuda.UnownedMemory(ptr, size, owner)`: the allocation at `ptr` (opened by its handle)."""
    mem = _PTRS.get(ptr)
    if not isinstance(mem, _Memory) or size > mem.size:
        raise CUDARuntimeError("cudaErrorInvalidValue: no allocation of that size at that pointer")
    return mem


def _ipc_call(fn: Any, args: tuple, kwargs: dict) -> Any:
    """`_call` in a process that maps shared allocations: a kernel that reads another process's
    buffer is a device -> device copy (counted); what it writes is pending on its stream."""
    dev: list[ndarray] = []
    _device_values((args, kwargs), dev)
    foreign = {id(v): v for v in dev if (m := _IPC_ROOTS.get(id(_root(v._a)))) is not None and not m.owned}
    out = _wrap(_run(fn, _unwrap(args), _unwrap(kwargs)))  # (_unwrap refuses a read not waited for)
    if foreign:
        COUNTS.d2d_ipc += len(foreign)
        COUNTS.d2d_ipc_bytes += sum(v.nbytes for v in foreign.values())
        _mirror()
        stream = _CURRENT[-1]
        if stream is not _NULL:
            stream.seq += 1
            for v in dev:
                if id(v) not in foreign:
                    v._pend = (stream, stream.seq)
    return out


def _device_values(v: Any, into: list) -> None:
    if isinstance(v, ndarray):
        into.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _device_values(x, into)
    elif isinstance(v, dict):
        _device_values(list(v.values()), into)


def _ipc_get_mem_handle(ptr: int) -> bytes:
    mem = _PTRS.get(ptr)
    if not isinstance(mem, _Memory) or not mem.owned:
        raise CUDARuntimeError("cudaErrorInvalidValue: not the base of an allocation of this process")
    if mem.name is None:
        raise CUDARuntimeError("cudaErrorNotSupported: no CUDA IPC here (set HETPS_FAKE_CUPY_IPC)")
    return _handle(mem.name)


def _ipc_open_mem_handle(handle: bytes, flags: int = 1) -> int:
    name = _name_of(handle)
    if not name.startswith("m") or name.startswith(f"m{os.getpid()}-"):
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: a memory handle of another process")
    path = _ipc_dir() / name
    return _Memory(path.stat().st_size - _HDR, name).ptr


def _ipc_close_mem_handle(ptr: int) -> None:
    mem = _PTRS.pop(ptr, None)
    if not isinstance(mem, _Memory) or mem.owned:
        raise CUDARuntimeError("cudaErrorInvalidValue: not an opened IPC memory handle")
    _IPC_ROOTS.pop(id(mem.map), None)


def _ipc_get_event_handle(ptr: int) -> bytes:
    ev = _PTRS.get(ptr)
    if not isinstance(ev, _Event) or ev.ipc is None:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: not an interprocess event")
    return _handle(ev.ipc.name)


def _ipc_open_event_handle(handle: bytes) -> int:
    name = _name_of(handle)
    if not name.startswith("e"):
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: not an event handle")
    return _new_ptr(_IpcCount(name), 1)


def _stream_wait_event(stream: int, event: int, flags: int = 0) -> None:
    s, e = _PTRS[stream], _PTRS[event]
    if isinstance(e, _IpcCount):  # (another process's event: up to its count now)
        s.ipc_waited[e.id] = max(s.ipc_waited.get(e.id, 0), int(e.count[0]))
    else:
        s.wait_event(e)


for _f in (
    _ipc_get_mem_handle,
    _ipc_open_mem_handle,
    _ipc_close_mem_handle,
    _ipc_get_event_handle,
    _ipc_open_event_handle,
    _stream_wait_event,
):
    _n = "".join(w.capitalize() if i else w for i, w in enumerate(_f.__name__[1:].split("_")))
    setattr(_Runtime, _n, staticmethod(_f))


_NULL = _Stream(null=True)
_CURRENT: list = [_NULL]


class _StreamType:
    null = _NULL

    def __call__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> _Stream:
        return _NULL if null else _Stream(non_blocking=non_blocking)


class _Device:
    def __init__(self, i: int = 0) -> None:
        self.id = i

    def synchronize(self) -> None:  # every stream's work is done
        _sync("Device.synchronize")
        for stream in _STREAMS:
            stream.synchronize()

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_Runtime.CUDARuntimeError = CUDARuntimeError
cuda = types.SimpleNamespace(
    runtime=_Runtime(),
    Device=_Device,
    Event=_Event,
    get_current_stream=lambda: _CURRENT[-1],
    Stream=_StreamType(),
    MemoryPool=_MemoryPool,
    using_allocator=_UsingAllocator,
    graph=types.SimpleNamespace(Graph=_Graph),
    Memory=_Memory,
    MemoryPointer=_MemoryPointer,
    UnownedMemory=_unowned,
)
