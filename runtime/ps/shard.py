"""Shard: the tables one parameter server holds, and the rules of the training mode.

- `async`: a push is applied on arrival (one optimizer step per push).
- `sync`: a push carries its step number t. The shard keeps pushes of step t apart until all
  `pushes_per_step` pushers of that table have pushed, then sums them and applies one optimizer step
  (a sparse sum is the concatenation of the row gradients, which the optimizer kernel merges), so a
  step equals single-machine training on the union batch. `version[table]` counts applied steps; a
  pull for step t+1 raises `NotReady` while version <= t, and the server parks it and answers it
  right after step t is applied (see server.py), so trainers cannot read half-updated parameters.
  A table with `clip_norm` holds its complete step until an `apply` gives the scale (clip.py).
- `geo`: a push is a delta the trainer accumulated locally over k steps; it is added to the rows.

Limits (`Limits`, each refused with a PSError naming its option): a request may create at most
`max_new_rows` rows of an unbounded (`vocab=-1`) table; a sync push or pull may be at most
`max_steps_ahead` steps past the table's applied steps, and at most `max_buffered` pushes may wait
for later steps per table. The server adds its own (message bytes, parked pulls; see server.py).

The same object runs inside the server process and in-process (tests, reference runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.ps import checkpoint, clip, held_tables, tiered
from runtime.ps.entry import ENTRY_CLOCK, ENTRY_LAST, WAITING
from runtime.ps.sharding import shard_of, tables_of_shard
from runtime.ps.table import DenseTable, PSError, SparseTable, check_spec, make_table
from runtime.transport.wire import MAX_MESSAGE_BYTES
from transpiler.config import MODES as PLAN_MODES
from transpiler.tables import TableSpec

# What a shard serves: the plan's modes, and GEO deltas (GeoTable) for a client that keeps local copies and
# pushes differences itself (hetps's trainers do not: TranspileConfig refuses mode='geo').
MODES = (*PLAN_MODES, "geo")
MAX_NEW_ROWS = 1 << 20  # rows one request may create in an unbounded sparse table
MAX_STEPS_AHEAD = 64  # how far past the applied steps a sync push or pull may be
MAX_BUFFERED = 1024  # sync pushes per table waiting for later steps
MAX_PARKED = 4096  # sync pulls a server holds until their step is applied


def check_ids_given(kind: str, table: str, ids: Any, what: str) -> None:
    """PSError unless ids come with a sparse table and only with one (`what`: pull, push, assign);
    the clients check before sending, the shards again on receipt."""
    if (ids is None) == (kind == "sparse"):
        need = "needs ids" if ids is None else "takes no ids"
        raise PSError(f"{what} of {kind} table {table!r} {need}")


@dataclass(frozen=True)
class Limits:
    """What one request, or all waiting requests together, may cost a parameter server."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_new_rows: int = MAX_NEW_ROWS
    max_steps_ahead: int = MAX_STEPS_AHEAD
    max_buffered: int = MAX_BUFFERED
    max_parked: int = MAX_PARKED


def _count_distinct(ids: np.ndarray) -> int:
    """len(np.unique(ids)), by a sort: numpy 2.4's hash-based unique is ~15x slower on 1M int64."""
    s = np.sort(ids)
    return int(np.count_nonzero(s[1:] != s[:-1])) + 1 if s.size else 0


def _sum_parts(grads: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The sum of dense gradients, accumulated in place into one fresh array (no stacked copy)."""
    out = np.array(grads[0], dtype=dtype)
    for g in grads[1:]:
        out += g
    return out


class NotReady(Exception):
    """A sync-mode pull for a step whose predecessor has not been applied yet."""


class Shard:
    def __init__(
        self,
        specs: list[TableSpec],
        *,
        shard: int = 0,
        num_shards: int = 1,
        mode: str = "async",
        pushes_per_step: int | dict[str, int] = 1,
        check_finite: bool = True,
        limits: Limits | None = None,
    ) -> None:
        if mode not in MODES:
            raise PSError(f"mode {mode!r} is not one of {MODES}")
        if not 0 <= shard < num_shards:
            raise PSError(f"shard index {shard} is outside [0, {num_shards})")
        self.specs = sorted((check_spec(s) for s in specs), key=lambda s: s.name)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise PSError(f"table names repeat: {names}")
        self.shard, self.num_shards, self.mode = shard, num_shards, mode
        self.check_finite, self.limits = check_finite, limits or Limits()
        self.tables: dict[str, DenseTable | SparseTable] = {
            s.name: make_table(s, check_finite) for s in tables_of_shard(self.specs, shard, num_shards)
        }
        if isinstance(pushes_per_step, dict):
            missing = sorted(
                n
                for n, t in self.tables.items()  # frozen tables are never pushed
                if n not in pushes_per_step and t.kernel is not None
            )
            if missing:
                raise PSError(f"pushes_per_step names no count for tables {missing}")
            self.expected = {n: int(pushes_per_step.get(n, 0)) for n in self.tables}
        else:
            self.expected = dict.fromkeys(self.tables, int(pushes_per_step))
        self.version = dict.fromkeys(self.tables, 0)
        self.applied = dict.fromkeys(self.tables, 0)  # pushes applied since start (not checkpointed)
        self.pending: dict[str, dict[int, dict[str, tuple]]] = {n: {} for n in self.tables}
        self.clip_tables = clip.clipped_tables(self)
        self.held: dict[str, clip.Held] = {}  # clipped table -> its step's gradient, awaiting the scale
        self.holds: dict[
            str, tuple[int, int, str]
        ] = {}  # held -> (version, applied, holder) (held_tables.py)

    def table(self, name: str) -> DenseTable | SparseTable:
        try:
            return self.tables[name]
        except KeyError:
            raise PSError(
                f"unknown table {name!r} on shard {self.shard}; it holds {sorted(self.tables)}"
            ) from None

    # -- pull / push ------------------------------------------------------------------------
    def _ids_args(self, t: DenseTable | SparseTable, ids: np.ndarray | None, what: str) -> tuple:
        """(ids,) for a sparse table, () for a dense one; PSError when ids are missing / extra."""
        check_ids_given(t.spec.kind, t.name, ids, what)
        return () if ids is None else (ids,)

    def _check_new_rows(self, t: DenseTable | SparseTable, ids: np.ndarray | None, what: str) -> None:
        """PSError when `ids` would create more than `max_new_rows` rows of an unbounded table."""
        limit = self.limits.max_new_rows
        if not isinstance(t, SparseTable) or t.vocab > 0 or ids is None or np.size(ids) <= limit:
            return  # (fewer ids than the limit cannot create more rows than it)
        ids = t.check_ids(ids)
        missing = ids[t.index.find(ids) < 0]
        if missing.size > limit and (new := _count_distinct(missing)) > limit:
            raise PSError(
                f"{what} of unbounded table {t.name!r} would create {new} rows in one request, "
                f"more than max_new_rows={limit}; send fewer new ids per request"
            )

    def _check_step(self, t: DenseTable | SparseTable, step: int | None, what: str) -> None:
        ahead = self.limits.max_steps_ahead  # (a frozen table never counts steps: nothing to bound)
        if (
            self.mode == "sync"
            and step is not None
            and t.kernel is not None
            and step > self.version[t.name] + ahead
        ):
            raise PSError(
                f"sync {what} of {t.name!r} for step {step}: the table has applied "
                f"{self.version[t.name]} steps, and requests may be at most "
                f"max_steps_ahead={ahead} steps ahead"
            )

    def pull(
        self,
        name: str,
        ids: np.ndarray | None = None,
        step: int | None = None,
        peek: bool = False,
        copy: bool = True,
    ) -> np.ndarray:
        """A dense table or sparse rows. `peek`: read without creating rows or touching counters
        (evaluation; `SparseTable.peek`). `copy=False`: a dense table as a read-only view of its
        parameter (`DenseTable.pull`), for a caller that copies it at once; sparse rows are always
        fresh arrays."""
        t = self.table(name)
        args = self._ids_args(t, ids, "pull")
        if isinstance(t, DenseTable):
            args = (copy,)
        if peek:
            return t.peek(*args) if isinstance(t, SparseTable) else t.pull(*args)
        held_tables.check_not_held(self, name, "pull")
        self._check_step(t, step, "pull")
        if self.mode == "sync" and step is not None and self.version[name] < step and t.kernel is not None:
            raise NotReady(name, step)  # (a frozen table never changes: nothing to wait for)
        self._check_new_rows(t, ids, "pull")
        return t.pull(*args)

    def push(
        self,
        name: str,
        grad: np.ndarray,
        ids: np.ndarray | None = None,
        step: int | None = None,
        pusher: str = "0",
    ) -> bool:
        """Apply or buffer one push; True when a step was applied (sync: parked pulls may go on)."""
        t = self.table(name)
        held_tables.check_not_held(self, name, "push")
        args = self._ids_args(t, ids, "push")
        self._check_new_rows(t, ids, "push")
        if self.mode == "sync":
            return self._sync_push(t, grad, ids, step, str(pusher))
        (t.add if self.mode == "geo" else t.push)(grad, *args)
        self.applied[name] += 1
        return True

    def _sync_push(self, t, grad, ids, step, pusher) -> bool:
        name, v = t.name, self.version[t.name]
        if step is None or step < v:
            raise PSError(
                f"sync push to {name!r}: step {step} is not a pending step (table has "
                f"applied {v} steps, so pushes for step >= {v} are expected)"
            )
        self._check_step(t, step, "push")
        if step == v and name in self.held:
            raise PSError(
                f"sync push to {name!r}: every pusher's step {step} is in already (held for "
                "its global-norm clip scale); refused"
            )
        waiting = sum(len(got) for s, got in self.pending[name].items() if s != v)
        if step != v and waiting >= self.limits.max_buffered:
            raise PSError(
                f"sync push to {name!r} for step {step}: {waiting} pushes already wait for "
                f"steps after {v}, the limit max_buffered={self.limits.max_buffered}"
            )
        if isinstance(t, SparseTable):
            ids = t.check_ids(ids)
            grad = t.check_grad(grad, (ids.size, t.dim), "gradient")
        else:
            grad = t.check_grad(grad, t.shape, "gradient")
        got = self.pending[name].setdefault(step, {})
        if pusher in got:
            raise PSError(f"sync push to {name!r}: pusher {pusher!r} already pushed step {step}")
        got[pusher] = (grad, ids)
        return self.advance(t)

    def advance(self, t: DenseTable | SparseTable) -> bool:
        """Apply table t's complete sync steps in order (a clipped table's next one is held for its
        scale instead: runtime/ps/clip.py); True when a step was applied or held."""
        name, applied = t.name, False
        while (
            name not in self.held
            and len(self.pending[name].get(self.version[name], ())) >= self.expected[name]
        ):
            parts = [p for _, p in sorted(self.pending[name].pop(self.version[name]).items())]
            if name in self.clip_tables:
                self.held[name] = clip.hold(t, parts)
                return True
            if isinstance(t, SparseTable):  # (each part was checked on arrival)
                if len(parts) == 1:
                    t.push(parts[0][0], parts[0][1], checked=True)
                else:
                    t.push(
                        np.concatenate([g for g, _ in parts]),
                        np.concatenate([i for _, i in parts]),
                        checked=True,
                    )
            else:
                t.push(_sum_parts([g for g, _ in parts], t.dtype), checked=True)
            self.version[name] += 1
            self.applied[name] += len(parts)
            applied = True
        return applied

    def clip_sum_squares(self, step: int) -> float:
        """The sum of squares of this shard's clipped gradients of `step` (`clip.sum_squares`)."""
        return clip.sum_squares(self, step)

    def clip_apply(self, step: int, scale: float) -> list[str]:
        """Apply the held gradients of `step` scaled by `scale` (`clip.apply`); the tables applied."""
        return clip.apply(self, step, scale)

    def assign(self, name: str, values: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Set values (imported weights); optimizer state and sync step counts are untouched."""
        t = self.table(name)
        t.assign(values, *self._ids_args(t, ids, "assign"))  # (admin only: imports may be large)

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | Path) -> list[dict]:
        """Write this shard's table files into `path`; their manifest entries."""
        index = {s.name: i for i, s in enumerate(self.specs)}
        return [
            tiered.save_entry(t, path, index[n], self.shard, self.num_shards, self.version[n])
            if t.spec.storage == "disk"
            else checkpoint.write_arrays(
                path,
                checkpoint.file_name(index[n], n, self.shard),
                n,
                {**t.state_dict(), "version": np.array([self.version[n]])},
            )
            for n, t in self.tables.items()
        ]

    def load(self, path: str | Path, step: int | None = None) -> None:
        """Replace every table of this shard by its rows in checkpoint `path` (any shard count).
        `step`: the applied sync steps to count from (a resumed run's first step; a checkpoint of
        an async run counts none), else the saved counts."""
        doc = checkpoint.read_manifest(path)
        saved = {s["name"]: s for s in doc["tables"]}
        fresh = {}
        for name, t in self.tables.items():
            s = saved.get(name)
            if (
                s is None
                or s["kind"] != t.spec.kind
                or list(s["shape"]) != list(t.shape)
                or (s["optimizer"] or {}).get("type") != (t.spec.optimizer and t.spec.optimizer.type)
            ):
                raise checkpoint.CheckpointError(
                    f"checkpoint {str(path)!r} has table {name!r} as {s}, this server has {t.spec}"
                )
            new = make_table(t.spec, self.check_finite)
            entries = [e for e in doc["files"] if e["table"] == name]
            if not entries:
                raise checkpoint.CheckpointError(f"checkpoint {str(path)!r} has no file for table {name!r}")
            for e in entries:
                if e.get("store") == tiered.STORE:  # a tiered table's directory
                    version = tiered.load_entry(new, path, e, self.shard, self.num_shards)
                    continue
                arrays = checkpoint.read_arrays(path, e)
                _check_shapes(path, e, new, arrays)
                version = int(arrays.pop("version")[0])
                if isinstance(new, SparseTable):
                    mine = shard_of(arrays["ids"], self.num_shards) == self.shard
                    per_row = {"ids", "Param", ENTRY_LAST, *new.state_slots}
                    arrays = {k: (a[mine] if k in per_row else a) for k, a in arrays.items()}
                    if WAITING[0] in arrays:  # ids waiting for admission: this shard's
                        wait = shard_of(arrays[WAITING[0]], self.num_shards) == self.shard
                        arrays.update({k: arrays[k][wait] for k in WAITING})
                new.load_state(arrays)
            fresh[name] = (new, version)
        for name, (new, version) in fresh.items():
            self.close_table(name)
            self.tables[name], self.version[name] = new, version if step is None else step
            self.pending[name].clear()
            self.held.pop(name, None)

    def close_table(self, name: str) -> None:
        """Release a table's resources beyond RAM (a tiered table's engine files)."""
        close = getattr(self.tables[name], "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """Release every table's resources beyond RAM (a tiered table's engine files)."""
        for name in self.tables:
            self.close_table(name)


def _check_shapes(
    path: str | Path, entry: dict, t: DenseTable | SparseTable, arrays: dict[str, np.ndarray]
) -> None:
    """CheckpointError unless the file holds exactly the arrays table `t` needs, in its shapes."""
    n = arrays["ids"].shape[0] if isinstance(t, SparseTable) and "ids" in arrays else 0
    want = {"version": (1,), **{s: (1,) for s in t.scalars}}
    if isinstance(t, SparseTable):
        want.update({"ids": (n,), "Param": (n, t.dim), **{s: (n, t.dim) for s in t.state_slots}})
        if t.entry is not None and ENTRY_CLOCK in arrays:  # (checkpoints before issue 15 lack it)
            want.update({ENTRY_CLOCK: (1,), ENTRY_LAST: (n,)})
            if t.entry.waiting is not None:
                w = arrays[WAITING[0]].shape[0] if WAITING[0] in arrays else 0
                want.update(dict.fromkeys(WAITING, (w,)))
    else:
        want.update({"Param": t.shape, **{s: t.shape for s in t.state_slots}})
    got = {k: a.shape for k, a in arrays.items()}
    if got != want:
        shapes = lambda d: {k: list(v) for k, v in sorted(d.items())}
        raise checkpoint.CheckpointError(
            f"checkpoint {str(path)!r}: file {entry['file']!r} of table {t.name!r} holds arrays "
            f"{shapes(got)}; the table's spec needs {shapes(want)}"
        )


def save_shards(shards: list[Shard], path: str | Path) -> None:
    """Checkpoint in-process shards into `path` (PSClient.save does the same for server processes)."""
    stage = checkpoint.begin(path)
    try:
        files = [e for s in shards for e in s.save(stage)]
        checkpoint.finish(stage, path, shards[0].specs, files, num_shards=len(shards), mode=shards[0].mode)
    except BaseException:
        checkpoint.abort(stage)
        raise
