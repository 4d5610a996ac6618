"""Gradient clipping by global norm on the parameter servers (sync mode).

Paddle's ClipGradByGlobalNorm scales every gradient of a step by
clip_norm / max(global norm, clip_norm), the norm taken over the whole step's gradient: every
clipped table, every trainer, every micro-batch, every shard. A table spec with `clip_norm` (set by
transpile for the tables a `clip_by_global_norm` op clips) makes its shard work in three moves:

1. once every pusher's step-t gradient of a clipped table is in, the shard sums them (a sparse
   table's rows of repeated ids merged) and *holds* the sum (`Held`) instead of applying it;
2. a `norm` request for step t answers the shard's sum of squared gradient entries over its held
   tables, once all of them hold step t (until then the server parks it, like a sync pull);
3. an `apply` request for step t with the scale multiplies each held gradient by it and applies
   it (the table's optimizer, with its L2 decay / AdamW decay after the clip, as Paddle orders
   them); the tables' step count moves on, so parked pulls of step t + 1 are answered.

One trainer (the run's first) asks every shard for its norm after its own push of step t, computes
the scale (`ops_registry.optimizer.global_norm_scale`) and sends `apply` to every shard
(`PSClient.clip_step`). A bad `apply` (a step the shard does not hold, a scale that is not a number
in [0, 1]) is refused with a PSError and changes nothing. Async mode has no step whose gradients
are all in, so a shard refuses clipped tables there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ops_registry.base import RowMerge
from runtime.ps.table import PSError, SparseTable

if TYPE_CHECKING:
    from runtime.ps.shard import Shard

CLIP = "@clip"  # the key `norm` requests park under on a server (no table name starts with "@")


@dataclass
class Held:
    """A clipped table's summed gradient of one step, waiting for its scale."""

    grad: np.ndarray
    ids: np.ndarray | None  # a sparse table's rows (unique); None for a dense table
    parts: int  # the pushes summed


def clipped_tables(shard: Shard) -> set[str]:
    """The shard's tables with a `clip_norm` (and an optimizer); PSError outside sync mode."""
    names = {n for n, t in shard.tables.items() if t.spec.clip_norm is not None and t.kernel}
    if names and shard.mode != "sync":
        raise PSError(
            f"tables {sorted(names)} clip their gradients by global norm, which needs every "
            f"gradient of a step: train them in sync mode, not {shard.mode!r}"
        )
    return names


def hold(t: Any, parts: list[tuple[np.ndarray, np.ndarray | None]]) -> Held:
    """The sum of a step's pushes to table `t` (each checked on arrival)."""
    if not isinstance(t, SparseTable):
        out = np.array(parts[0][0], dtype=t.dtype)
        for g, _ in parts[1:]:
            out += g
        return Held(out, None, len(parts))
    ids = np.concatenate([i for _, i in parts])
    grad = np.concatenate([g for g, _ in parts])
    if ids.size:
        merge = RowMerge.of(np, ids)
        ids, grad = merge.unique_rows, merge.sum(np, grad)
    return Held(grad, ids, len(parts))


def _step_of(shard: Shard, step: int, what: str) -> None:
    """PSError unless `step` is the clipped tables' next step or a later one within the limits."""
    v = min(shard.version[n] for n in shard.clip_tables)
    if step < v or step > v + shard.limits.max_steps_ahead:
        raise PSError(
            f"{what} for step {step}: this shard's clipped tables have applied {v} steps, so "
            f"it expects step {v} (at most max_steps_ahead={shard.limits.max_steps_ahead} ahead)"
        )


def sum_squares(shard: Shard, step: int) -> float:
    """The sum of squares of the shard's held step-`step` gradients; NotReady until all are held."""
    from runtime.ps.shard import NotReady

    if not shard.clip_tables:
        return 0.0
    _step_of(shard, step, "norm")
    if any(n not in shard.held or shard.version[n] != step for n in shard.clip_tables):
        raise NotReady(CLIP, step)
    return sum(float(np.sum(np.square(h.grad))) for h in shard.held.values())


def check_scale(scale: Any) -> float:
    """`scale` as a float; PSError unless it is a number in [0, 1] (clip_norm / max(norm, clip_norm))."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale <= 1:
        raise PSError(
            f"apply: scale {scale!r} is not a number in [0, 1] (clip_norm / max(global "
            "norm, clip_norm)); refused, nothing applied"
        )
    return float(scale)


def apply(shard: Shard, step: int, scale: Any) -> list[str]:
    """Apply the held step-`step` gradients scaled by `scale`; the tables applied (then the next
    complete steps of them are held in turn)."""
    scale = check_scale(scale)
    if not shard.clip_tables:
        return []
    _step_of(shard, step, "apply")
    missing = sorted(n for n in shard.clip_tables if n not in shard.held or shard.version[n] != step)
    if missing:
        raise PSError(
            f"apply for step {step}: tables {missing} do not hold that step's gradients yet "
            "(send norm first and wait for its answer); refused, nothing applied"
        )
    for name in sorted(shard.clip_tables):
        h, t = shard.held.pop(name), shard.tables[name]
        grad = (h.grad * t.dtype.type(scale)).astype(t.dtype, copy=False)
        if h.ids is None:
            t.push(grad, checked=True)
        else:
            t.push(grad, h.ids, checked=True)
        shard.version[name] += 1
        shard.applied[name] += h.parts
    for name in sorted(shard.clip_tables):
        shard.advance(shard.tables[name])
    return sorted(shard.clip_tables)
