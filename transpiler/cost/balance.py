"""One shard balancer for dense tables, shared by the transpiler (`insert_ps` writes each table's
shard into the plan) and the parameter-server runtime (`runtime.ps.sharding.place_dense`).

Tables are balanced by bytes, not elements: a shard's load is the memory it holds and the bytes it
sends and receives per pull and push, both proportional to bytes (a float64 table weighs twice a
float32 table of the same shape).
"""

from __future__ import annotations

import numpy as np


def table_bytes(shape: list[int] | tuple[int, ...] | None, dtype: str) -> int:
    """Bytes of a table of `shape` (an unknown -1 dim counts as 1) and `dtype`."""
    n = 1
    for d in shape or ():
        n *= max(int(d), 1)
    return n * np.dtype(dtype).itemsize


def balance(sizes: dict[str, int], num_shards: int, placed: dict[str, int] | None = None) -> dict[str, int]:
    """{table name: shard}: the `placed` tables stay where they are; the others go largest first
    (ties: by name) onto the least-loaded shard (ties: the lowest index)."""
    out = dict(placed or {})
    load = [0] * num_shards
    for name, k in out.items():
        if not 0 <= k < num_shards:
            raise ValueError(f"table {name!r} is placed on shard {k}, but there are {num_shards} shards")
        load[k] += sizes[name]
    for name in sorted((n for n in sizes if n not in out), key=lambda n: (-sizes[n], n)):
        k = min(range(num_shards), key=lambda i: (load[i], i))
        out[name] = k
        load[k] += sizes[name]
    return out
