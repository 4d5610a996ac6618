"""A reader's one sort of a step's ids of a feed (`StepSort`): made for the step's row prefetch,
it also answers each item's `unique_ids` and merges the step's row gradients for the push; and which
feeds and tables a reader prefetches rows for (`sparse_feeds`, `feed_of_table`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ops_registry.base import RowMerge
from transpiler.ir import Program
from transpiler.tables import TableSpec


@dataclass
class StepSort:
    """The one sort of a step's lookups of a feed (its items' ids, concatenated in `spans` order),
    made for the step's row prefetch and reused to sum the step's row gradients for the push."""

    merge: RowMerge
    rows: np.ndarray  # the items' ids, concatenated in `spans` order (what `merge` sorted)
    spans: dict[tuple[int, int, int], tuple[int, int]]  # item key -> its ids' [lo, hi) in `rows`

    @staticmethod
    def of(items: list[Any], feed: str) -> StepSort:
        """The sort of the items' ids of `feed` (each item's `feed[feed]`, in items order)."""
        parts = [np.ravel(it.feed[feed]) for it in items]
        rows = np.concatenate(parts)
        ends = np.cumsum([p.size for p in parts]).tolist()
        spans = {it.key: (e - p.size, e) for it, p, e in zip(items, parts, ends, strict=True)}
        return StepSort(RowMerge.of(np, rows), rows, spans)

    def unique_ids(self, key: tuple[int, int, int], ids: Any) -> dict[str, Any] | None:
        """`unique_ids` of item `key`'s ids from this sort (`RowMerge.part`: no sort of its own; the
        sort itself when the item is the whole step); None when `ids` are not that item's ids."""
        span = self.spans.get(key)
        if span is None or not np.array_equal(np.ravel(ids), self.rows[span[0] : span[1]]):
            return None
        part = self.merge.part(np, self.rows, *span)
        return {"Unique": part.unique_rows, "Index": part.inverse(np).reshape(np.shape(ids))}


def feed_of_table(sparse_feeds: list[tuple[str, str, str]]) -> dict[str, str]:
    """table -> the feed whose unique ids its rows are pulled for (tables pulled for one feed only)."""
    feeds: dict[str, set[str]] = {}
    for table, _, x in sparse_feeds:
        feeds.setdefault(table, set()).add(x)
    return {table: xs.pop() for table, xs in feeds.items() if len(xs) == 1}


def sparse_feeds(program: Program, feeds: list[str]) -> list[tuple[str, str, str]]:
    """(table, unique ids, feed) of each sparse pull of `unique_ids(feed)`: rows a reader prefetches."""
    made = {n: op for op in program.ops for n in op.output_names()}
    return [
        (op.attrs["table"], u, made[u].inputs["Ids"][0])
        for op in program.ops
        if op.type == "pull_sparse"
        and (u := op.inputs["Ids"][0]) in made
        and made[u].type == "unique_ids"
        and made[u].outputs["Unique"] == [u]
        and made[u].inputs["Ids"][0] in feeds
    ]


def id_bit_feeds(program: Program, tables: list[TableSpec]) -> list[str]:
    """The feeds of `program` read only by `unique_ids` ops whose unique ids go only to the pulls and
    pushes of unbounded sparse tables: any 64-bit pattern is an id there, so a uint64 feed of them
    may hold values >= 2^63 (the reader passes them on as int64 bits: `sources.id_bits`)."""
    unbounded = {t.name for t in tables if t.kind == "sparse" and t.shape[0] < 0}
    readers: dict[str, list] = {}
    for op in program.ops:
        for n in op.input_names():
            readers.setdefault(n, []).append(op)

    def to_unbounded(op: Any) -> bool:
        uniq = op.outputs.get("Unique", [])
        return (
            op.type == "unique_ids"
            and bool(uniq)
            and all(
                r.type in ("pull_sparse", "push_sparse") and r.attrs.get("table") in unbounded
                for u in uniq
                for r in readers.get(u, [])
            )
        )

    feeds = program.attrs.get("feeds") or []
    return [x for x in feeds if readers.get(x) and all(to_unbounded(op) for op in readers[x])]
