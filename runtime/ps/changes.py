"""Rows changed since a mark: what a delta checkpoint (runtime/ps/delta.py) or a publisher of fresh
rows to serving reads off a sparse table.

A sparse table (`SparseTable`, `TieredSparseTable`) keeps one `Changes`. Any number of named marks
can be set; each collects, until it is set again, the ids of every row the table changed or
created (pushed, added, assigned, loaded; pulled too, which creates rows and moves admission /
eviction clocks) and of every row it dropped (lifecycle eviction, `shrink`). A row spilled to disk
by a tiered table is not a change. The API, on the table:

    table.mark("publish")                  # start (or restart) collecting under "publish"
    ...                                    # training
    rows = table.changed_since("publish")  # ChangedRows: ids (rows that now exist and changed),
    arrays = table.rows_of(rows.ids)       #   removed (ids without a row now); their values
    table.mark("publish")                  # and collect afresh

Without a mark nothing is recorded (no cost). Memory: one int64 per changed id and mark, merged
into a sorted distinct array whenever the log doubles.

A pass end of the feature lifecycle (`shrink`) changes every row (show / click decayed, one more
unseen pass). A mark set with `replay_shrinks=True` (the delta checkpoint chain's) does not list
those rows: it counts the pass ends instead (`ChangedRows.shrinks`), which whoever applies the
changes replays on the rows it holds before writing the changed ones (deterministic: the same
float32 operations on the same values); the rows a shrink removes are listed as removed either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.ps.index import unique_ids

_EMPTY = np.zeros(0, np.int64)
_MERGE_AT = 1 << 16  # ids logged before the first merge


@dataclass(frozen=True)
class ChangedRows:
    """Since a mark: `ids` of rows that exist now and changed (sorted, distinct), and `removed`, the
    ids that had a row (or may have had one) and have none now."""

    ids: np.ndarray
    removed: np.ndarray
    shrinks: int = 0  # pass ends since the mark, not listed in `ids` (a `replay_shrinks` mark)


class _Log:
    """Sorted distinct ids plus a tail of arrays not merged yet."""

    def __init__(self) -> None:
        self.done, self.tail, self.tail_size = _EMPTY, [], 0

    def add(self, ids: np.ndarray) -> None:
        if ids.size:
            self.tail.append(np.array(ids, np.int64).reshape(-1))
            self.tail_size += ids.size
            if self.tail_size > max(_MERGE_AT, self.done.size):
                self.merged()

    def merged(self) -> np.ndarray:
        if self.tail:
            self.done = unique_ids(np.concatenate([self.done, *self.tail]))
            self.tail, self.tail_size = [], 0
        return self.done


class Changes:
    """Ids changed and removed, per mark (see the module docstring)."""

    def __init__(self) -> None:
        self.marks: dict[str, tuple[_Log, _Log]] = {}
        self.shrinks: dict[str, int] = {}  # the marks that count pass ends instead of listing rows

    def mark(self, name: str, replay_shrinks: bool = False) -> None:
        self.marks[name] = (_Log(), _Log())
        self.shrinks.pop(name, None)
        if replay_shrinks:
            self.shrinks[name] = 0

    def unmark(self, name: str) -> None:
        self.marks.pop(name, None)
        self.shrinks.pop(name, None)

    def pass_end(self) -> None:
        """A shrink began: counted by the `replay_shrinks` marks."""
        for name in self.shrinks:
            self.shrinks[name] += 1

    def shrunk(self, ids: np.ndarray) -> None:
        """Rows a shrink changed (kept): listed by the marks that do not replay shrinks."""
        for name, (log, _) in self.marks.items():
            if name not in self.shrinks:
                log.add(ids)

    def changed(self, ids: np.ndarray) -> None:
        for log, _ in self.marks.values():
            log.add(ids)

    def removed(self, ids: np.ndarray) -> None:
        for _, log in self.marks.values():
            log.add(ids)

    def since(self, name: str, exists) -> ChangedRows:
        """What changed since mark `name`; `exists(ids)` tells which ids have a row now. KeyError
        naming the marks set when `name` is not one."""
        if name not in self.marks:
            raise KeyError(
                f"no mark {name!r} on this table (marks set: {sorted(self.marks)}); call mark first"
            )
        changed, removed = (log.merged() for log in self.marks[name])
        every = unique_ids(np.concatenate([changed, removed]))
        have = exists(every) if every.size else np.zeros(0, bool)
        return ChangedRows(every[have], every[~have], self.shrinks.get(name, 0))
