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
`max_new_rows` rows of an unbounded (`vocab=-1`) table, and the shard's tables in RAM may hold at
most `max_memory_bytes` (default: the memory this machine had available when the shard started;
checked at start for what the tables allocate then, and whenever a request creates sparse rows);
a sync push or pull may be at most `max_steps_ahead` steps past the table's applied steps, and at
most `max_buffered` pushes may wait for later steps per table. The server adds its own (message
bytes, parked pulls; see server.py).

The same object runs inside the server process and in-process (tests, reference runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.ps import checkpoint, clip, delta, tiered
from runtime.ps.make import make_table
from runtime.ps.sharding import shard_of, tables_of_shard
from runtime.ps.table import check_spec
from runtime.ps.types import CLIP, Held, NotReady, PSError, Table, check_ids_given
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

__all__ = ["MODES", "Limits", "NotReady", "Shard", "check_ids_given", "save_shards"]


@dataclass(frozen=True)
class Limits:
    """What one request, or all waiting requests together, may cost a parameter server."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_new_rows: int = MAX_NEW_ROWS
    max_steps_ahead: int = MAX_STEPS_AHEAD
    max_buffered: int = MAX_BUFFERED
    max_parked: int = MAX_PARKED
    max_memory_bytes: int | None = None  # None: the memory available when the shard starts


def available_memory() -> int | None:
    """Bytes of memory this machine has available now (Linux's MemAvailable; None elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def start_bytes(spec: TableSpec) -> int:
    """Bytes a table allocates when its shard starts: a dense table's value and its optimizer
    state of the same shape (sparse tables start empty)."""
    if spec.kind != "dense":
        return 0
    whole = math.prod(max(int(d), 1) for d in spec.shape)
    state = (spec.optimizer.state or {}).values() if spec.optimizer is not None else ()
    arrays = 1 + sum(1 for st in state if math.prod(st.shape) == whole and whole > 1)
    return whole * np.dtype(spec.dtype).itemsize * arrays


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


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
        self.memory_cap = self.limits.max_memory_bytes or available_memory()
        self._check_start_memory(tables_of_shard(self.specs, shard, num_shards))
        self.tables: dict[str, Table] = {
            s.name: make_table(s, check_finite, f"{shard} of {num_shards}")
            for s in tables_of_shard(self.specs, shard, num_shards)
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
        self.clip_tables = clip.clipped_tables(self.tables, mode)
        self.held: dict[str, Held] = {}  # clipped table -> its step's gradient, awaiting the scale
        self.holds: dict[str, tuple[int, int, str]] = {}  # held -> (version, applied, holder): held_tables.py
        self.chains: dict[str, delta.Chain] = {}  # table -> its delta checkpoint chain (delta.py)

    def table(self, name: str) -> Table:
        try:
            return self.tables[name]
        except KeyError:
            raise PSError(
                f"unknown table {name!r} on shard {self.shard}; it holds {sorted(self.tables)}"
            ) from None

    def _check_start_memory(self, specs: list[TableSpec]) -> None:
        """PSError naming the largest table when this shard's tables cannot be allocated."""
        need = {s.name: start_bytes(s) for s in specs}
        if self.memory_cap is None or sum(need.values()) <= self.memory_cap:
            return
        big = max(need, key=need.get)
        where = (
            "max_memory_bytes" if self.limits.max_memory_bytes else "the memory this machine has available"
        )
        raise PSError(
            f"shard {self.shard} cannot start: its tables need {_gb(sum(need.values()))} (table {big!r} "
            f"{_gb(need[big])}: its value and optimizer state), more than {_gb(self.memory_cap)} ({where}); "
            "use more shards or smaller tables"
        )

    def _check_memory(self, t: Table, ids: np.ndarray, what: str) -> None:
        """PSError when the rows `ids` would create would take this shard's tables in RAM past
        `memory_cap` (a table on disk keeps its own RAM budget)."""
        if self.memory_cap is None or t.spec.kind != "sparse" or t.spec.storage == "disk":
            return
        per_row = t.dim * t.dtype.itemsize * (1 + len(t.state_slots)) + 16  # (+ the index's share)
        held = sum(x.memory_bytes() for x in self.tables.values() if x.spec.storage != "disk")
        if held + np.size(ids) * per_row <= self.memory_cap:
            return  # (even if every id were new)
        if (grow := t.new_rows(ids) * per_row) and held + grow > self.memory_cap:
            raise PSError(
                f"{what} of table {t.name!r} on shard {self.shard} refused: its new rows would take the "
                f"shard's tables to {_gb(held + grow)}, past max_memory_bytes={self.memory_cap} "
                f"({_gb(self.memory_cap)}); give the table a vocab, storage='disk' or more shards"
            )

    # -- pull / push ------------------------------------------------------------------------
    def check_not_held(self, name: str, what: str) -> None:
        """PSError for a push or (non-peek) pull of a table a trainer holds (held_tables.py)."""
        if name in self.holds:
            raise PSError(
                f"{what} of table {name!r} refused: the trainer that updates it holds it (a dense table "
                "only one trainer uses; runtime/ps/held_tables.py) until it writes it back at the end of "
                "the run"
            )

    def _check_new_rows(self, t: Table, ids: np.ndarray | None, what: str) -> None:
        """PSError when `ids` would create more than `max_new_rows` rows of an unbounded table, or
        take the shard past its memory cap."""
        if ids is not None:
            self._check_memory(t, ids, what)
        limit = self.limits.max_new_rows
        if not t.unbounded or ids is None or np.size(ids) <= limit:
            return  # (fewer ids than the limit cannot create more rows than it)
        if (new := t.new_rows(ids)) > limit:
            raise PSError(
                f"{what} of unbounded table {t.name!r} would create {new} rows in one request, "
                f"more than max_new_rows={limit}; send fewer new ids per request"
            )

    def _check_step(self, t: Table, step: int | None, what: str) -> None:
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
        (evaluation; `Table.peek`). `copy=False`: a dense table as a read-only view of its
        parameter, for a caller that copies it at once; sparse rows are always fresh arrays."""
        t = self.table(name)
        check_ids_given(t.spec.kind, name, ids, "pull")
        if peek:
            return t.peek(ids, copy=copy)
        self.check_not_held(name, "pull")
        self._check_step(t, step, "pull")
        if self.mode == "sync" and step is not None and self.version[name] < step and t.kernel is not None:
            raise NotReady(name, step)  # (a frozen table never changes: nothing to wait for)
        self._check_new_rows(t, ids, "pull")
        return t.pull(ids, copy=copy)

    def push(
        self,
        name: str,
        grad: np.ndarray,
        ids: np.ndarray | None = None,
        step: int | None = None,
        pusher: str = "0",
        show_click: np.ndarray | None = None,
    ) -> bool:
        """Apply or buffer one push; True when a step was applied (sync: parked pulls may go on).
        `show_click`: a sparse push's [n, 2] float32 (show, click) per id, added to the rows'
        statistics after the step is applied (runtime/ps/lifecycle.py)."""
        t = self.table(name)
        self.check_not_held(name, "push")
        check_ids_given(t.spec.kind, name, ids, "push")
        self._check_new_rows(t, ids, "push")
        shows = None if show_click is None else check_show_click(t, ids, show_click)
        if self.mode == "sync":
            return self._sync_push(t, grad, ids, step, str(pusher), shows)
        (t.add if self.mode == "geo" else t.push)(grad, ids)
        if shows is not None:
            t.add_show_click(*shows)
        self.applied[name] += 1
        return True

    def _sync_push(
        self,
        t: Table,
        grad: np.ndarray,
        ids: np.ndarray | None,
        step: int | None,
        pusher: str,
        shows: tuple | None = None,
    ) -> bool:
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
        grad, ids = t.check_push(grad, ids)
        got = self.pending[name].setdefault(step, {})
        if pusher in got:
            raise PSError(f"sync push to {name!r}: pusher {pusher!r} already pushed step {step}")
        got[pusher] = (grad, ids, shows)
        return self.advance(t)

    def advance(self, t: Table) -> bool:
        """Apply table t's complete sync steps in order (a clipped table's next one is held for its
        scale instead: runtime/ps/clip.py); True when a step was applied or held."""
        name, applied = t.name, False
        while (
            name not in self.held
            and len(self.pending[name].get(self.version[name], ())) >= self.expected[name]
        ):
            got = [p for _, p in sorted(self.pending[name].pop(self.version[name]).items())]
            parts, shows = [(g, i) for g, i, _ in got], [sc for *_, sc in got if sc is not None]
            if name in self.clip_tables:
                self.held[name] = Held(*t.sum_parts(parts, merge=True), len(parts), shows)
                return True
            t.push(*t.sum_parts(parts), checked=True)  # (each part was checked on arrival)
            for sc in shows:
                t.add_show_click(*sc)
            self.version[name] += 1
            self.applied[name] += len(parts)
            applied = True
        return applied

    def clip_sum_squares(self, step: int) -> float:
        """The sum of squares of this shard's held step-`step` gradients of its clipped tables
        (clip.py); NotReady until all of them hold that step."""
        if not self.clip_tables:
            return 0.0
        clip.check_step(self.version, self.clip_tables, step, self.limits.max_steps_ahead, "norm")
        if any(n not in self.held or self.version[n] != step for n in self.clip_tables):
            raise NotReady(CLIP, step)
        return sum(float(np.sum(np.square(h.grad))) for h in self.held.values())

    def clip_apply(self, step: int, scale: float) -> list[str]:
        """Apply the held gradients of `step` scaled by `scale` (clip.py); the tables applied (then
        the next complete steps of them are held in turn)."""
        scale = clip.check_scale(scale)
        if not self.clip_tables:
            return []
        clip.check_step(self.version, self.clip_tables, step, self.limits.max_steps_ahead, "apply")
        missing = sorted(n for n in self.clip_tables if n not in self.held or self.version[n] != step)
        if missing:
            raise PSError(
                f"apply for step {step}: tables {missing} do not hold that step's gradients yet "
                "(send norm first and wait for its answer); refused, nothing applied"
            )
        for name in sorted(self.clip_tables):
            h, t = self.held.pop(name), self.tables[name]
            t.push((h.grad * t.dtype.type(scale)).astype(t.dtype, copy=False), h.ids, checked=True)
            for sc in h.shows:
                t.add_show_click(*sc)
            self.version[name] += 1
            self.applied[name] += h.parts
        for name in sorted(self.clip_tables):
            self.advance(self.tables[name])
        return sorted(self.clip_tables)

    def assign(self, name: str, values: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Set values (imported weights); optimizer state and sync step counts are untouched."""
        self.table(name).assign(values, ids)  # (admin only: imports may be large)

    # -- feature lifecycle (runtime/ps/lifecycle.py) ----------------------------------------------
    def show_click(self, name: str, ids: np.ndarray, labels: np.ndarray) -> None:
        """Count a batch's shows and clicks on table `name`'s rows (`SparseTable.show_click`)."""
        self.table(name).show_click(ids, labels)

    def shrink(self) -> dict[str, int]:
        """A pass end: `shrink` every sparse table with a lifecycle; {table: rows removed}."""
        return {n: t.shrink() for n, t in self.tables.items() if getattr(t, "life", None) is not None}

    def table_stats(self) -> dict[str, dict]:
        """Per table: rows, memory bytes, applied sync steps and pushes, and a sparse table's
        counts since it was made (admitted, evicted by its lifecycle, spilled to disk)."""
        return {
            n: {
                "rows": len(t),
                "bytes": t.memory_bytes(),
                "version": self.version[n],
                "applied": self.applied[n],
                **(t.table_counts() if hasattr(t, "table_counts") else {}),
            }
            for n, t in self.tables.items()
        }

    def _mine(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` this shard holds."""
        return shard_of(ids, self.num_shards) == self.shard

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | Path) -> list[dict]:
        """Write this shard's table files into `path` (a staging directory of `checkpoint.begin`);
        their manifest entries. A sparse table with `delta_every` K > 1 saves only its rows changed
        since its previous save, K - 1 times out of K (runtime/ps/delta.py)."""
        index = {s.name: i for i, s in enumerate(self.specs)}
        return [e for n, t in self.tables.items() for e in self._save_table(Path(path), index[n], t)]

    def _save_table(self, path: Path, index: int, t: Table) -> list[dict]:
        n, version = t.name, self.version[t.name]
        chain = self.chains.get(n)
        if delta.uses_deltas(t) and chain is not None:
            if chain.deltas + 1 < t.spec.delta_every and delta.intact(chain):
                self.chains[n] = delta.save_delta(t, chain, path, index, self.shard, self.num_shards, version)
                return self.chains[n].entries
        if t.spec.storage == "disk":
            entries = [tiered.save_entry(t, path, index, self.shard, self.num_shards, version)]
        else:
            arrays = {**t.state_dict(), "version": np.array([version])}
            entries = [checkpoint.write_arrays(path, checkpoint.file_name(index, n, self.shard), n, arrays)]
        if delta.uses_deltas(t):
            t.mark(delta.MARK, replay_shrinks=True)
            self.chains[n] = delta.Chain(delta.target_of(path), entries, 0)
        return entries

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
            new = make_table(t.spec, self.check_finite, f"{self.shard} of {self.num_shards}")
            entries = [e for e in doc["files"] if e["table"] == name]
            if not entries:
                raise checkpoint.CheckpointError(f"checkpoint {str(path)!r} has no file for table {name!r}")
            for e in delta.ordered(entries):
                if "delta" in e:  # rows changed since the save before (delta.py)
                    version = delta.load_delta(new, Path(path), e, self._mine)
                    continue
                if e.get("store") == tiered.STORE:  # a tiered table's directory
                    version = tiered.load_entry(new, path, e, self.shard, self.num_shards)
                    continue
                arrays = checkpoint.read_arrays(path, e)
                _check_shapes(path, e, new, arrays)
                version = int(arrays.pop("version")[0])
                new.load_state(new.select_rows(arrays, self._mine))
            fresh[name] = (new, version)
        for name, (new, version) in fresh.items():
            self.close_table(name)
            self.tables[name], self.version[name] = new, version if step is None else step
            self.pending[name].clear()
            self.held.pop(name, None)
            self.chains.pop(name, None)
            self._continue_chain(Path(path), doc, new)

    def _continue_chain(self, path: Path, doc: dict, t: Table) -> None:
        """After loading checkpoint `path` saved by as many shards: the next save of a table with
        delta checkpoints goes on with the chain `path` ends (a delta of the rows changed since the
        load, linking this shard's files of `path`); another shard count: the next save is full."""
        if not delta.uses_deltas(t) or doc.get("num_shards") != self.num_shards:
            return
        index = next(i for i, s in enumerate(self.specs) if s.name == t.name)
        mine = checkpoint.file_name(index, t.name, self.shard).removesuffix(".npz") + "."
        entries = delta.ordered(
            [e for e in doc["files"] if e["table"] == t.name and e["file"].startswith(mine)]
        )
        if entries and "delta" not in entries[0]:
            t.mark(delta.MARK, replay_shrinks=True)
            self.chains[t.name] = delta.Chain(path, entries, max(e.get("delta", 0) for e in entries))

    def close_table(self, name: str) -> None:
        """Release a table's resources beyond RAM (a tiered table's engine files)."""
        close = getattr(self.tables[name], "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """Release every table's resources beyond RAM (a tiered table's engine files)."""
        for name in self.tables:
            self.close_table(name)


def _check_shapes(path: str | Path, entry: dict, t: Table, arrays: dict[str, np.ndarray]) -> None:
    """CheckpointError unless the file holds exactly the arrays table `t` needs, in its shapes."""
    want = {"version": (1,), **t.state_shapes(arrays)}
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


def check_show_click(t: Table, ids: np.ndarray | None, show_click: np.ndarray) -> tuple:
    """(distinct ids, shows, clicks) of a push's [n, 2] (show, click) per id (ids may repeat: summed);
    PSError naming the table when it keeps no statistics or the array is malformed."""
    if getattr(t, "life", None) is None:
        raise PSError(f"push to {t.name!r} carries show/click, but the table has no lifecycle to keep them")
    sc = np.asarray(show_click)
    n = np.asarray(ids).size
    if sc.dtype != np.float32 or sc.shape != (n, 2) or not np.isfinite(sc).all() or (sc < 0).any():
        raise PSError(
            f"push to {t.name!r}: show/click must be a finite, non-negative float32 array of shape "
            f"[{n}, 2] (one (show, click) per id), got {sc.dtype} {list(sc.shape)}"
        )
    uniq, inv = np.unique(t.check_ids(np.asarray(ids).reshape(-1)), return_inverse=True)
    inv = inv.reshape(-1)
    sums = [np.bincount(inv, sc[:, j], uniq.size).astype(np.float32) for j in (0, 1)]
    return uniq, sums[0], sums[1]
