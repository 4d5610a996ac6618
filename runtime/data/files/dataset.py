"""`open_dataset`: files + a schema -> a re-iterable source of feed dicts, sharded among readers.

Sync semantics with N reader trainers: the files are cut into N shards (`formats.plan`: byte
ranges of plain text aligned to line starts, whole .gz files, Parquet row groups); reader i reads
only its shard, in local batches of `share(batch_size, i, N)` rows (the last one shorter), and
global batch t is the readers' local batches t together. An epoch lasts as many steps as the
largest shard needs; a reader whose shard is done adds no rows to the last steps. Each shard's
row count is known before training (newlines counted, Parquet metadata), so every reader knows
every step's global batch size. For a given N and file list this is deterministic; with N = 1 it
is the plain iteration `for feed in dataset` (what `train` reads in one process, and what
`evaluate` / `predict` code iterates).

Parsing runs on a background thread (pyarrow and the compiled hash release the GIL), `prefetch`
batches ahead of the trainer. `shuffle=K` permutes consecutive windows of K rows (rounded up to
whole local batches) with a seed of (seed, epoch, reader).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from ops_registry.errors import ConfigError
from runtime.data.files import formats
from runtime.data.files.schema import Schema, numeric_values

T = TypeVar("T")


def open_dataset(
    paths: str | Path | list,
    schema: str | Path | dict | Schema,
    batch_size: int,
    format: str | None = None,
    shuffle: int = 0,
    seed: int = 0,
    prefetch: int = 2,
    check: bool = False,
) -> Dataset:
    """A `Dataset` of the files named by `paths` (files, directories, globs), read by `schema` (a
    YAML file, a dict or a `Schema`) in batches of `batch_size` (the global batch size).

    `format`: one of `formats.FORMATS`; None guesses it from the first file's suffix. A schema
    that standardizes a dense column without `stats` gets them from one pass over the data here
    (the files parsed once, nothing hashed; give the training data's: a schema with `stats`, e.g.
    the `features.json` a trained model carries, is used as it is). That pass, or `check=True`,
    also counts the missing values each column's policy fills (`Dataset.filled`) and raises a
    ConfigError naming the file, row and column of a value no policy fills, before any training.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    files = formats.expand(paths)
    fmt = format or formats.guess_format(files[0])
    if fmt not in formats.FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {formats.FORMATS}")
    schema = Schema.load(schema)
    names = formats.CRITEO_COLUMNS if fmt == "criteo" else formats.header(files[0], fmt)
    other = next((f for f in files[1:] if fmt in ("csv", "tsv") and formats.header(f, fmt) != names), None)
    if other is not None:
        raise ValueError(
            f"{other} has the columns {formats.header(other, fmt)}, {files[0]} has {names}: "
            "the files of one dataset need the same header"
        )
    missing = [c for c in schema.columns if names is not None and c not in names]
    if missing:
        raise ValueError(f"the schema reads columns {missing} that {files[0]} lacks; its columns: {names}")
    ds = Dataset(files, fmt, schema, batch_size, names, shuffle, seed, prefetch)
    if schema.needs_stats() or check:
        stats, ds.filled = ds.fit(schema.needs_stats())
        ds.schema = schema.with_stats(stats) if stats else schema
    return ds


@dataclass
class Dataset:
    """Feed dicts of `batch_size` rows from files; see the module docstring and `open_dataset`."""

    files: list[str]
    format: str
    schema: Schema
    batch_size: int
    names: list[str] | None = None  # text column names (None: Parquet's, or slot keys)
    shuffle: int = 0
    seed: int = 0
    prefetch: int = 2
    filled: dict[str, int] | None = None  # missing values filled per column (None: not counted)
    _plans: dict[int, list[list[formats.Piece]]] = field(default_factory=dict, repr=False)
    _epochs: int = field(default=0, repr=False)
    _template: dict[str, np.ndarray] | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        shard = FileShard(self, 0, 1, self._epochs)
        self._epochs += 1
        for feed, _ in shard:
            yield feed

    def plan(self, readers: int) -> list[list[formats.Piece]]:
        """Each of `readers` readers' pieces (counted once per reader count, then cached)."""
        if readers not in self._plans:
            self._plans[readers] = formats.plan(self.files, self.format, readers)
        return self._plans[readers]

    def prepare(self, readers: int) -> None:
        """What `train` has the driver do once, before the dataset is copied to `readers` reader
        trainers: count each shard's rows and read the feeds' widths."""
        self.shard(0, readers)
        self.plan(readers)
        self._empty()

    def check_feeds(self, wanted: dict[str, tuple | list | None]) -> None:
        """ValueError unless the dataset makes every feed a program reads ({name: shape with -1 for
        the example axis}), each of that shape."""
        have = self.feed_shapes()
        missing = sorted(n for n in wanted if n not in have)
        if missing:
            raise ValueError(
                f"the program reads the feeds {missing}, which the schema does not make; it makes "
                f"{sorted(have)} (label, dense, sparse, and one per multi-valued column)"
            )
        for n, shape in wanted.items():
            if shape is not None and any(w not in (-1, h) for w, h in zip(shape[1:], have[n], strict=False)):
                raise ValueError(
                    f"feed {n!r}: the program takes {list(shape)}, the data gives "
                    f"[n, {', '.join(map(str, have[n]))}]; match the model to the schema"
                )

    def rows(self) -> int:
        return sum(p.rows for p in self.plan(1)[0])

    def shard(self, index: int, count: int) -> FileShard:
        """What reader `index` of `count` reads: an iterable of (local feed, global batch size)."""
        if not 0 <= index < count:
            raise ValueError(f"reader {index} of {count}: expected 0 <= index < count")
        if self.batch_size < count:
            raise ValueError(
                f"batch_size {self.batch_size} is smaller than the {count} reader trainers: "
                "each reader needs at least one row per step"
            )
        return FileShard(self, index, count)

    def feed_shapes(self) -> dict[str, tuple[int, ...]]:
        """{feed: shape of one example} (the dense width of list columns is read off the data)."""
        return {k: v.shape[1:] for k, v in self._empty().items()}

    # -- internals ----------------------------------------------------------------------------
    def _types(self, columns: list[str]) -> dict[str, pa.DataType]:
        return column_types(self.schema, columns)

    def _chunks(
        self, pieces: list[formats.Piece], columns: list[str]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, {column: values}) of the pieces' rows, a block at a time; `where` names the file
        and the block's rows (`_where`)."""
        types = self._types(columns)
        for p in pieces:
            got = 0
            for cols in formats.read_piece(p, self.format, self.names, types, self.batch_size):
                n = len(next(iter(cols.values())))
                yield self._where(p, got, n), cols
                got += n
            if got != p.rows:
                raise ValueError(
                    f"{p.path} (bytes / row groups {p.start}..{p.stop}): counted {p.rows} rows "
                    f"but read {got}; blank lines or quoted newlines in a text file break the "
                    "line-aligned split: remove them"
                )

    def _where(self, p: formats.Piece, got: int, n: int) -> str:
        """The file of piece `p` and the rows got + 1 .. got + n of the piece (a file's data rows
        when the piece starts the file)."""
        rows = f"data rows {got + 1}..{got + n}"
        if p.start == 0:
            return f"{p.path} ({rows})"
        start = f"row group {p.start}" if self.format == "parquet" else f"the first line after byte {p.start}"
        return f"{p.path} ({rows} counted from {start})"

    def _empty(self) -> dict[str, np.ndarray]:
        """A feed of no rows (what a reader whose shard is done adds to a step)."""
        if self._template is None:
            first = next((p for p in self.plan(1)[0] if p.rows), None)
            if first is None:
                raise ValueError(f"{self.files}: no rows to read")
            if first.stop > first.start + (1 << 16) and self.format != "parquet":  # its first 64 KiB will do
                head = formats.Piece(first.path, first.start, first.start + (1 << 16), 0)
                first = head if formats.count_rows(head.path, head.start, head.stop, self.format) else first
            types = self._types(self.schema.columns)
            cols = next(formats.read_piece(first, self.format, self.names, types, 1))
            feed = self.schema.feeds({c: a.slice(0, 1) for c, a in cols.items()})
            self._template = {k: v[:0] for k, v in feed.items()}
        return self._template

    def _batches(
        self, pieces: list[formats.Piece], size: int, seed: tuple
    ) -> Iterator[dict[str, np.ndarray]]:
        """Feeds of `size` rows (the last one shorter) of the pieces' rows; with a shuffle, each
        run of `window` rows (the shuffle's rows rounded up to whole batches) permuted."""
        rng = np.random.default_rng(seed) if self.shuffle else None
        window = -(-self.shuffle // size) * size if self.shuffle else size
        pending: list[dict[str, np.ndarray]] = []
        have = 0
        for where, cols in self._chunks(pieces, self.schema.columns):
            try:
                feed = self.schema.feeds(cols)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            pending.append(feed)
            have += len(feed["label"])
            while have >= window:
                part, pending = _split(pending, window)
                have -= window
                yield from _emit(part, size, rng)
        if have:
            yield from _emit(pending, size, rng)

    def with_schema(self, schema: Schema) -> Dataset:
        """The same files read by `schema` (e.g. the fitted one a trained model carries)."""
        return Dataset(self.files, self.format, schema, self.batch_size, self.names, self.shuffle, self.seed)

    def fit(self, columns: list[str]) -> tuple[dict[str, tuple[float, float]], dict[str, int]]:
        """One pass over every row: ({column: (mean, std)} of the numeric `columns`, missing values
        counted as their fill value; {column: missing values filled}). A missing value that a
        column's policy does not fill, or a label or dense value that is not a number, is a
        ConfigError naming the file, its rows and the column."""
        acc = {c: np.zeros(3) for c in columns}
        single = [self.schema.label, *self.schema.dense, *self.schema.sparse]  # (an empty bag is a value)
        filled = dict.fromkeys(single, 0)
        for where, cols in self._chunks(self.plan(1)[0], self.schema.columns):
            try:
                for c in single:
                    self._check_missing(cols[c], c, filled)
                for c in columns:
                    x = numeric_values(cols[c], c, float(self.schema.fill(c)))
                    acc[c] += (x.size, x.sum(), (x * x).sum())
                numeric_values(cols[self.schema.label], self.schema.label)
            except ValueError as e:
                raise type(e)(f"{where}: {e}") from None
        return self._stats(acc), {c: n for c, n in filled.items() if n}

    def values_of(self, column: str) -> pa.Array:
        """The distinct values of a categorical `column` over all rows (missing ones left out)."""
        import pyarrow.compute as pc

        seen = [pc.unique(cols[column].drop_null()) for _, cols in self._chunks(self.plan(1)[0], [column])]
        return pc.unique(pa.concat_arrays([pa.array(s, pa.string()) for s in seen])) if seen else pa.array([])

    def _check_missing(self, col, name: str, filled: dict[str, int]) -> None:
        if col.null_count and self.schema.fill(name) == "error":
            from runtime.data.files.schema import missing_error

            raise ConfigError(missing_error(col, name))
        filled[name] += col.null_count

    def measure(self, columns: list[str]) -> dict[str, tuple[float, float]]:
        """{column: (mean, std)} of numeric columns over all rows (missing values count as 0)."""
        acc = {c: np.zeros(3) for c in columns}
        for _, cols in self._chunks(self.plan(1)[0], columns):
            for c in columns:
                x = numeric_values(cols[c], c)
                acc[c] += (x.size, x.sum(), (x * x).sum())
        return self._stats(acc)

    @staticmethod
    def _stats(acc: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
        out = {}
        for c, (n, s, ss) in acc.items():
            mean = s / max(n, 1)
            out[c] = (float(mean), float(np.sqrt(max(ss / max(n, 1) - mean * mean, 0.0))))
        return out


def column_types(schema: Schema, columns: list[str]) -> dict[str, pa.DataType]:
    """The arrow type each of `columns` is read as: text for categoricals (hashed from the text),
    float64 for the label and dense columns."""
    text = {*schema.sparse, *dict(schema.multi)}
    return {c: pa.string() if c in text else pa.float64() for c in columns}


def _split(feeds: list[dict[str, np.ndarray]], rows: int) -> tuple[list[dict], list[dict]]:
    """(the feeds of the first `rows` rows, the feeds of the rest): views, nothing copied."""
    head, rest = [], list(feeds)
    while rows:
        n = len(rest[0]["label"])
        if n <= rows:
            head.append(rest.pop(0))
        else:
            head.append({k: v[:rows] for k, v in rest[0].items()})
            rest[0] = {k: v[rows:] for k, v in rest[0].items()}
        rows -= min(n, rows)
    return head, rest


def _emit(feeds: list[dict[str, np.ndarray]], size: int, rng) -> Iterator[dict[str, np.ndarray]]:
    """The feeds' rows (permuted by `rng`, if any) in batches of `size` rows, the last one shorter.
    A batch within one feed is a view of it: only rows that span feeds or are permuted are copied."""
    if rng is not None:
        feed = _joined(feeds)
        order = rng.permutation(len(feed["label"]))
        feeds = [{k: v[order] for k, v in feed.items()}]
    left = sum(len(f["label"]) for f in feeds)
    while left:
        batch, feeds = _split(feeds, min(size, left))
        left -= min(size, left)
        yield _joined(batch)


def _joined(feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return feeds[0] if len(feeds) == 1 else {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}


@dataclass
class FileShard:
    """Reader `index` of `count`: (local feed, global batch size) per step of an epoch."""

    dataset: Dataset
    index: int
    count: int
    _epochs: int = 0

    def steps(self) -> tuple[list[int], list[int]]:
        """(rows per local batch, rows of the shard) of every reader."""
        from runtime.data.sources import share

        size = [
            share(self.dataset.batch_size, i, self.count)[1]
            - share(self.dataset.batch_size, i, self.count)[0]
            for i in range(self.count)
        ]
        rows = [sum(p.rows for p in ps) for ps in self.dataset.plan(self.count)]
        return size, rows

    def __iter__(self) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        ds = self.dataset
        size, rows = self.steps()
        steps = max(-(-r // s) for r, s in zip(rows, size, strict=True))
        seed = (ds.seed, self._epochs, self.index)
        self._epochs += 1
        pieces = ds.plan(self.count)[self.index]
        empty = ds._empty()
        local = prefetched(lambda: ds._batches(pieces, size[self.index], seed), ds.prefetch)
        try:
            for t in range(steps):
                g = sum(min(max(r - t * s, 0), s) for r, s in zip(rows, size, strict=True))
                mine = min(max(rows[self.index] - t * size[self.index], 0), size[self.index])
                feed = next(local) if mine else empty
                if len(feed["label"]) != mine:
                    raise RuntimeError(
                        f"reader {self.index}: step {t} has {len(feed['label'])} rows, expected {mine}"
                    )
                yield feed, g
        finally:
            local.close()


def prefetched(make: Callable[[], Iterator[T]], depth: int) -> Iterator[T]:
    """The items of `make()`, produced on a background thread up to `depth` ahead. Its errors
    are raised here; closing this generator stops the thread."""
    q: queue.Queue = queue.Queue(max(depth, 1))
    stop, end = threading.Event(), object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for x in make():
                if not put((x, None)):
                    return
            put((end, None))
        except BaseException as e:  # handed to the consumer
            put((end, e))

    thread = threading.Thread(target=work, name="hetps-ingest", daemon=True)
    thread.start()
    try:
        while True:
            x, err = q.get()
            if x is end:
                if err is not None:
                    raise err
                return
            yield x
    finally:
        stop.set()
        thread.join(timeout=5)
