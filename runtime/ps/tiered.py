"""Tiered sparse tables: rows on disk (RocksDB, `runtime.ps.tiered_store`) under a RAM tier of hot
rows bounded by a memory budget (a sparse `TableSpec` with `storage="disk"`, `memory_budget`).

`TieredSparseTable` is a `SparseTable` whose RAM arrays hold only the hot rows. It keeps the RAM
table's methods and signatures (pull, peek, push, add, assign, state_dict, load_state,
memory_bytes, len) and its arithmetic: updates run the same optimizer kernels (`SparseTable.push`)
on the same RAM arrays and rows are created from the same per-id initializer, so a pull/push
sequence gives exactly the RAM table's values whatever the budget.

- Engine files: one fresh directory per table, `hetps-<table>.<pid>@<host>.<random>` (under
  `store_dir` when given, else the system's temporary directory, `TMPDIR`), removed by `close` and
  at interpreter exit; one left by a killed process is removed by the next table made beside it
  (`remove_stale_engines`). Engine errors (a full disk, a corrupt file) are PSErrors naming the
  table, its shard and the store's path.
- A request (pull, push, add, assign) looks its ids up in RAM; the misses go to disk in one
  multi-get; rows found there are promoted into RAM, the others created from the initializer.
- Eviction (`policy`): each request stamps its rows with an eviction key (one int64 per slot,
  `_stamp`): "lfu" (default) the row's hit count since it entered RAM (requests that used it,
  halved every `age_every` requests: LFU with aging) then the request counter, "lru" the request
  counter alone. When a request's new rows (promoted or created) would take the RAM tier past
  `max_rows`, the rows of the smallest keys (lfu: the fewest hits, ties the least recent) not in
  the request are first written back in one WriteBatch until 90% of `max_rows` remain with
  the new rows in (eviction amortised over ~10% of the budget). Eviction is in place: the RAM
  arrays keep their capacity (`max_rows` rows) and the surviving rows of the last slots move into
  the freed ones (`_evict`: no whole-tier copy). The budget is split (`BudgetSplit`): RocksDB's
  block cache (1/32, holding the SST index and filter blocks too) and two memtables (1/32 each:
  `tiered_store.EngineMemory`); the direct id index of a known vocab (`DirectIndex`, 4 bytes per
  possible id) when it fits in 1/8 of the budget, else the sorted index (16 bytes per resident
  row); `max_rows` = the rest // bytes per resident row (record + eviction key + index entry).
  Outside the budget: the transient arrays of the request being served and the engine's fixed
  overhead (open-file table readers, thread stacks).
- A request with more distinct rows than `max_rows` is refused (PSError naming table and budget).
- Admission / eviction by pushes (`entry`, `evict_after`, runtime/ps/entry.py) as on a RAM table:
  each row's push clock of its last touch (EntryLast, int64) is part of its disk record (and of
  the RAM tier's rows, 8 bytes more per resident row); admission and pulls first promote the
  request's rows found on disk (they exist); each expiry sweep (every evict_after // 4 pushes)
  removes the expired RAM rows and then reads the rows only on disk, BATCH_ROWS at a time,
  deleting the expired ones (a sweep costs a read of the whole store). The ids waiting for
  admission stay in RAM, outside the budget (`Waiting`; forgotten after evict_after pushes
  unseen). The push clock and waiting ids go into a saved directory's `extras.npz`.
- The feature lifecycle (`lifecycle`: passes unseen, show/click; runtime/ps/lifecycle.py): its
  per-row fields are part of each disk record, and `shrink` goes over the disk rows in batches.
  Rows changed since a mark and delta checkpoints: runtime/ps/delta.py.

`save(dir)` writes the RAM rows to disk, then saves a RocksDB checkpoint (hard links: no row goes
through Python) and `meta.json` atomically; `load(dir)` links a saved directory into a fresh engine.
In a shard checkpoint (`runtime.ps.checkpoint`) a tiered table is the directory
`NNN-<table>.shard<k>.tiered` (`save_entry`); `load_entry` links it back with as many shards, or
streams it in batches into any sparse table with another shard count.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from shutil import rmtree

import numpy as np

from runtime.ps import checkpoint
from runtime.ps.entry import ENTRY_CLOCK, ENTRY_LAST
from runtime.ps.index import DIRECT_MAX, make_index, unique_ids
from runtime.ps.lifecycle import shrink as _shrink
from runtime.ps.sharding import shard_of
from runtime.ps.table import PSError, SparseTable
from runtime.ps.tiered_store import (
    BATCH_ROWS,
    EngineMemory,
    RowStore,
    batches,
    open_copy,
    parse_bytes,
    read_extras,
    read_meta,
    save_dir,
)
from runtime.ps.tiered_store import record_dtype as _record_dtype
from transpiler.tables import TableSpec

EVICT_TO = 0.9  # an eviction leaves this share of max_rows resident
POLICIES = ("lfu", "lru")  # eviction victims: fewest hits (then least recent), or least recent
AGE_EVERY = 256  # "lfu": the resident rows' hit counts are halved every this many requests
TICK_BITS = 40  # a slot's eviction key: (hits << TICK_BITS) | the request that last used it
TICK_MASK = (1 << TICK_BITS) - 1
HITS_MAX = (1 << (63 - TICK_BITS)) - 1  # (the key stays a non-negative int64)
STORE = "tiered"  # a checkpoint manifest entry's "store" for a tiered table's directory


@dataclass
class TierStats:
    """Counters since the table was made: ids looked up by requests (repeats counted) and those
    found in RAM; rows promoted from disk, created, evicted."""

    lookups: int = 0
    ram_hits: int = 0
    disk_hits: int = 0
    created: int = 0
    evicted: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of looked-up ids found in RAM (1.0 before any lookup)."""
        return self.ram_hits / self.lookups if self.lookups else 1.0


@dataclass(frozen=True)
class BudgetSplit:
    """How a table's memory budget is spent: RocksDB's block cache and memtables (`engine`), the
    direct id index (4 bytes per possible id; 0 when the table uses the sorted index, whose 16
    bytes per resident row are part of `row_bytes`), and the RAM tier: `max_rows` rows of
    `row_bytes` (record, eviction key, index entry) in the rest."""

    budget: int
    engine: EngineMemory
    direct_index: int
    row_bytes: int

    @classmethod
    def of(cls, budget: int, vocab: int, row_bytes: int) -> BudgetSplit:
        """The split for a vocab (< 0: unbounded) and rows of `row_bytes` without their index entry.
        A direct index only when it fits in 1/8 of the budget (DIRECT_MAX ids at most)."""
        engine = EngineMemory.of_budget(budget)
        direct = 4 * vocab if 0 < vocab <= DIRECT_MAX and 4 * vocab <= budget // 8 else 0
        return cls(budget, engine, direct, row_bytes + (0 if direct else 16))

    @property
    def ram_tier(self) -> int:
        """Bytes left for the RAM tier's rows."""
        return max(0, self.budget - self.engine.nbytes - self.direct_index)

    @property
    def max_rows(self) -> int:
        return self.ram_tier // self.row_bytes


def _row_bytes(table: SparseTable) -> int:
    """Bytes of one resident row of sparse `table` tiered, but its id index entry: the disk record,
    the eviction key (int64) and, with admission/eviction, the RAM copy of its EntryLast (int64)."""
    record = _record_dtype(table.dtype, table.dim, layout(table)["fields"])
    return record.itemsize + 8 + (8 if table.entry is not None else 0)


def budget_for_rows(spec: TableSpec, rows: int) -> int:
    """A memory_budget (bytes) whose RAM tier holds `rows` rows of the sparse table `spec` (its
    storage ignored), RocksDB's share and the id index included (`BudgetSplit`): the fixed point
    budget = engine + index + rows x row bytes (exactly `rows` rows while the engine's share is at
    its floor, budgets under 8 MiB)."""
    vocab, per_row = spec.shape[0], _row_bytes(SparseTable(replace(spec, storage="memory")))
    budget = rows * per_row
    while True:
        split = BudgetSplit.of(budget, vocab, per_row)
        need = split.engine.nbytes + split.direct_index + rows * split.row_bytes
        if need <= budget:
            return budget
        budget = need


class TieredSparseTable(SparseTable):
    """A sparse table whose rows live in RocksDB under a RAM tier of at most `max_rows` hot rows (see
    the module docstring). `memory_budget` (bytes or "4GiB"), `policy` and `age_every` default to
    the spec's (`memory_budget`, `tier_policy`, `tier_age_every`)."""

    def __init__(
        self,
        spec: TableSpec,
        check_finite: bool = True,
        *,
        memory_budget: int | str | None = None,
        store_dir: str | os.PathLike | None = None,
        shard: str | None = None,
        policy: str | None = None,
        age_every: int | None = None,
    ) -> None:
        if spec.kind != "sparse":
            raise PSError(f"table {spec.name!r}: storage 'disk' is for sparse tables, got kind {spec.kind!r}")
        super().__init__(spec, check_finite)
        budget = memory_budget if memory_budget is not None else self.spec.memory_budget
        if budget is None:
            raise PSError(f"table {self.name!r}: storage 'disk' needs a memory_budget (bytes or '4GiB')")
        try:
            self.budget = parse_bytes(budget)
        except ValueError as e:
            raise PSError(f"table {self.name!r}: {e}") from None
        self.record = _record_dtype(self.dtype, self.dim, layout(self)["fields"])
        self.split = BudgetSplit.of(self.budget, self.vocab, _row_bytes(self))
        self.direct_max = self.vocab if self.split.direct_index else 0
        self.row_bytes = self.split.row_bytes
        self.max_rows = self.split.max_rows
        if self.max_rows < 1:
            raise PSError(
                f"table {self.name!r}: memory_budget {self.budget} bytes holds no row: RocksDB takes "
                f"{self.split.engine.nbytes} bytes of it, the id index {self.split.direct_index}, "
                f"a row {self.row_bytes}; raise memory_budget"
            )
        policy = policy or spec.tier_policy or "lfu"  # (the keywords, else the spec's, else LFU)
        if age_every is None:
            age_every = spec.tier_age_every if spec.tier_age_every is not None else AGE_EVERY
        if policy not in POLICIES or not isinstance(age_every, int) or age_every < 1:
            raise PSError(
                f"table {spec.name!r}: eviction policy {policy!r}, age_every {age_every}: give a "
                f"policy of {POLICIES} and age_every >= 1 (requests between halvings of hit counts)"
            )
        self.policy, self.age_every = policy, int(age_every)
        self.tick, self.cold = 0, 0  # requests served; rows on disk and not in RAM
        self.stats = TierStats()
        self._empty_ram()
        self.what = f"tiered table {self.name!r}" + (f" on shard {shard}" if shard else "")
        self.path = engine_dir(self.name, store_dir)
        self._cleanup = weakref.finalize(self, rmtree, str(self.path), ignore_errors=True)
        self.store = RowStore(self.path / "rows", self.record, self.what, memory=self.split.engine)

    def _empty_ram(self) -> None:
        """No resident row; room for max_rows (the arrays' pages are touched only when used)."""
        self.index = make_index(self.vocab, self.direct_max)
        SparseTable._keep(self, np.zeros(0, bool), room=self.row_room())
        self.used = np.zeros(self.rows.shape[0], np.int64)  # per RAM slot: its eviction key (`_stamp`)
        if self.entry is not None:
            self.entry.last = np.zeros(0, np.int64)

    def row_room(self) -> int:
        return min(self.vocab, self.max_rows) if self.vocab > 0 else self.max_rows

    # -- the RAM tier --------------------------------------------------------------------------
    def slots(self, ids: np.ndarray, init: bool = True) -> np.ndarray:
        """RAM slots of `ids`: rows found on disk are promoted first, the rest created as in
        `SparseTable.slots`; every row of the request is stamped as just used."""
        if ids.size > self.max_rows and unique_ids(ids).size > self.max_rows:
            raise PSError(
                f"{self.what}: one request touches {unique_ids(ids).size} distinct rows, more "
                f"than memory_budget {self.budget} bytes holds ({self.max_rows} rows of "
                f"{self.row_bytes} bytes); raise memory_budget or send smaller requests"
            )
        missed, promoted, found = self._promote(ids)
        if found is None:  # (an eviction moved rows: look them all up again)
            out = SparseTable.slots(self, ids, init)
        else:  # only the ids that were not in RAM are looked up again
            out, miss = found, found < 0
            if miss.any():
                out[miss] = SparseTable.slots(self, ids[miss], init)
            if self.changes.marks and not miss.all():
                self.changes.changed(ids[~miss])
        self.stats.created += missed - promoted
        self._stamp(out)
        return out

    def _promote(self, ids: np.ndarray, count: bool = True) -> tuple[int, int, np.ndarray | None]:
        """Move the rows of `ids` found on disk (not in RAM) into RAM, creating none; (distinct ids
        not in RAM, rows promoted, the RAM slots of `ids` before, -1 where not in RAM: None when
        an eviction made room and moved rows). `count`: as the lookups of a request (`stats`)."""
        found = self.index.find(ids)
        if count:
            self.stats.lookups += ids.size
            self.stats.ram_hits += int(np.count_nonzero(found >= 0))
        miss = unique_ids(ids[found < 0])
        if self._make_room(found, miss.size):
            found = None
        if not (miss.size and self.cold):
            return miss.size, 0, found
        on_disk, rec = self.store.get(miss)
        if rec.size:
            slots = SparseTable.slots(self, miss[on_disk], init=False)
            self.rows[slots] = rec["Param"]
            for s, a in self.row_state.items():
                a[slots] = rec[s]
            if self.entry is not None:
                self.entry.touch(np.zeros(0, np.int64), len(self.index))
                self.entry.last[slots] = rec[ENTRY_LAST]
            self.cold -= rec.size
        self.stats.disk_hits += rec.size if count else 0
        return miss.size, rec.size, found

    def _stamp(self, slots: np.ndarray) -> None:
        """RAM rows `slots` were just used (one more request served): each slot's eviction key
        becomes (hits << TICK_BITS) | tick, hits counting the requests that used the row since it
        entered RAM ("lfu": +1 per request, at most HITS_MAX, halved every `age_every` requests;
        "lru": always 0), tick this request's number. The smallest keys are the victims."""
        self.tick += 1
        self._stamp_room()
        if self.policy == "lru":
            self.used[slots] = self.tick
            return
        hits = np.minimum((self.used[slots] >> TICK_BITS) + 1, HITS_MAX)
        self.used[slots] = (hits << TICK_BITS) | (self.tick & TICK_MASK)
        if self.tick % self.age_every == 0:
            u = self.used[: len(self.index)]
            u[...] = ((u >> (TICK_BITS + 1)) << TICK_BITS) | (u & TICK_MASK)

    def _stamp_room(self) -> None:
        """An eviction key for every RAM slot (the row arrays may have grown)."""
        if self.used.size < self.rows.shape[0]:
            self.used = np.concatenate([self.used, np.zeros(self.rows.shape[0] - self.used.size, np.int64)])

    def _records(self, slots: np.ndarray) -> np.ndarray:
        """RAM rows `slots` with their optimizer state, as disk records."""
        rec = np.empty(slots.size, self.record)
        rec["Param"] = self.rows[slots]
        for s, a in self.row_state.items():
            rec[s] = a[slots]
        if self.entry is not None:
            self.entry.touch(np.zeros(0, np.int64), len(self.index))
            rec[ENTRY_LAST] = self.entry.last[slots]
        return rec

    def _make_room(self, found: np.ndarray, new: int) -> bool:
        """Before `new` rows of a request enter RAM (`found`: the request's slots, -1 where not in
        RAM): when they would take it past max_rows, write the rows of the smallest eviction keys
        (`_stamp`: "lfu" the fewest hits, then the least recently used; "lru" the least recently
        used) that are not the request's to disk in one WriteBatch and drop them from RAM in place (`_evict`),
        down to 90% of max_rows with the new rows in (or as low as the request's rows allow). So
        the RAM tier never holds more than max_rows rows, nor its arrays more capacity. Whether it
        evicted."""
        n = len(self.index)
        if n + new <= self.max_rows:
            return False
        self._stamp_room()
        hit = found[found >= 0]
        key = self.used[:n].copy()
        key[hit] = np.iinfo(np.int64).max  # (the request's rows are never victims)
        k = n + new - int(self.max_rows * EVICT_TO)
        if k > n - hit.size:
            k = min(k, n - unique_ids(hit).size)
        victims = np.argpartition(key, k - 1)[:k]
        ids = self.index.ids_by_slot()
        self.store.put(ids[victims], self._records(victims))
        self._evict(victims, ids)
        self.cold += k
        self.stats.evicted += k
        return True

    def _keep(self, keep: np.ndarray, room: int = 0) -> None:
        """Drop the RAM rows whose slot is unset in `keep` (slots past its end stay), in place
        (`_evict`); the arrays keep their capacity (`room` is not needed)."""
        self._evict(np.flatnonzero(~keep[: len(self.index)]), self.index.ids_by_slot())

    def _evict(self, gone: np.ndarray, ids: np.ndarray) -> None:
        """Drop the RAM rows of the distinct slots `gone` in place (`ids`: the id of each slot): the
        surviving rows of the last len(gone) slots move into the freed slots below them, with their
        optimizer state, eviction key and EntryLast, so the slots stay dense (0 .. n - 1) and an
        eviction copies at most as many rows as it drops, never the whole tier."""
        n, k = len(self.index), gone.size
        if not k:
            return
        tail = np.ones(k, bool)
        tail[gone[gone >= n - k] - (n - k)] = False
        holes, movers = gone[gone < n - k], n - k + np.flatnonzero(tail)
        self.index.relocate(ids[gone], ids[movers], holes)
        self._stamp_room()
        per_slot = [self.rows, *self.row_state.values(), self.used]
        if self.entry is not None:
            self.entry.touch(np.zeros(0, np.int64), n)
            per_slot.append(self.entry.last)
        for a in per_slot:
            a[holes] = a[movers]
        self.used[n - k : n] = 0  # (freed slots: a row entering one starts with no hits)

    def __len__(self) -> int:
        return len(self.index) + self.cold

    def resident(self) -> int:
        """Rows in the RAM tier."""
        return len(self.index)

    def memory_bytes(self) -> int:
        """Bytes of the RAM tier: rows and optimizer state (allocated capacity), eviction keys, the id
        index (RocksDB's caches are not counted)."""
        return super().memory_bytes() + self.used.nbytes

    def engine_bytes(self) -> int:
        """Bytes RocksDB holds now in its block cache and memtables (at most `split.engine.nbytes`)."""
        return self.store.engine_bytes()

    def disk_bytes(self) -> int:
        return self.store.disk_bytes()

    # -- the table interface -------------------------------------------------------------------
    def pull(self, ids: np.ndarray | None = None, *, copy: bool = True) -> np.ndarray:
        if self._admits(ids):  # only rows that exist answer: bring those on disk into RAM first
            ids = self.check_ids(ids)
            self._promote(ids)
            found = self.index.find(ids)
            self._stamp(found[found >= 0])
        return super().pull(ids, copy=copy)

    def _admits(self, ids: np.ndarray | None) -> bool:
        """Admission is on (rows exist only once admitted: runtime/ps/entry.py) and `ids` given."""
        return ids is not None and self.entry is not None and self.entry.waiting is not None

    def peek(self, ids: np.ndarray | None = None, *, copy: bool = True) -> np.ndarray:
        """As `SparseTable.peek`: rows from RAM or disk, promoting, creating and stamping nothing."""
        self._ids(ids, "pull")
        ids = self.check_ids(ids)
        found = self.index.find(ids)
        have = found >= 0
        out = np.zeros((ids.size, self.dim), self.dtype)
        out[have] = self.rows.take(found[have], axis=0)
        rest = np.flatnonzero(~have)
        if rest.size and self.cold:
            uniq, inv = np.unique(ids[rest], return_inverse=True)
            on_disk, rec = self.store.get(uniq)
            pos = np.full(uniq.size, -1)
            pos[on_disk] = np.arange(rec.size)
            where = pos[inv.ravel()]
            out[rest[where >= 0]] = rec["Param"][where[where >= 0]]
            rest = rest[where < 0]
        if rest.size:
            out[rest] = super().peek(ids[rest])  # none is in RAM: the initializer's rows
        return out

    def push(self, grad: np.ndarray, ids: np.ndarray, *, checked: bool = False) -> None:
        if self._admits(ids):  # admission asks which rows exist: those on disk too
            self._promote(self.check_ids(np.asarray(ids).reshape(-1)), count=False)
        super().push(grad, ids, checked=checked)
        self._expire_cold()

    def _expire_cold(self) -> None:
        """After a push that expired RAM rows (`Entry.expired`: every evict_after // 4 pushes), remove
        the rows only on disk whose last touch is as old (EntryLast <= clock - evict_after), reading
        the store BATCH_ROWS rows at a time."""
        e = self.entry
        if e is None or e.evict_after is None or e.clock % max(1, e.evict_after // 4) or not self.cold:
            return
        for ids, rec in self._cold_batches():
            gone = ids[rec[ENTRY_LAST] <= e.clock - e.evict_after]
            if gone.size:
                self.store.delete(gone)
                if self.changes.marks:
                    self.changes.removed(gone)
                self.cold -= gone.size
                self.counts["evicted"] += gone.size

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every row, RAM and disk, as `SparseTable.state_dict` gives them (in id order). This holds
        the whole table in RAM: a table larger than memory is saved with `save`."""
        self.flush()
        parts = list(self.store.items())
        ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        rec = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, self.record)
        return {"ids": ids, **{f: rec[f] for f in self.record.names}, **self.scalars, **self._entry_state()}

    def _entry_state(self) -> dict[str, np.ndarray]:
        """The admission / eviction state that is not per row: the push clock, the waiting ids."""
        if self.entry is None:
            return {}
        return {k: v for k, v in self.entry.state_dict(0).items() if k != ENTRY_LAST}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Set rows `arrays["ids"]` (distinct, with their optimizer state) and the scalar state: rows
        resident in RAM are replaced there, the others written straight to disk, BATCH_ROWS rows per
        WriteBatch."""
        ids = self.check_ids(arrays["ids"])
        if self.changes.marks:
            self.changes.changed(ids)
        for s in self.scalars:
            self.scalars[s][...] = arrays[s]
        arrays = self._with_entry(arrays, ids.size)
        found = self.index.find(ids)
        ram = np.flatnonzero(found >= 0)
        self.rows[found[ram]] = arrays["Param"][ram]
        for s, a in self.row_state.items():
            a[found[ram]] = arrays[s][ram]
        if self.entry is not None:
            self.entry.last[found[ram]] = arrays[ENTRY_LAST][ram]
        rest = np.flatnonzero(found < 0)
        for lo in range(0, rest.size, BATCH_ROWS):
            part = rest[lo : lo + BATCH_ROWS]
            rec = np.empty(part.size, self.record)
            for f in self.record.names:
                rec[f] = arrays[f][part]
            new = part.size - self._stored(ids[part])
            self.store.put(ids[part], rec)
            self.cold += new

    def _with_entry(self, arrays: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        """`arrays` to load, after restoring the push clock and waiting ids they carry (ENTRY_CLOCK);
        rows without their EntryLast (a checkpoint made without admission / eviction) get the clock."""
        if self.entry is None:
            return arrays
        if ENTRY_CLOCK in arrays:
            self.entry.load_clock(arrays)
        self.entry.touch(np.zeros(0, np.int64), len(self.index))
        if ENTRY_LAST not in arrays:
            arrays = {**arrays, ENTRY_LAST: np.full(n, self.entry.clock, np.int64)}
        return arrays

    def _stored(self, ids: np.ndarray) -> int:
        """How many of the distinct, non-resident `ids` have a row on disk: 0 without a seek
        beyond one when no stored key lies between their least and greatest (a fill of new ids),
        else one multi-get."""
        if not self.cold or not ids.size:
            return 0
        keys = ids.view(np.uint64)
        if not self.store.any_in(int(keys.min()), int(keys.max())):
            return 0
        return int(self.store.get(ids)[0].sum())

    # -- rows changed since a mark, delta checkpoints (SparseTable's API over both tiers) ----------
    def ids(self) -> np.ndarray:
        """The ids of every row, RAM and disk (sorted), read from the store BATCH_ROWS at a time."""
        parts = [self.index.ids_by_slot(), *(ids for ids, _ in self.store.items())]
        return unique_ids(np.concatenate(parts))

    def exists(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        out = self.index.find(ids) >= 0
        if self.cold and (~out).any():
            out[~out] = self.store.get(ids[~out])[0]
        return out

    def rows_of(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `ids` (distinct, existing) from RAM or disk, promoting nothing."""
        ids = np.asarray(ids, np.int64)
        found = self.index.find(ids)
        rec = np.empty(ids.size, self.record)
        rec[found >= 0] = self._records(found[found >= 0])
        cold = np.flatnonzero(found < 0)
        if cold.size:
            on_disk, got = self.store.get(ids[cold])
            if not on_disk.all():
                raise PSError(
                    f"table {self.name!r}: rows_of ids {self.shown(ids[cold][~on_disk][:5])} have no row"
                )
            rec[cold] = got
        return {"ids": ids, **{f: rec[f] for f in self.record.names}, **self.scalars, **self._entry_state()}

    def remove(self, ids: np.ndarray) -> None:
        """Drop the rows of `ids` from RAM and disk."""
        ids = unique_ids(np.asarray(ids, np.int64))
        if not ids.size:
            return
        if self.changes.marks:
            self.changes.removed(ids)
        found = self.index.find(ids)
        if (found >= 0).any():
            self._evict(found[found >= 0], self.index.ids_by_slot())
        rest = ids[found < 0]
        if rest.size and self.cold:
            self.cold -= int(self.store.get(rest)[0].sum())
        self.store.delete(ids)  # (a resident row may have an older copy on disk too)

    # -- feature lifecycle over both tiers ----------------------------------------------------
    def shrink(self, which: Callable[[np.ndarray], np.ndarray] | None = None) -> int:
        """`SparseTable.shrink` over the RAM rows, then over the rows only on disk, BATCH_ROWS at a
        time (each batch's survivors written back and the others deleted in one WriteBatch each);
        `which(ids)`: only those rows."""
        gone = super().shrink(which)
        if not self.cold:
            return gone
        for ids, rec in self._cold_batches():  # (the iterator reads a snapshot: writes do not disturb it)
            if which is not None:
                sel = which(ids)
                ids, rec = ids[sel], rec[sel]
            rec = rec.copy()
            keep = _shrink(self.life, rec["Show"], rec["Click"], rec["Unseen"])
            self.store.put(ids[keep], rec[keep])
            self.store.delete(ids[~keep])
            if self.changes.marks:
                self.changes.shrunk(ids[keep])
                self.changes.removed(ids[~keep])
            dropped = int(ids.size - np.count_nonzero(keep))
            self.cold -= dropped
            self.counts["evicted"] += dropped
            gone += dropped
        return gone

    def _cold_batches(self):
        """(ids, records) of the rows only on disk (copies on disk of resident rows skipped)."""
        for ids, rec in self.store.items():
            cold = self.index.find(ids) < 0
            if cold.any():
                yield ids[cold], rec[cold]

    def _drop(self, keep: np.ndarray) -> None:
        """`SparseTable._drop` of RAM rows, and of their older copies on disk."""
        self.store.delete(self.index.ids_by_slot()[: keep.size][~keep])
        super()._drop(keep)

    def table_counts(self) -> dict[str, int]:
        """As `SparseTable.table_counts`; admitted: rows created (not promoted from disk)."""
        return {**super().table_counts(), "admitted": self.stats.created, "spilled": self.stats.evicted}

    # -- engine files --------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every RAM row to disk (they stay resident; `cold` counts the rows only on disk)."""
        self.store.put(self.index.ids_by_slot(), self._records(np.arange(len(self.index))))
        self.store.flush()

    def save(self, path: str | os.PathLike) -> None:
        """Write the table to directory `path` atomically: a RocksDB checkpoint (`rows/`, hard links)
        and `meta.json` (layout, row count, scalar state)."""
        self.flush()
        scalars = {s: a.tolist() for s, a in self.scalars.items()}
        meta = {"table": self.name, **layout(self), "rows": len(self), "scalars": scalars}
        save_dir(path, self.store, meta, self._entry_state())

    def load(self, path: str | os.PathLike) -> None:
        """Replace every row and the scalar state by those of saved directory `path` (`save`)."""
        meta = read_meta(path)
        check_layout(self, path, meta)
        fresh = open_copy(
            Path(path),
            self.path / f"rows.{uuid.uuid4().hex}",
            self.record,
            self.store.what,
            self.split.engine,
        )
        old, self.store = self.store, fresh
        old.close()
        rmtree(old.path, ignore_errors=True)
        self._empty_ram()
        self.cold = int(meta["rows"])
        for s in self.scalars:
            self.scalars[s][...] = meta["scalars"][s]
        if self.entry is not None and (extras := read_extras(path, meta)):
            self.entry.load_clock(extras)

    def close(self) -> None:
        """Close the engine and remove its files (saved directories stay)."""
        if self._cleanup.alive:
            try:
                self.store.close()
            except Exception:  # noqa: BLE001 (a full disk fails the last flush: the files go anyway)
                pass
            self._cleanup()


def engine_dir(table: str, store_dir: str | os.PathLike | None) -> Path:
    """A fresh engine directory `hetps-<table>.<pid>@<host>.<random>` under `store_dir` (default:
    the system's temporary directory), after removing those beside it left by processes of this
    host that are gone (killed before `close` ran: the janitor, `remove_stale_engines`)."""
    parent = Path(store_dir if store_dir is not None else tempfile.gettempdir())
    remove_stale_engines(parent)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", table)
    return Path(tempfile.mkdtemp(prefix=f"hetps-{name}.{os.getpid()}@{checkpoint.host()}.", dir=parent))


_ENGINE = re.compile(r"hetps-.+\.(\d+)@([A-Za-z0-9_.-]+)\.[a-z0-9_]{8}")


def remove_stale_engines(parent: str | os.PathLike) -> list[Path]:
    """Remove the engine directories in `parent` whose process (named in the directory's name) ran
    on this host and is gone; those of live processes, other hosts, or not so named stay. The
    removed paths."""
    gone, host = [], checkpoint.host()
    for p in Path(parent).glob("hetps-*"):
        m = _ENGINE.fullmatch(p.name)
        if (
            m
            and p.is_dir()
            and not p.is_symlink()
            and m.group(2) == host
            and not checkpoint.alive(int(m.group(1)))
        ):
            rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def save_entry(
    table: TieredSparseTable, path: str | os.PathLike, index: int, shard: int, num_shards: int, version: int
) -> dict:
    """Save `table` (table number `index` of shard `shard` of `num_shards`) into the checkpoint
    directory `path` being written (`runtime.ps.checkpoint`); its manifest entry."""
    name = checkpoint.file_name(index, table.name, shard).removesuffix(".npz") + ".tiered"
    table.save(Path(path) / name)
    return {
        "table": table.name,
        "file": name,
        "store": STORE,
        "rows": len(table),
        "shard": shard,
        "num_shards": num_shards,
        "version": int(version),
    }


def layout(table: SparseTable) -> dict:
    """What a saved directory's rows must match to load into `table`."""
    return {
        "dim": table.dim,
        "dtype": table.dtype.name,
        "fields": [
            "Param",
            *table.state_slots,
            *table.life_slots,
            *([ENTRY_LAST] if table.entry is not None else []),
        ],
    }


def check_layout(table: SparseTable, path: str | os.PathLike, meta: dict) -> None:
    """PSError unless saved directory `path` (its `meta`) holds rows of `table`'s layout."""
    want, got = layout(table), {k: meta.get(k) for k in layout(table)}
    if got != want:
        raise PSError(f"table {table.name!r}: saved directory {str(path)!r} has rows {got}, the table {want}")


def load_entry(table: SparseTable, path: str | os.PathLike, entry: dict, shard: int, num_shards: int) -> int:
    """Load the rows of manifest entry `entry` (a tiered table's directory in checkpoint `path`) that
    belong to shard `shard` of `num_shards` into sparse `table` (tiered or in RAM); the entry's
    version. A tiered table saved by the same shard of as many shards is linked in whole (`load`)."""
    where = Path(path) / entry["file"]
    if entry.get("num_shards") == num_shards:
        if entry.get("shard") == shard and isinstance(table, TieredSparseTable):
            table.load(where)
        elif entry.get("shard") == shard:
            for arrays in batches(where, lambda meta: check_layout(table, where, meta)):
                table.load_state(arrays)
        return int(entry["version"])  # (another shard's directory of as many shards: none of its rows)
    for arrays in batches(where, lambda meta: check_layout(table, where, meta)):  # (waiting ids too)
        table.load_state(table.select_rows(arrays, lambda ids: shard_of(ids, num_shards) == shard))
    return int(entry["version"])
