"""Parameter initializers that are deterministic per row.

A value depends only on (seed, row id, column), never on how many rows are made at once, so a
parameter server that creates embedding rows lazily, on any shard and in any order, makes exactly the
rows that a single process makes for the whole table. Random bits come from a vectorised SplitMix64
counter hash.

A spec is a dict: {"type": "uniform", "low", "high"} | {"type": "normal", "mean", "std"} |
{"type": "xavier"} (Glorot uniform from the shape's fans) | {"type": "constant", "value"}; plus "seed".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _uniform01(seed: int, row_ids: np.ndarray, ncols: int, stream: int) -> np.ndarray:
    """Uniform floats in (0, 1), shape [len(row_ids), ncols], from (seed, row, col, stream)."""
    rows = np.asarray(row_ids, dtype=np.int64).astype(np.uint64).reshape(-1, 1)
    cols = np.arange(ncols, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        key = _splitmix64(np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x100000001B3) + np.uint64(stream))
        x = _splitmix64(_splitmix64(rows ^ key) + cols)
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) as Paddle/Glorot compute them for a [in, out] weight."""
    if len(shape) < 2:
        return (shape[0] if shape else 1), (shape[0] if shape else 1)
    receptive = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    return shape[0] * receptive, shape[1] * receptive


def init_rows(spec: dict[str, Any], shape: tuple[int, ...], dtype: str, row_ids=None) -> np.ndarray:
    """Rows `row_ids` (default: all rows) of a parameter of `shape` initialised by `spec`."""
    shape = tuple(int(d) for d in shape)
    nrows = shape[0] if shape else 1
    ncols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    ids = np.arange(nrows) if row_ids is None else np.asarray(row_ids)
    seed = int(spec.get("seed", 0))
    kind = spec.get("type", "uniform")
    if kind == "constant":
        out = np.full((len(ids), ncols), float(spec.get("value", 0.0)))
    elif kind in ("uniform", "xavier"):
        if kind == "xavier":
            fi, fo = fans(shape)
            high = math.sqrt(6.0 / (fi + fo))
            low = -high
        else:
            low, high = float(spec.get("low", -1.0)), float(spec.get("high", 1.0))
        out = low + (high - low) * _uniform01(seed, ids, ncols, 0)
    elif kind == "normal":
        u1, u2 = _uniform01(seed, ids, ncols, 1), _uniform01(seed, ids, ncols, 2)
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        out = float(spec.get("mean", 0.0)) + float(spec.get("std", 1.0)) * z
    else:
        raise ValueError(f"unknown initializer type {kind!r} (uniform, normal, xavier, constant)")
    out = out.astype(dtype)
    if row_ids is None:
        return out.reshape(shape)
    return out.reshape((len(ids), *shape[1:]))
