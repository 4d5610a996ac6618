"""`PassDirectorySource`: a log written pass by pass into `root/{day}/{hour}/` folders, each ready
once its done-flag file appears (how Paddle PS users train online: `_SUCCESS`, `to.hadoop.done`).

Passes are read in event-time order; a later pass that is ready waits for an earlier one that is
not (and a folder that appears once a later pass was read is never read: write passes in order).
The files of a pass are read by the format readers of `runtime.data.files` (`open_dataset` on the
pass's files), split among reader shards as `Dataset.shard` splits files (byte ranges of plain
text, whole .gz files, Parquet row groups). Position: (last pass read whole, files of the next
pass read whole by this shard, rows of the next file yielded). The root is a local directory or
one of any file system pyarrow.fs or fsspec reads (a URI, or a (file system, path) pair:
runtime/data/streams/fs.py; a non-local pass's files are copied to a temporary directory while
the pass is read).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from runtime.data.files.dataset import open_dataset
from runtime.data.streams.base import Feed, Pass, StreamPosition, StreamSource, StreamStalled, marked, rebatch
from runtime.data.streams.fs import tree

FIELDS = {"day": (r"\d{8}", timedelta(days=1)), "hour": (r"\d{2}", timedelta(hours=1))}
FIELDS["minute"] = (r"\d{2}", timedelta(minutes=1))


@dataclass(frozen=True)
class PassDir:
    """A pass's folder: its id (the path below the root), event-time start and folder (a path in
    the source's file system)."""

    id: str
    start: datetime
    path: str


class PassDirectorySource(StreamSource):
    """Passes from `root/<layout>/` folders (`root`: a local path, a URI pyarrow.fs or fsspec
    reads, such as `s3://bucket/logs` or `file:///data/logs`, or a (pyarrow or fsspec file system,
    path) pair: runtime/data/streams/fs.py), e.g. layout "{day}/{hour}" (20240101/03) or
    "dt={day}/hr={hour}"; fields: {day} (YYYYMMDD), {hour}, {minute} (two digits). A pass is ready
    when `done_flag` exists in its folder; its other files (hidden and `_`-prefixed ones skipped)
    are its data, in `format` (None: guessed from the first file) read by `schema`.

    `follow`: wait for passes that are not there yet, polling every `poll` s; past `timeout` s
    (None: forever) without a new ready pass, `StreamStalled` names the folder without its flag (or
    the root, when no new folder appeared). `follow=False` ends at the first pass not ready.
    `until`: the id of the last pass to read (a backfill of a date range). `pass_length`: a pass's
    event-time span (default: the unit of the layout's finest field)."""

    kind = "passes"

    def __init__(
        self,
        root: str | os.PathLike | tuple,
        schema: Any,
        batch_size: int,
        *,
        layout: str = "{day}/{hour}",
        done_flag: str = "_SUCCESS",
        format: str | None = None,
        shard: tuple[int, int] = (0, 1),
        follow: bool = True,
        poll: float = 1.0,
        timeout: float | None = None,
        until: str | None = None,
        pass_length: timedelta | None = None,
    ) -> None:
        super().__init__(schema, batch_size, shard)
        self.tree = tree(root)
        self.root, self.layout, self.done_flag, self.format = self.tree.name, layout, done_flag, format
        self.follow, self.poll, self.timeout, self.until = follow, poll, timeout, until
        self._levels = [_level_regex(part, layout) for part in layout.strip("/").split("/")]
        names = re.findall(r"{(\w+)}", layout)
        self.pass_length = pass_length or min(FIELDS[n][1] for n in names)
        self._position = StreamPosition(self.kind, self.shard)

    def position(self) -> StreamPosition:
        return self._position

    def _seek(self, position: StreamPosition) -> None:
        self._position = position

    def passes(self) -> Iterator[Pass]:
        while (p := self._next_ready(self._position.pass_id)) is not None:
            yield Pass(p.id, p.start, p.start + self.pass_length, self._pass_batches(p))
            if self._position.pass_id != p.id:
                raise RuntimeError(
                    f"pass {p.id} was left before its last batch: read a Pass's batches to the end "
                    "before asking for the next pass (or seek a saved position)"
                )

    # -- internals ----------------------------------------------------------------------------
    def _pass_batches(self, p: PassDir) -> Iterator[Feed]:
        skip_files, skip_rows = self._position.file, self._position.row
        files = [
            self.tree.join(p.id, f)
            for f in self.tree.files(p.path)
            if f != self.done_flag and not f.startswith((".", "_"))
        ]
        if files:
            with self.tree.staged(files) as local:
                ds = open_dataset(local, self.schema, self.batch_size, self.format, prefetch=0)
                pieces = ds.plan(self.shard[1])[self.shard[0]]
                chunks = self._chunks(ds, pieces, skip_files, skip_rows)
                for feed, unit, row in rebatch(chunks, self.local_batch):
                    pos = StreamPosition(self.kind, self.shard, self._position.pass_id, unit, 0, row)
                    self._position = pos
                    if unit == len(pieces):  # the pass's last row
                        self._position = StreamPosition(self.kind, self.shard, p.id)
                    yield feed
        self._position = StreamPosition(self.kind, self.shard, p.id)

    def _chunks(self, ds, pieces: list, skip_files: int, skip_rows: int) -> Iterator[Feed]:
        """Marked feeds of the pieces from piece `skip_files`, row `skip_rows` on."""
        for k in range(skip_files, len(pieces)):
            at = 0  # rows of piece k read so far
            for _, cols in ds._chunks([pieces[k]], self.schema.columns):
                n = len(next(iter(cols.values())))
                lo = min(max(skip_rows - at, 0), n) if k == skip_files else 0
                if lo < n:
                    rows = np.arange(at + lo + 1, at + n + 1)
                    last = rows == pieces[k].rows
                    feed = self.schema.feeds({c: a.slice(lo) for c, a in cols.items()})
                    yield marked(feed, np.where(last, k + 1, k), np.where(last, 0, rows))
                at += n

    def _ready(self) -> tuple[list[PassDir], bool]:
        """(pass folders in event-time order, whether each has its done flag)."""
        found: list[tuple[str, dict]] = [("", {})]  # (id so far, field values)
        for level in self._levels:
            found = [
                (f"{rel}/{d}".lstrip("/"), {**values, **m.groupdict()})
                for rel, values in found
                for d in self.tree.dirs(self.tree.join(rel))
                if (m := level.fullmatch(d))
            ]
        dirs = sorted(
            (PassDir(rel, _start(v), self.tree.join(rel)) for rel, v in found),
            key=lambda p: (p.start, p.id),
        )
        return dirs, [self.tree.exists(f"{p.path}/{self.done_flag}") for p in dirs]

    def _next_ready(self, after: str) -> PassDir | None:
        """The first pass after the pass `after` ("": from the first), waited for; None at the end."""
        t0 = time.monotonic()
        while True:
            dirs, ready = self._ready()
            key = (self._start_of(after), after) if after else None  # its folder may be gone (retention)
            waiting = [
                (p, r) for p, r in zip(dirs, ready, strict=True) if key is None or (p.start, p.id) > key
            ]
            if waiting and self.until is not None and waiting[0][0].id > self.until:
                return None
            if waiting and waiting[0][1]:
                return waiting[0][0]
            if not self.follow:
                return None
            waited = time.monotonic() - t0
            if self.timeout is not None and waited > self.timeout:
                if waiting:
                    where = self.tree.describe(waiting[0][0].path)
                    raise StreamStalled(
                        f"pass directory {where} has had no done flag {self.done_flag!r} for "
                        f"{waited:.1f} s (timeout={self.timeout}); later passes wait for it"
                    )
                raise StreamStalled(
                    f"no new pass directory under {self.root} (layout {self.layout!r}) after pass "
                    f"{after or '(none)'} for {waited:.1f} s (timeout={self.timeout})"
                )
            time.sleep(self.poll)

    def _start_of(self, pass_id: str) -> datetime:
        """The event-time start of a pass by its id (its path below the root)."""
        parts = pass_id.split("/")
        found = [lv.fullmatch(x) for lv, x in zip(self._levels, parts, strict=False)]
        if len(parts) != len(self._levels) or not all(found):
            raise ValueError(f"pass id {pass_id!r} does not match the layout {self.layout!r}")
        return _start({k: v for m in found for k, v in m.groupdict().items()})


def _level_regex(part: str, layout: str) -> re.Pattern:
    out, at = "", 0
    for m in re.finditer(r"{(\w+)}", part):
        if m.group(1) not in FIELDS:
            raise ValueError(f"layout {layout!r}: unknown field {{{m.group(1)}}}; fields: {sorted(FIELDS)}")
        out += re.escape(part[at : m.start()]) + f"(?P<{m.group(1)}>{FIELDS[m.group(1)][0]})"
        at = m.end()
    return re.compile(out + re.escape(part[at:]))


def _start(values: dict[str, str]) -> datetime:
    day = datetime.strptime(values["day"], "%Y%m%d") if "day" in values else datetime(1970, 1, 1)
    return day + timedelta(hours=int(values.get("hour", 0)), minutes=int(values.get("minute", 0)))
