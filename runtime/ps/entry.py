"""Streaming sparse tables: feature admission and eviction (a sparse table spec's `entry` and
`evict_after` keys, set by `TranspileConfig.sparse_entry` / `evict_after`).

Hashed ids are unbounded; most are seen once or twice. Admission creates an id's row only once the
id earned it; eviction drops rows nobody touched for a while:

- `entry: {"type": "count", "threshold": k}`: an id gets a row at the push that brings its k-th
  sighting (Paddle's `CountFilterEntry`); `{"type": "probability", "p": p, "seed": s}`: each push
  that sees an id admits it with probability p, drawn from a hash of (seed, id, sighting) so the
  draw does not depend on shard count or arrival order (`ProbabilityEntry`). A sighting is one
  push that contains the id (repeats within one push count once). Until admitted, an id pulls a
  zero row and its gradients are dropped.
- `evict_after: T`: a row (and its optimizer state) that no pull or push touched in the last T
  pushes of the table (T steps in sync mode) is removed; touched again later it starts afresh
  from the initializer. Ids waiting for admission are forgotten after T pushes without a sighting.

The table's memory (`SparseTable.memory_bytes`) is in the server's `stats`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.ps.index import make_index
from transpiler.tables import TableSpec

ENTRY_TYPES = ("count", "probability")
# checkpoint arrays of a streaming table: the push clock, each row's last touch (per row), the ids
# waiting for admission with their sightings and last sighting (per waiting id)
ENTRY_CLOCK, ENTRY_LAST, WAITING = "EntryClock", "EntryLast", ("WaitIds", "WaitCount", "WaitSeen")


def check_entry(name: str, entry: Any, evict_after: Any) -> None:
    """ValueError naming the table when `entry` / `evict_after` are malformed."""
    if entry is not None:
        kind = entry.get("type") if isinstance(entry, dict) else None
        ok = (kind == "count" and isinstance(entry.get("threshold"), int) and entry["threshold"] >= 1) or (
            kind == "probability" and isinstance(entry.get("p"), (int, float)) and 0 < entry["p"] <= 1
        )
        if not ok:
            raise ValueError(
                f"table {name!r}: entry {entry!r} must be {{'type': 'count', 'threshold': k >= 1}} or "
                "{'type': 'probability', 'p': 0 < p <= 1, 'seed': s}"
            )
    if evict_after is not None and (not isinstance(evict_after, int) or evict_after < 1):
        raise ValueError(f"table {name!r}: evict_after must be a positive int (pushes), got {evict_after!r}")


def _draw(seed: int, ids: np.ndarray, sighting: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) numbers from (seed, id, sighting) (splitmix64 finalizer)."""
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= sighting.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(seed)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class Waiting:
    """Ids not admitted yet: their sightings and the push that last saw them."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.index = make_index(vocab)
        self.count = np.zeros(0, np.int64)
        self.seen = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def sight(self, ids: np.ndarray, clock: int) -> np.ndarray:
        """Count one sighting of each of the unique `ids`; their sighting numbers."""
        slots, _, _ = self.index.find_or_add(ids)
        n = len(self.index)
        if n > self.count.size:
            grow = max(n, self.count.size * 5 // 4 + 1024)
            self.count = np.concatenate([self.count, np.zeros(grow - self.count.size, np.int64)])
            self.seen = np.concatenate([self.seen, np.zeros(grow - self.seen.size, np.int64)])
        self.count[slots] += 1
        self.seen[slots] = clock
        return self.count[slots]

    def keep(self, mask: np.ndarray) -> None:
        """Keep the waiting ids whose slot is set in `mask` (length len(self))."""
        ids = self.index.ids_by_slot()[mask]
        count, seen = self.count[: mask.size][mask], self.seen[: mask.size][mask]
        self.index = make_index(self.vocab)
        slots, _, _ = self.index.find_or_add(ids)
        self.count = np.zeros(ids.size, np.int64)
        self.seen = np.zeros(ids.size, np.int64)
        self.count[slots], self.seen[slots] = count, seen

    def nbytes(self) -> int:
        return self.count.nbytes + self.seen.nbytes + self.index.nbytes()


class Entry:
    """Admission and eviction state of one sparse table (see the module docstring)."""

    def __init__(self, spec: TableSpec, vocab: int) -> None:
        self.rule = spec.entry
        self.evict_after = spec.evict_after
        self.clock = 0  # pushes applied
        self.last = np.zeros(0, np.int64)  # per row slot: the clock when it was last touched
        self.waiting = Waiting(vocab) if self.rule is not None else None

    def admitted(self, present: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Which of the unique `ids` (`present`: already have a row) have a row after this push's
        sighting."""
        if self.waiting is None:
            return np.ones(ids.size, bool)
        out = present.copy()
        new = ids[~present]
        if new.size:
            sighting = self.waiting.sight(new, self.clock)
            if self.rule["type"] == "count":
                ok = sighting >= self.rule["threshold"]
            else:
                ok = _draw(int(self.rule.get("seed", 0)), new, sighting) < self.rule["p"]
            out[~present] = ok
        return out

    def touch(self, slots: np.ndarray, rows: int) -> None:
        if self.last.size < rows:
            grow = max(rows, self.last.size * 5 // 4 + 1024)
            self.last = np.concatenate([self.last, np.full(grow - self.last.size, self.clock, np.int64)])
        self.last[slots] = self.clock

    def expired(self, rows: int) -> np.ndarray | None:
        """After a push: the mask of rows to keep, when some expired (None: keep all)."""
        self.clock += 1
        if self.evict_after is None or self.clock % max(1, self.evict_after // 4) != 0:
            return None
        if self.waiting is not None and len(self.waiting):
            n = len(self.waiting)
            self.waiting.keep(self.waiting.seen[:n] > self.clock - self.evict_after)
        keep = self.last[:rows] > self.clock - self.evict_after
        return None if keep.all() else keep

    def kept(self, keep: np.ndarray, slots: np.ndarray) -> None:
        """Rows were compacted: kept row i moved to slots[i]."""
        last = np.zeros(max(slots.size, 1), np.int64)
        last[slots] = self.last[: keep.size][keep]
        self.last = last

    def nbytes(self) -> int:
        return self.last.nbytes + (self.waiting.nbytes() if self.waiting is not None else 0)

    def state_dict(self, rows: int) -> dict[str, np.ndarray]:
        """What a checkpoint keeps (see ENTRY_CLOCK): `rows` rows' last touches."""
        self.touch(np.zeros(0, np.int64), rows)  # (rows never touched since a load: room for them)
        out = {ENTRY_CLOCK: np.array([self.clock]), ENTRY_LAST: self.last[:rows].copy()}
        if self.waiting is not None:
            m = len(self.waiting)
            out.update(
                zip(
                    WAITING,
                    (self.waiting.index.ids_by_slot(), self.waiting.count[:m], self.waiting.seen[:m]),
                    strict=True,
                )
            )
        return out

    def load_state(self, slots: np.ndarray, rows: int, arrays: dict[str, np.ndarray]) -> None:
        """Restore a checkpoint's state for rows now at `slots` (this shard's share of one file)."""
        self.load_clock(arrays)
        self.touch(np.zeros(0, np.int64), rows)
        self.last[slots] = arrays[ENTRY_LAST]

    def load_clock(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore a checkpoint's push clock and waiting ids (not the rows' last touches)."""
        self.clock = int(arrays[ENTRY_CLOCK][0])
        if self.waiting is not None and WAITING[0] in arrays:
            w = self.waiting
            ids, count, seen = (arrays[k] for k in WAITING)
            w.sight(ids, 0)  # makes their slots (and room); then the saved figures replace the sighting
            found = w.index.find(ids)
            w.count[found], w.seen[found] = count, seen
