"""How a `PSClient` pull of many tables is put together: several pulls of one table merged into
one (a shard refuses a request naming a table twice), and the rows of every pull reassembled
from its shards' replies."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

ALL = slice(None)  # a shard's positions when one shard holds every id (`PSClient._split`)


def assemble(plans: list, got: list[np.ndarray]) -> list[np.ndarray]:
    """The pulls' results from their parts' reply arrays (`PSClient._pull_parts`' plans)."""
    out = []
    for spec, shape, n, inv, where in plans:
        if shape is None:
            out.append(got[where[0][0]])
            continue
        if len(where) == 1 and where[0][1] is ALL and got[where[0][0]].flags.writeable:
            rows = got[where[0][0]]  # one shard's reply, already a fresh array: no copy
        else:
            rows = np.empty((n, spec.shape[1]), spec.dtype)
            for i, p in where:
                rows[p] = got[i]
        out.append((rows if inv is None else rows[inv]).reshape(*shape, spec.shape[1]))
    return out


def one_pull_per_table(
    requests: Sequence[tuple[str, np.ndarray | None]],
) -> tuple[list[tuple[str, np.ndarray | None]], Callable[[list], list]]:
    """Pulls of the same table (e.g. one embedding looked up by several slots) merged into one
    (their ids concatenated; a shard refuses a request naming a table twice), and the function that
    splits the merged results back into one per request, in order."""
    by_table: dict[str, list[int]] = {}
    for i, (table, _) in enumerate(requests):
        by_table.setdefault(table, []).append(i)
    if len(by_table) == len(requests):
        return list(requests), lambda got: got
    merged: list[tuple[str, np.ndarray | None]] = []
    pieces: list = [None] * len(requests)  # (merged index, rows slice or None for dense, ids' shape)
    for table, idx in by_table.items():
        ids = [requests[i][1] for i in idx]
        if ids[0] is None:  # dense: one pull serves them all
            for i in idx:
                pieces[i] = (len(merged), None, None)
            merged.append((table, None))
            continue
        flat = [np.asarray(x).reshape(-1) for x in ids]
        start = 0
        for i, x, f in zip(idx, ids, flat, strict=True):
            pieces[i] = (len(merged), slice(start, start + f.size), np.shape(x))
            start += f.size
        merged.append((table, np.concatenate(flat)))

    def split(got: list) -> list:
        out = []
        for k, rows, shape in pieces:
            r = got[k]
            out.append(r if rows is None else r.reshape(-1, r.shape[-1])[rows].reshape(*shape, r.shape[-1]))
        return out

    return merged, split
