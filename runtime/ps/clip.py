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
(`PSClient.clip_step`). The shard's side is `Shard.clip_sum_squares` / `Shard.clip_apply`, with the
checks below. A bad `apply` (a step the shard does not hold, a scale that is not a number
in [0, 1]) is refused with a PSError and changes nothing. Async mode has no step whose gradients
are all in, so a shard refuses clipped tables there.
"""

from __future__ import annotations

from typing import Any

from runtime.ps.types import PSError, Table


def clipped_tables(tables: dict[str, Table], mode: str) -> set[str]:
    """The tables with a `clip_norm` (and an optimizer); PSError outside sync mode."""
    names = {n for n, t in tables.items() if t.spec.clip_norm is not None and t.kernel}
    if names and mode != "sync":
        raise PSError(
            f"tables {sorted(names)} clip their gradients by global norm, which needs every "
            f"gradient of a step: train them in sync mode, not {mode!r}"
        )
    return names


def check_step(version: dict[str, int], clipped: set[str], step: int, ahead: int, what: str) -> None:
    """PSError unless `step` is the clipped tables' next step or a later one within `ahead`."""
    v = min(version[n] for n in clipped)
    if step < v or step > v + ahead:
        raise PSError(
            f"{what} for step {step}: this shard's clipped tables have applied {v} steps, so "
            f"it expects step {v} (at most max_steps_ahead={ahead} ahead)"
        )


def check_scale(scale: Any) -> float:
    """`scale` as a float; PSError unless it is a number in [0, 1] (clip_norm / max(norm, clip_norm))."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale <= 1:
        raise PSError(
            f"apply: scale {scale!r} is not a number in [0, 1] (clip_norm / max(global "
            "norm, clip_norm)); refused, nothing applied"
        )
    return float(scale)
