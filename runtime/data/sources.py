"""What a reader trainer reads: a stream of global batches, and its rows of each.

Step t trains on global batch t, exactly the batch single-process training would take at step t.
Each of the N reader trainers keeps a contiguous block of rows of it (`share`) and splits that into
micro-batches (`split`), so N readers with M micro-batches train on the same examples as one process.

A data source is either
- a generator object with `batch(i, n)` (e.g. `SyntheticCTR`): global batch t = `batch(t, batch_size)`,
  endless; or
- a re-iterable of feed dicts {name: array with a leading example axis} (a list, `ArrayReader`,
  `CriteoReader`): one pass is one epoch. Every reader iterates it (a file is parsed by each reader;
  parse it once into arrays and use `ArrayReader` when that is costly); or
- a sharded source with `shard(index, count)` (`runtime.data.open_dataset`): each reader reads only
  its shard, and global batch t is the readers' local batches t together (runtime/data/files/dataset.py
  states the semantics); its `prepare(count)` runs once in the driver (`prepare`).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np


def check_source(data: Any, batch_size: int | None, epochs: int | None) -> None:
    """Raise ValueError / TypeError when `data` cannot be read by trainer processes as asked."""
    if hasattr(data, "batch") and callable(data.batch):
        if not batch_size:
            raise ValueError(f"data {type(data).__name__} makes batches on demand: pass batch_size=N")
        if epochs is not None:
            raise ValueError(
                f"data {type(data).__name__} is endless, so epochs={epochs} never ends; "
                "use steps= or until_loss="
            )
        return
    if not hasattr(data, "__iter__"):
        raise TypeError(
            f"data must have batch(i, n) or be a re-iterable of feed dicts, got {type(data).__name__}"
        )
    if iter(data) is data:
        raise TypeError(
            f"data is a one-shot iterator ({type(data).__name__}); every reader trainer and "
            "every epoch iterates it anew: pass a list of feed dicts or a reader object"
        )
    if batch_size is not None:
        raise ValueError(
            "batch_size= applies to generated data (an object with batch(i, n)); an "
            "iterable of feed dicts brings its own batch size"
        )


def global_batches(
    data: Any, batch_size: int | None, epochs: int | None, start: int = 0
) -> Iterator[dict[str, Any]]:
    """Global batches in step order from step `start` (a resumed run): endless for generated data,
    `epochs` passes (None: endless) for an iterable source (whose first `start` batches are read
    and skipped)."""
    if hasattr(data, "batch") and callable(data.batch):
        for t in itertools.count(start):
            yield data.batch(t, batch_size)
        return
    passes = (b for _ in (range(epochs) if epochs is not None else itertools.count()) for b in data)
    yield from itertools.islice(passes, start, None)


def is_sharded(data: Any) -> bool:
    return callable(getattr(data, "shard", None)) and callable(getattr(data, "prepare", None))


def prepare(data: Any, readers: int, program: Any) -> None:
    """Work a sharded source does once in the driver for `readers` readers (e.g. its shard plan),
    before the source is copied to the reader trainers, and its check that it makes the feeds of
    the readers' `program`; nothing for other sources."""
    if is_sharded(data):
        data.prepare(readers)
        data.check_feeds({n: program.var(n).shape for n in program.attrs.get("feeds", [])})


def reader_batches(
    data: Any, batch_size: int | None, epochs: int | None, index: int, count: int, start: int = 0
) -> Iterator[tuple[dict[str, Any], int, int, int]]:
    """What reader `index` of `count` trains on, step after step from step `start`: (batch, global
    batch size g, lo, hi): rows [lo, hi) of `batch`, its share of a global batch of g examples."""
    if not is_sharded(data):
        for batch in global_batches(data, batch_size, epochs, start):
            n = batch_size_of(batch)
            yield (batch, n, *share(n, index, count))
        return
    shard = data.shard(index, count)
    passes = (b for _ in (range(epochs) if epochs is not None else itertools.count()) for b in shard)
    for local, g in itertools.islice(passes, start, None):
        yield local, g, 0, batch_size_of(local)


def share(n: int, index: int, count: int) -> tuple[int, int]:
    """Rows [lo, hi) of a batch of n that reader `index` of `count` takes."""
    return n * index // count, n * (index + 1) // count


def split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) in `parts` near-equal contiguous pieces, empty ones dropped."""
    bounds = [lo + (hi - lo) * k // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def batch_size_of(feed: dict[str, Any]) -> int:
    """The number of examples of a feed dict (its arrays must agree)."""
    sizes = {k: len(v) for k, v in feed.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"feed arrays disagree on the number of examples: {sizes}")
    return next(iter(sizes.values()))


_INT64_MAX = np.iinfo(np.int64).max


def check_values(
    feed: dict[str, Any], names: list[str], lo: int, hi: int, step: int, id_bits: Collection[str] = ()
) -> None:
    """ValueError naming the feed, the step and a row when rows [lo, hi) of a float feed of `names`
    hold NaN or Inf, or an unsigned one holds a value an int64 id cannot (>= 2^63, shown unsigned)
    — except the feeds `id_bits`, ids of unbounded tables only, where every 64-bit pattern is an id.
    The reader checks its share of each batch here, before it becomes work items."""
    for n in names:
        a = feed.get(n)
        if not isinstance(a, np.ndarray):
            continue
        part = a[lo:hi]
        if part.dtype.kind == "f":
            bad = ~np.isfinite(part)
        elif part.dtype.kind == "u" and part.dtype.itemsize == 8 and n not in id_bits:
            bad = part > _INT64_MAX
        else:
            continue
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            what = "NaN or Inf" if part.dtype.kind == "f" else "values above 2^63 - 1 (ids are int64)"
            raise ValueError(
                f"feed {n!r} in the batch of step {step} holds {what}: {int(bad.sum())} of them, "
                f"the first in row {lo + row} of the batch, e.g. {part[bad].reshape(-1)[:5].tolist()}"
            )


def rows(
    feed: dict[str, Any], names: list[str], lo: int, hi: int, id_bits: Collection[str] = ()
) -> dict[str, np.ndarray]:
    """Rows [lo, hi) of the arrays `names` of `feed` (views, no copies); a uint64 feed of `id_bits`
    (ids of unbounded tables) as its int64 bits, the form tables keep 64-bit ids in."""
    missing = [n for n in names if n not in feed]
    if missing:
        raise KeyError(f"a data batch lacks the feeds {missing}; it has {sorted(feed)}")
    out = {n: np.asarray(feed[n])[lo:hi] for n in names}
    for n in id_bits:
        if n in out and out[n].dtype == np.uint64:
            out[n] = out[n].view(np.int64)
    return out
