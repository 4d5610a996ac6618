"""GeoTable: a trainer's local copy of one table in GEO mode.

The trainer updates its copy with the table's own optimizer at every step, without talking to the
servers; every k steps it pushes `local - base` for the rows it touched (the servers, in geo mode,
add it), pulls those rows back (now holding every trainer's deltas) and makes them its new base.
A row is pulled from the servers the first time the trainer needs it. Deltas, not values, travel,
so concurrent trainers never overwrite each other's updates.
"""

from __future__ import annotations

import numpy as np

from runtime.ps.client import PSClient
from runtime.ps.make import make_table
from runtime.ps.table import DenseTable, SparseTable
from runtime.ps.types import PSError


class GeoTable:
    def __init__(self, client: PSClient, table: str, k: int) -> None:
        if client.mode != "geo":
            raise PSError(f"GeoTable needs servers in geo mode, they run in {client.mode!r} mode")
        if k < 1:
            raise PSError(f"GeoTable {table!r}: push interval k must be >= 1, got {k}")
        self.client, self.name, self.k, self.steps = client, table, k, 0
        spec = client.specs[table]
        self.local: DenseTable | SparseTable = make_table(spec)  # type: ignore[assignment]
        self.sparse = spec.kind == "sparse"
        if self.sparse:
            self.base = make_table(spec)
            self.touched: list[np.ndarray] = []
        else:
            self.base = client.pull(table)
            self.local.assign(self.base)

    def _fetch(self, ids: np.ndarray) -> None:
        """Make sure rows `ids` are in the local copy, pulling the missing ones."""
        ids = self.local.check_ids(np.unique(np.asarray(ids).reshape(-1)))
        new = ids[self.local.index.find(ids) < 0]
        if new.size:
            rows = self.client.pull(self.name, new)
            self.local.assign(rows, new)
            self.base.assign(rows, new)

    def pull(self, ids: np.ndarray | None = None) -> np.ndarray:
        """The local value (dense) or local rows of `ids` (sparse, shape ids.shape + (dim,))."""
        if not self.sparse:
            return self.local.pull()
        self._fetch(ids)
        flat = np.asarray(ids).reshape(-1)
        return self.local.pull(flat).reshape(*np.shape(ids), self.local.dim)

    def push(self, grad: np.ndarray, ids: np.ndarray | None = None) -> None:
        """One local optimizer step; every k-th step also syncs with the servers."""
        if self.sparse:
            self._fetch(ids)
            self.local.push(grad, ids)
            self.touched.append(np.asarray(ids, dtype=np.int64).reshape(-1))
        else:
            self.local.push(grad)
        self.steps += 1
        if self.steps % self.k == 0:
            self.sync()

    def sync(self) -> None:
        """Push the accumulated delta of the touched rows; take back the merged values."""
        if not self.sparse:
            self.client.push(self.name, self.local.param - self.base)
            self.base = self.client.pull(self.name)
            self.local.assign(self.base)
            return
        if not self.touched:
            return
        ids = np.unique(np.concatenate(self.touched))
        self.touched = []
        self.client.push(self.name, self.local.pull(ids) - self.base.pull(ids), ids)
        rows = self.client.pull(self.name, ids)
        self.local.assign(rows, ids)
        self.base.assign(rows, ids)
