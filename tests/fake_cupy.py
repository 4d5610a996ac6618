"""A strict stand-in for cupy, for tests: "device" arrays live in host memory but cannot mix with host
arrays, as on a GPU.

`np.asarray(dev)`, `np.add(dev, host)`, `dev + host`, `dev[...] = host` and passing a host array to
any `fake_cupy` function other than `asarray` / `array` raise `TypeError`, as cupy does (cupy's
"Implicit conversion to a NumPy array is not allowed"). The only crossings are `asarray` / `array`
(host -> device) and `asnumpy` / `ndarray.get()` (device -> host); `COUNTS` tallies each direction's
crossings and bytes. Python and numpy scalars mix freely, as in cupy; host integer arrays are
accepted as indices, as cupy accepts them.

This checks hetps's device logic (which values cross, and where), not cupy itself: kernels run on
numpy underneath. Use it through `HETPS_FAKE_CUPY=fake_cupy` (see `runtime.exec.device`), which
spawned trainer processes inherit.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.special


@dataclass
class Counts:
    h2d: int = 0
    h2d_bytes: int = 0
    d2h: int = 0
    d2h_bytes: int = 0

    def reset(self) -> None:
        self.h2d = self.h2d_bytes = self.d2h = self.d2h_bytes = 0


COUNTS = Counts()


def _host_error(what: Any) -> TypeError:
    return TypeError(
        f"fake_cupy: a host {type(what).__name__} was mixed with device arrays; cross explicitly "
        "with xp.asarray (host -> device) or .get() / xp.asnumpy (device -> host)"
    )


def _unwrap(v: Any) -> Any:
    """The numpy value under device values; host arrays (not numpy scalars) raise."""
    if isinstance(v, ndarray):
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
        return v._a
    if isinstance(v, tuple):
        return tuple(_unwrap_index(x) for x in v)
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


def _call(fn: Any, args: tuple, kwargs: dict) -> Any:
    return _wrap(fn(*_unwrap(args), **_unwrap(kwargs)))


class ndarray:  # noqa: N801  (cupy's name)
    """A device array: a numpy array that refuses implicit conversion to the host."""

    __slots__ = ("_a",)
    __array_priority__ = 1000

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    # --- crossings and the refusals
    def get(self) -> np.ndarray:
        COUNTS.d2h += 1
        COUNTS.d2h_bytes += self._a.nbytes
        return self._a.copy()

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

    def __bool__(self) -> bool:
        return bool(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __index__(self) -> int:
        return self._a.__index__()

    def item(self) -> Any:
        return self._a.item()

    def tolist(self) -> Any:
        return self._a.tolist()

    def __getitem__(self, key: Any) -> Any:
        return _wrap(self._a[_unwrap_index(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[_unwrap_index(key)] = _unwrap(value)

    def __getattr__(self, name: str) -> Any:  # methods: reshape, astype, sum, ...
        if name.startswith("__"):  # no __array_interface__ / __array_struct__: numpy must not see in
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr)
        return lambda *args, **kwargs: _call(attr, args, kwargs)

    def __getstate__(self) -> Any:
        raise TypeError("fake_cupy: a device array cannot be pickled; copy it to the host with .get()")


def _operator(name: str) -> Any:
    def op(self: ndarray, *args: Any) -> Any:
        return _call(getattr(self._a, name), args, {})

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
    host = np.asarray(a, dtype=dtype, order=order)
    COUNTS.h2d += 1
    COUNTS.h2d_bytes += host.nbytes
    return ndarray(host.copy())


def array(a: Any, dtype: Any = None, copy: bool = True, order: Any = "K", ndmin: int = 0) -> ndarray:
    if isinstance(a, ndarray):
        return ndarray(np.array(a._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
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
        u.at(a._a, _unwrap_index(slices), _unwrap(value))

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
        return {"name": b"fake_cupy device"}


class _Stream:
    def synchronize(self) -> None:
        pass


class _Device:
    def __init__(self, i: int = 0) -> None:
        self.id = i

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


cuda = types.SimpleNamespace(
    runtime=_Runtime(),
    Device=_Device,
    get_current_stream=lambda: _Stream(),
    Stream=types.SimpleNamespace(null=_Stream()),
)
