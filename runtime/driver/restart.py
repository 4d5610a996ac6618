"""Restarts: `train(..., max_restarts=N)` survives the loss of its processes without a person.

When a run fails with `TrainingError` (a trainer or shard that died or was killed, the processes of
a lost node, a process stopped for a second, no report for `stall_timeout`, a failed pause), the
attempt has already been torn down as always (the engine's `stop`: no process left). Then, up to
`max_restarts` times, `run` starts the run again from its restore point and on to the same end
condition (`steps` / `epochs` count the whole run):
- the restore point is the newest checkpoint this run saved completely (a save that the failure
  interrupted never became a checkpoint: saves are atomic, runtime/ps/checkpoint.py), else the
  checkpoint the run was resumed from, else the start;
- the History of the result holds every step once, in order: the steps of a failed attempt after
  its restore point are dropped (they are trained again), its `time` goes on counting wall-clock
  seconds from the first attempt's start, and `restarts` lists a `Restart` record per restart;
- elastic counts: before a restart the engine is asked whether the run still fits
  (`Engine.fits`: a Ray cluster that lost a node may not); if not, trainers are taken away one at
  a time from the type with the most above its `min_trainers`, then shards (down to one: a
  checkpoint loads into any shard count), until it fits; the `Restart` record says so.
After `max_restarts` restarts (or when the run cannot fit any more) the last error is raised again
with every restart in its message, its `.restarts` and its `.history`. A failure of the final save
(`CheckpointSaveError`: training had finished), a bad setting and Ctrl-C are never restarted.

Sync mode: a restarted run trains exactly what the uninterrupted run trains (the same steps on the
same batches from the same table state: runtime/driver/checkpoints.py). Async mode: the tables
restart from the checkpoint's state, which holds every push applied before its step and none
after it; the data goes on at the checkpoint's step; pushes of the lost steps die with the attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from runtime.driver import checkpoints
from runtime.driver.history import CheckpointSaveError, History, Restart, TrainingError
from runtime.driver.settings import Settings
from transpiler.plan import Plan
from transpiler.settings import ScaleConfig

Attempt = Callable[[Settings], History]


@dataclass
class _Run:
    """The restarts of one `train` call so far."""

    plan: Plan
    settings: Settings
    done: History | None = None  # every step recorded so far, the attempts joined
    saved: list[Path] | None = None  # complete checkpoints the run saved, oldest first
    first_start: float | None = None  # the first attempt's training start (driver clock)


def run(plan: Plan, settings: Settings, attempt: Attempt, fits: Callable[[ScaleConfig], bool]) -> History:
    """`attempt(settings)` until it returns, restarting as the module docstring says."""
    if settings.failure.max_restarts == 0:
        return attempt(settings)
    r = _Run(plan, settings, saved=[])
    current = settings
    while True:
        try:
            got = attempt(current)
        except CheckpointSaveError:
            raise
        except TrainingError as e:
            failed_at = time.perf_counter()
            current = _after_failure(r, current, e, failed_at, fits)
            continue
        return _join(r.done, got, r)


def _after_failure(
    r: _Run, current: Settings, e: TrainingError, failed_at: float, fits: Callable[[ScaleConfig], bool]
) -> Settings:
    """The settings of the next attempt after `e`, or `e` raised again with the record."""
    h = getattr(e, "history", None) or History(first_step=_start_of(r, current))
    r.saved.extend(Path(p) for p in h.saved)
    whole = _join(r.done, h, r)
    path, step = _restore_point(r, current)
    before = len(whole.restarts)
    scale, note = _fitting(current.scale.resolved(r.plan), current.failure.min_trainers or {}, fits)
    record = Restart(
        at=round(failed_at - (r.first_start or failed_at), 3),
        when=time.time(),
        culprit=e.who,
        error=e.detail.strip().splitlines()[-1][:300] if e.detail.strip() else "",
        failed_at_step=h.first_step + h.steps,
        resumed_from=step,
        checkpoint=None if path is None else str(path),
        steps_lost=max(0, h.first_step + h.steps - step),
        seconds_lost=round(_seconds_lost(h, step, failed_at), 3),
        trainers=dict(scale.trainers) if scale is not None else {},
        servers=scale.servers if scale is not None else 0,
        note=note,
    )
    r.done = whole
    steps = current.run.steps
    if steps is not None and step >= steps:  # (the end's checkpoint was saved: a later step failed)
        raise _given_up(e, whole, f"with nothing left to train after step {step}")
    if before >= r.settings.failure.max_restarts or scale is None:
        raise _given_up(e, whole, note if scale is None else f"after {before} restart(s)")
    whole.restarts = [*whole.restarts, record]
    ck = replace(current.checkpoint, resume=path)
    return replace(current, scale=scale, checkpoint=ck)


def _start_of(r: _Run, current: Settings) -> int:
    resume = current.checkpoint.resume
    return 0 if resume is None else checkpoints.read_state(checkpoints.latest(resume)).step


def _restore_point(r: _Run, current: Settings) -> tuple[Path | None, int]:
    """The newest complete checkpoint this run saved (else the one it was resumed from, else the
    start): (its path or None, its step)."""
    for path in reversed(r.saved):
        try:
            return path, checkpoints.check_resume(r.plan, path).step
        except (OSError, ValueError):  # removed (keep=) or unreadable: an older one
            continue
    resume = r.settings.checkpoint.resume
    if resume is None:
        return None, 0
    path = checkpoints.latest(resume)
    return path, checkpoints.read_state(path).step


def _seconds_lost(h: History, step: int, failed_at: float) -> float:
    """Wall seconds of training of the failed attempt after its restore point's step ended."""
    if not h.started_at:
        return 0.0
    k = step - h.first_step  # steps of this attempt kept
    kept_until = h.time[k - 1] if 0 < k <= len(h.time) else 0.0
    return max(0.0, failed_at - h.started_at - kept_until)


def _fitting(
    scale: ScaleConfig, least: dict[str, int], fits: Callable[[ScaleConfig], bool]
) -> tuple[ScaleConfig | None, str]:
    """`scale`, with fewer trainers (down to `least`, by type) and shards when the engine cannot
    place it all again; None when even the fewest do not fit."""
    lowest = {t: min(n, least.get(t, n)) for t, n in scale.trainers.items()}
    full, start = dict(scale.trainers), scale
    while not fits(scale):
        counts = dict(scale.trainers)
        spare = {t: n - lowest[t] for t, n in counts.items() if n > lowest[t]}
        if spare:
            t = max(spare, key=lambda k: (spare[k], k))
            scale = replace(scale, trainers={**counts, t: counts[t] - 1})
        elif scale.servers > 1:
            scale = replace(scale, servers=scale.servers - 1)
        else:
            return None, f"cannot place even {counts} trainers and 1 shard (min_trainers {lowest})"
    if scale == start:
        return scale, ""
    return scale, (
        f"fewer processes fit: restarted with trainers {scale.trainers} and {scale.servers} shard(s) "
        f"(was {full} and {start.servers})"
    )


def _given_up(e: TrainingError, whole: History, why: str) -> TrainingError:
    """`e` again, with every restart of the run in its message, `.restarts` and `.history`."""
    lines = [str(x) for x in whole.restarts] or ["(none)"]
    err = TrainingError(e.who, f"{e.detail}\n\ngiving up {why}; the restarts before:\n" + "\n".join(lines))
    err.restarts, err.history = whole.restarts, whole
    err.__cause__ = e
    return err


def _join(a: History | None, b: History, r: _Run) -> History:
    """History `a` (the steps before b's first) followed by `b`; b's times counted from a's start."""
    if r.first_start is None and b.started_at:
        r.first_start = b.started_at
    if a is None:
        return b
    keep = max(0, b.first_step - a.first_step)
    shift = (b.started_at - a.started_at) if b.started_at and a.started_at else 0.0
    dropped = min(len(a.scores), max(0, a.first_step + a.steps - b.first_step))
    out = replace(
        b,
        loss=a.loss[:keep] + b.loss,
        auc=a.auc[:keep] + b.auc,
        examples=a.examples[:keep] + b.examples,
        time=a.time[:keep] + [t + shift for t in b.time],
        first_step=a.first_step,
        startup_s=a.startup_s,
        started_at=a.started_at or b.started_at,
        wall_s=b.wall_s + shift,
        scores=(a.scores[: len(a.scores) - dropped] + b.scores)[-100:],
        eval=[x for x in a.eval if x["step"] <= b.first_step] + b.eval,
        refused_messages=a.refused_messages + b.refused_messages,
        refused_connections=a.refused_connections + b.refused_connections,
        restarts=a.restarts + b.restarts,
        saved=a.saved + b.saved,
    )
    return out
