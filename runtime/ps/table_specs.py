"""Checking a parameter-server table's spec (`check_spec`): kind, shape, dtype, initializer,
optimizer (its attrs from `ops_registry.optimizer.update_attrs`), clip norm, admission / eviction."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ops_registry.optimizer import STATE, update_attrs
from runtime.ps.entry import check_entry
from runtime.ps.lifecycle import check_lifecycle
from runtime.ps.types import PSError
from transpiler.tables import OptimizerSpec, TableSpec


def optimizer_attrs(name: str, spec: OptimizerSpec) -> dict[str, Any]:
    """The update op's attrs of a table's optimizer (`ops_registry.optimizer.update_attrs`)."""
    hyper = spec.hyper
    if spec.type not in STATE or "lr" not in hyper:
        raise PSError(
            f"table {name!r}: optimizer {spec.to_dict()!r} needs 'type' in {sorted(STATE)} and 'lr'"
        )
    try:
        return update_attrs(spec.type, hyper)
    except (TypeError, ValueError) as e:
        raise PSError(f"table {name!r}: bad {spec.type} hyper-parameters {hyper}: {e}") from None


def check_spec(spec: TableSpec) -> TableSpec:
    """`spec` with its shape and dtype normalised; PSError naming the table and field when malformed."""
    if not isinstance(spec, TableSpec):
        raise TypeError(
            f"a table spec must be a transpiler.tables.TableSpec (TableSpec.from_dict makes one "
            f"from a dict), got {type(spec).__name__}"
        )
    name = spec.name
    if not isinstance(name, str) or not name:
        raise PSError(f"table spec {spec!r} needs a non-empty string 'name'")
    kind, shape = spec.kind, spec.shape
    if kind not in ("dense", "sparse"):
        raise PSError(f"table {name!r}: kind {kind!r} is not 'dense' or 'sparse'")
    if (
        not isinstance(shape, (list, tuple))
        or not all(isinstance(d, int) for d in shape)
        or (kind == "sparse" and (len(shape) != 2 or shape[1] <= 0 or shape[0] == 0 or shape[0] < -1))
        or (kind == "dense" and any(d <= 0 for d in shape))
    ):
        want = "[vocab or -1, dim]" if kind == "sparse" else "positive ints"
        raise PSError(f"table {name!r}: shape {shape!r} must be {want}")
    dtype = np.dtype(spec.dtype)
    if dtype.kind != "f":
        raise PSError(f"table {name!r}: dtype {dtype} is not a float type")
    init = spec.initializer
    if init is not None and init.get("type") == "xavier" and kind == "sparse" and shape[0] == -1:
        raise PSError(f"table {name!r}: a xavier initializer needs a known vocab (shape[0] = -1)")
    if spec.optimizer is not None:
        optimizer_attrs(name, spec.optimizer)
    clip = spec.clip_norm
    if clip is not None and (
        isinstance(clip, bool)
        or not isinstance(clip, (int, float))
        or not 0 < clip < float("inf")
        or spec.optimizer is None
    ):
        raise PSError(
            f"table {name!r}: clip_norm {clip!r} must be a positive finite number, on a "
            "table with an optimizer"
        )
    _check_row_rules(spec)
    return replace(spec, shape=list(shape), dtype=dtype.name)


def _check_row_rules(spec: TableSpec) -> None:
    """PSError naming the table when its admission / eviction, lifecycle or delta checkpoint rules
    are malformed, or given to a dense table."""
    name, kind = spec.name, spec.kind
    for given, what, check in (
        (spec.entry is not None or spec.evict_after is not None, "entry / evict_after",
         lambda: check_entry(name, spec.entry, spec.evict_after)),
        (spec.lifecycle is not None, "lifecycle rules", lambda: check_lifecycle(name, spec.lifecycle)),
    ):  # fmt: skip
        if not given:
            continue
        if kind != "sparse":
            raise PSError(f"table {name!r}: {what} apply to sparse tables only")
        try:
            check()
        except ValueError as e:
            raise PSError(str(e)) from None
    k = spec.delta_every
    if k is not None and (
        isinstance(k, bool) or not isinstance(k, int) or k < 1 or (k > 1 and kind != "sparse")
    ):
        raise PSError(
            f"table {name!r}: delta_every {k!r} must be a positive int (saves per full save), on a "
            "sparse table when above 1"
        )
