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
from typing import Any

import numpy as np

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


def to_host(v: Any) -> Any:
    """A numpy array of `v`, copied off the GPU for cupy arrays; a row-sparse value (`SparseRows`)
    is returned as it is (its parts stay where they are)."""
    if hasattr(v, "__cuda_array_interface__"):
        return v.get()
    if hasattr(v, "to_dense"):
        return v
    return np.asarray(v)
