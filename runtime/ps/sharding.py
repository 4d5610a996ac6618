"""Which shard holds what: sparse ids by hash, whole dense tables balanced by size.

Both are pure functions of (ids or specs, shard count), so clients, servers and checkpoint loaders
agree without talking to each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard index of each id: Fibonacci hashing, so strided or clustered ids still spread evenly."""
    with np.errstate(over="ignore"):
        h = np.asarray(ids).astype(np.uint64) * _GOLDEN
    return ((h >> np.uint64(32)) % np.uint64(num_shards)).astype(np.int64)


def place_dense(specs: list[dict[str, Any]], num_shards: int) -> dict[str, int]:
    """{dense table name: shard}. A spec's `sharding["shard"]` (the transpiler's choice) is kept;
    the others go largest first onto the least-loaded shard (ties: lowest index)."""
    dense = [s for s in specs if s["kind"] == "dense"]
    size = {s["name"]: int(np.prod(s["shape"])) * np.dtype(s.get("dtype", "float32")).itemsize
            for s in dense}
    load = [0] * num_shards
    out = {}
    for s in dense:
        k = (s.get("sharding") or {}).get("shard")
        if k is not None:
            if not 0 <= k < num_shards:
                raise ValueError(f"table {s['name']!r} is placed on shard {k}, but there are "
                                 f"{num_shards} shards")
            out[s["name"]] = k
            load[k] += size[s["name"]]
    for name in sorted((n for n in size if n not in out), key=lambda n: (-size[n], n)):
        k = min(range(num_shards), key=lambda i: (load[i], i))
        out[name] = k
        load[k] += size[name]
    return out


def tables_of_shard(specs: list[dict[str, Any]], shard: int, num_shards: int) -> list[dict[str, Any]]:
    """The specs shard `shard` serves: every sparse table (its share of ids) and its dense tables."""
    dense = place_dense(specs, num_shards)
    return [s for s in specs if s["kind"] == "sparse" or dense[s["name"]] == shard]
