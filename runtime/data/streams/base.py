"""What every stream source is: batches of feed dicts that never end, read in passes, from a
position that can be saved and restored so that a resumed run trains every example exactly once.

- `StreamPosition`: where a source is (a typed record, to / from JSON): everything before it was
  yielded, nothing after it. Sources count units (the files of a pass, the messages of a broker
  stream) wholly read and the rows of the next unit already yielded.
- `Pass`: a unit of training (an hour of logs): its id, its event-time range and its batches.
- `StreamSource`: `passes()`, `batches()` (the passes' batches one after the other), `position()`,
  `seek(position)`. A source's position moves as `batches()` / `passes()` yield; `for feed in
  source` reads from the source's position without moving it (a re-iterable, what `train` takes).
- Reader shards: a source made with `shard=(i, n)` yields only reader i's records (each source
  says how it splits), in local batches of `share(batch_size, i, n)` rows; n readers together read
  every record once. Steps are not aligned across readers: a reader's pass ends when its records do.
"""

from __future__ import annotations

import copy
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ops_registry.errors import HetpsError
from runtime.data.files.dataset import _joined, _split
from runtime.data.files.schema import Schema
from runtime.data.sources import share

Feed = dict[str, np.ndarray]
_UNIT, _ROW = "_stream_unit", "_stream_row"  # per-row position marks carried through the batching


class StreamStalled(HetpsError, TimeoutError):
    """A stream made no progress within its timeout: a pass directory without its done flag, no
    new pass, no new message, or a broker that stayed unreachable. The message names what."""


@dataclass(frozen=True)
class StreamPosition:
    """Where a source is. `kind`: the source's kind ("passes", "nats"); `shard`: (reader, readers).

    Pass directories: `pass_id` is the last pass read whole ("" none), `file` the files of the next
    pass read whole (by this reader's shard) and `row` the rows of the next file yielded.
    NATS: `sequence` is the last stream sequence read whole (0 none) and `row` the records of the
    next message yielded."""

    kind: str
    shard: tuple[int, int] = (0, 1)
    pass_id: str = ""
    file: int = 0
    sequence: int = 0
    row: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StreamPosition:
        d = json.loads(text)
        known = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or "kind" not in d or set(d) - known:
            raise ValueError(f"not a stream position (a JSON object with {sorted(known)}): {text[:200]!r}")
        return cls(**{**d, "shard": tuple(d.get("shard", (0, 1)))})

    def save(self, path: str | Path) -> None:
        """Write it to `path` atomically (a reader of the file sees the old or the new position)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> StreamPosition:
        return cls.from_json(Path(path).read_text())


@dataclass
class Pass:
    """A unit of training: `id`, the event times [start, end) it holds, and its batches (read them
    to the end before asking the source for the next pass)."""

    id: str
    start: datetime
    end: datetime
    batches: Iterator[Feed]


class StreamSource(ABC):
    """See the module docstring. Subclasses implement `passes`, `position` and `_seek`."""

    kind: ClassVar[str]

    def __init__(self, schema: Any, batch_size: int, shard: tuple[int, int] = (0, 1)) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        i, n = shard
        if not 0 <= i < n:
            raise ValueError(f"shard {shard}: expected (index, count) with 0 <= index < count")
        if batch_size < n:
            raise ValueError(f"batch_size {batch_size} is smaller than the {n} readers: each needs a row")
        self.schema = Schema.load(schema)
        if self.schema.needs_stats():
            raise ValueError(
                f"the schema standardizes {self.schema.needs_stats()} without stats; a stream has no "
                "end to measure them over: give stats: {column: [mean, std]}"
            )
        self.batch_size = batch_size
        self.shard = (i, n)
        lo, hi = share(batch_size, i, n)
        self.local_batch = hi - lo

    @abstractmethod
    def passes(self) -> Iterator[Pass]:
        """The passes from the source's position on (the first one resumed where it stopped)."""

    @abstractmethod
    def position(self) -> StreamPosition:
        """Where the source is: after every row yielded so far."""

    @abstractmethod
    def _seek(self, position: StreamPosition) -> None: ...

    def seek(self, position: StreamPosition) -> None:
        """Continue from `position` (a `position()` of a source of the same kind and shard)."""
        if position.kind != self.kind:
            raise ValueError(f"a {position.kind!r} position cannot seek a {self.kind!r} source")
        if tuple(position.shard) != self.shard:
            raise ValueError(
                f"the position is reader {position.shard[0]} of {position.shard[1]}'s; this source is "
                f"reader {self.shard[0]} of {self.shard[1]}: resume each reader from its own position"
            )
        self._seek(position)

    def batches(self) -> Iterator[Feed]:
        """Local feed dicts, pass after pass; `position()` after a batch is the position after it."""
        for p in self.passes():
            yield from p.batches

    def __iter__(self) -> Iterator[Feed]:
        return copy.copy(self).batches()


def marked(feed: Feed, unit: np.ndarray, row: np.ndarray) -> Feed:
    """`feed` with the position after each of its rows: (units read whole, rows of the next unit)."""
    return {**feed, _UNIT: unit, _ROW: row}


def rebatch(chunks: Iterable[Feed], size: int) -> Iterator[tuple[Feed, int, int]]:
    """(feed, units, rows): the marked chunks' rows in feeds of `size` rows (the last one shorter)
    and the position after each feed's last row."""
    pending: list[Feed] = []
    have = 0
    for chunk in chunks:
        if len(chunk["label"]):
            pending.append(chunk)
            have += len(chunk["label"])
        while have >= size:
            head, pending = _split(pending, size)
            have -= size
            yield _unmarked(_joined(head))
    if have:
        yield _unmarked(_joined(pending))


def _unmarked(feed: Feed) -> tuple[Feed, int, int]:
    out = {k: v for k, v in feed.items() if k not in (_UNIT, _ROW)}
    return out, int(feed[_UNIT][-1]), int(feed[_ROW][-1])
