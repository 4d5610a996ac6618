"""Which shard holds what: sparse ids by hash, whole dense tables balanced by size.

Both are pure functions of (ids or specs, shard count), so clients, servers and checkpoint loaders
agree without talking to each other.
"""

from __future__ import annotations

import numpy as np

from transpiler.cost.balance import balance, table_bytes
from transpiler.tables import TableSpec

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard index of each id: Fibonacci hashing, so strided or clustered ids still spread evenly."""
    with np.errstate(over="ignore"):
        h = np.asarray(ids).astype(np.uint64) * _GOLDEN
    return ((h >> np.uint64(32)) % np.uint64(num_shards)).astype(np.int64)


def place_dense(specs: list[TableSpec], num_shards: int) -> dict[str, int]:
    """{dense table name: shard}. A spec's `sharding.shard` (the transpiler's choice) is kept;
    the others are balanced by bytes (`transpiler.cost.balance.balance`, the transpiler's own rule)."""
    dense = [s for s in specs if s.kind == "dense"]
    sizes = {s.name: table_bytes(s.shape, s.dtype) for s in dense}
    placed = {s.name: s.sharding.shard if s.sharding else None for s in dense}
    return balance(sizes, num_shards, {n: k for n, k in placed.items() if k is not None})


def tables_of_shard(specs: list[TableSpec], shard: int, num_shards: int) -> list[TableSpec]:
    """The specs shard `shard` serves: every sparse table (its share of ids) and its dense tables."""
    dense = place_dense(specs, num_shards)
    return [s for s in specs if s.kind == "sparse" or dense[s.name] == shard]
