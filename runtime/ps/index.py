"""RowIndex: int64 id -> row slot of a sparse table, vectorised with sorted arrays.

Lookups are `np.searchsorted` over a large sorted array (`main`) and a small sorted one (`delta`)
that takes new ids; `delta` is merged into `main` once it outgrows an eighth of it, so an insert
costs O(len(delta)) and the merges O(1) amortised per id. No per-id Python work, no hash library,
and 16 bytes per id (key + slot), which keeps a 10M-row table near its raw size.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.empty(0, np.int64)
_MIN_DELTA = 4096


def _find(keys: np.ndarray, slots: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    if not keys.size:
        return
    pos = np.searchsorted(keys, ids)
    np.minimum(pos, keys.size - 1, out=pos)
    hit = keys[pos] == ids
    out[hit] = slots[pos[hit]]


class RowIndex:
    """Slots are handed out densely in order of first appearance: 0, 1, 2, ..."""

    def __init__(self) -> None:
        self.main_keys, self.main_slots = _EMPTY, _EMPTY
        self.delta_keys, self.delta_slots = _EMPTY, _EMPTY

    def __len__(self) -> int:
        return self.main_keys.size + self.delta_keys.size

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where absent."""
        out = np.full(ids.shape, -1, np.int64)
        _find(self.main_keys, self.main_slots, ids, out)
        if self.delta_keys.size:
            _find(self.delta_keys, self.delta_slots, ids, out)
        return out

    def find_or_add(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots of `ids`, the ids that were new (unique, sorted), their new slots)."""
        slots = self.find(ids)
        miss = slots < 0
        if not miss.any():
            return slots, _EMPTY, _EMPTY
        new_ids, inv = np.unique(ids[miss], return_inverse=True)
        new_slots = np.arange(len(self), len(self) + new_ids.size, dtype=np.int64)
        self._add(new_ids, new_slots)
        slots[miss] = new_slots[inv]
        return slots, new_ids, new_slots

    def _add(self, keys: np.ndarray, slots: np.ndarray) -> None:
        pos = np.searchsorted(self.delta_keys, keys)
        self.delta_keys = np.insert(self.delta_keys, pos, keys)
        self.delta_slots = np.insert(self.delta_slots, pos, slots)
        if self.delta_keys.size > max(_MIN_DELTA, self.main_keys.size >> 3):
            pos = np.searchsorted(self.main_keys, self.delta_keys)
            self.main_keys = np.insert(self.main_keys, pos, self.delta_keys)
            self.main_slots = np.insert(self.main_slots, pos, self.delta_slots)
            self.delta_keys, self.delta_slots = _EMPTY, _EMPTY

    def ids_by_slot(self) -> np.ndarray:
        """The id stored in each slot 0..len-1."""
        out = np.empty(len(self), np.int64)
        out[self.main_slots] = self.main_keys
        out[self.delta_slots] = self.delta_keys
        return out
