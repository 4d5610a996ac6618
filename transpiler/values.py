"""Values that travel with programs: JSON-like attrs (copied, serialised) and parameter arrays (.npz)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np


def copy_json(o: Any) -> Any:
    """Deep copy of a JSON-like value (dict / list / tuple of scalars) without copy.deepcopy's cost."""
    t = type(o)
    if t is dict:
        return {k: copy_json(v) for k, v in o.items()}
    if t is list:
        return [copy_json(v) for v in o]
    if t is tuple:
        return tuple(copy_json(v) for v in o)
    if o is None or t in (str, int, float, bool):
        return o
    return copy.deepcopy(o)


def json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"attribute value {o!r} of type {type(o).__name__} is not JSON-serialisable")


def save_params(params: dict[str, np.ndarray], path: str | Path) -> None:
    """Parameter values as .npz (names may hold any characters; stored as a name list + arrays)."""
    names = list(params)
    np.savez(path, __names__=np.array(names), **{f"p{i}": params[n] for i, n in enumerate(names)})


def load_params(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        names = [str(n) for n in z["__names__"]]
        return {n: z[f"p{i}"] for i, n in enumerate(names)}
