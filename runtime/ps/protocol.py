"""The parameter server's requests: one record per operation, read from a wire header once.

A request travels as a `runtime.transport.wire` message: a header {"op": its `OP`, its fields} and
its arrays as buffers. `req.header()` / `req.arrays()` write one (the client), `parse(header,
arrays)` reads one back into its record (the server), each field checked: a malformed request is
refused with a PSError naming the op and the field, before it reaches a shard. The transport's
own header fields (`rid`, `cid`, `seq`, `to`, `shm`, `shm_reply`: the client's and server's, see
server.py) are not part of a record.

Ops: `Hello`, `Pull`, `Push`, `PushPull` (several tables' pushes, then pulls, in one request),
`Norm` and `Apply` (gradient clipping by global norm, clip.py), `Hold` and `WriteBack` (a dense
table its only trainer keeps, held_tables.py), `Assign`, `Save`, `Load`, `Shrink` (a pass end of
the feature lifecycle, lifecycle.py), `Stats`, `Trace`, `Shutdown`. `ADMIN_OPS` need the admin
key (server.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from runtime.ps.clip import check_scale
from runtime.ps.types import PSError

PS_RING_BYTES = 8 << 20  # a shared-memory ring per client and shard (runtime.transport.shm.ShmRing)

Part = tuple[str, list]  # (table, its arrays) of a push_pull


def _field(h: dict, key: str, kind: type, optional: bool = False) -> Any:
    v = h.get(key)
    if (v is None and optional) or (isinstance(v, kind) and not isinstance(v, bool)):
        return v
    raise PSError(f"request {h.get('op')!r} needs field {key!r} of type {kind.__name__}, got {v!r:.200}")


def _count(op: str, arrays: list, counts: tuple[int, ...], what: str) -> None:
    if len(arrays) not in counts:
        raise PSError(f"{op} takes {what}, got {len(arrays)} arrays")


def _ids_and_last(arrays: list) -> tuple[np.ndarray | None, Any]:
    """([ids,] last) -> (ids or None, last)."""
    return (arrays[0] if len(arrays) == 2 else None), arrays[-1]


class _Request:
    """What every request record has: `OP`, and its wire header and arrays. `ARRAYS`: the fields
    that travel as arrays, in order (None ones left out); `UNSENT`: fields the server fills in
    from the transport (a holder is its client's id)."""

    __slots__ = ()
    OP: ClassVar[str]
    ARRAYS: ClassVar[tuple[str, ...]] = ()
    UNSENT: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Any:
        return cls()

    def header(self) -> dict[str, Any]:
        skip = self.ARRAYS + self.UNSENT
        return {"op": self.OP, **{f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}}

    def arrays(self) -> list:
        return [a for a in (getattr(self, n) for n in self.ARRAYS) if a is not None]

    def span(self) -> str:
        """Its name in a trace."""
        return self.OP


@dataclass(slots=True)
class Hello(_Request):
    """Open a session (the server fills in `session`, which the reply carries: wire.Sessions)."""

    OP: ClassVar[str] = "hello"
    UNSENT: ClassVar[tuple[str, ...]] = ("session",)
    session: str = ""

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Hello:
        return cls(str(h.get("sess") or ""))


@dataclass(slots=True)
class Pull(_Request):
    """A dense table, or sparse rows of `ids`; in sync mode for `step`; `peek`: evaluation's read."""

    OP: ClassVar[str] = "pull"
    ARRAYS: ClassVar[tuple[str, ...]] = ("ids",)
    table: str
    ids: np.ndarray | None = None
    step: int | None = None
    peek: bool = False

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Pull:
        if len(arrays) > 1:
            raise PSError(f"pull takes at most one array (ids), got {len(arrays)}")
        return cls(
            _field(h, "table", str),
            arrays[0] if arrays else None,
            _field(h, "step", int, optional=True),
            h.get("peek") is True,
        )


@dataclass(slots=True)
class Push(_Request):
    """A gradient (`ids` for a sparse table's rows) of `pusher`; in sync mode of `step`. A sparse
    push may carry `show_click`: [n, 2] float32 (show, click) per id (runtime/ps/lifecycle.py)."""

    OP: ClassVar[str] = "push"
    ARRAYS: ClassVar[tuple[str, ...]] = ("ids", "grad", "show_click")
    table: str
    grad: np.ndarray
    ids: np.ndarray | None = None
    step: int | None = None
    pusher: str = "0"
    show_click: np.ndarray | None = None

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Push:
        _count("push", arrays, (1, 2, 3), "[grad], [ids, grad] or [ids, grad, show_click]")
        ids, grad, shows = push_arrays(arrays)
        return cls(
            _field(h, "table", str),
            grad,
            ids,
            _field(h, "step", int, optional=True),
            str(h.get("pusher", "0")),
            shows,
        )


def push_arrays(arrays: list) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(ids or None, grad, show_click or None) of a push's [grad], [ids, grad] or [ids, grad,
    show_click]."""
    if len(arrays) == 3:
        return arrays[0], arrays[1], arrays[2]
    return (arrays[0] if len(arrays) == 2 else None), arrays[-1], None


def _parts(h: dict, key: str, counts: tuple[int, ...], arrays: list) -> list[Part]:
    """The (table, arrays) parts `h[key]` = [[table, number of arrays], ...] describes, taken in
    order from `arrays`; PSError when malformed (a dense table pulled more than once)."""
    spec = h.get(key, [])
    if not isinstance(spec, list) or not all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], str)
        and p[1] in counts
        and not isinstance(p[1], bool)
        for p in spec
    ):
        raise PSError(
            f"push_pull field {key!r} must be a list of [table, number of arrays in {counts}], "
            f"got {spec!r:.200}"
        )
    bare = [t for t, n in spec if n == 0]  # a dense pull carries nothing: its reply is not bounded
    if len(set(bare)) != len(bare):  # by the request's bytes, so once per request
        raise PSError(f"push_pull {key!r} pulls a dense table more than once: {bare}")
    out, i = [], 0
    for table, n in spec:
        out.append((table, arrays[i : i + n]))
        i += n
    if i != len(arrays):
        raise PSError(f"push_pull describes {i} arrays, the request carries {len(arrays)}")
    return out


@dataclass(slots=True)
class PushPull(_Request):
    """Several tables in one request: `pushes` ([grad], [ids, grad] or [ids, grad, show_click] each,
    as `Push`) at `step`, applied
    first, then `pulls` ([] or [ids] each) at `pull_step`, one reply array each, in order."""

    OP: ClassVar[str] = "push_pull"
    pushes: list[Part] = field(default_factory=list)
    pulls: list[Part] = field(default_factory=list)
    step: int | None = None
    pull_step: int | None = None
    pusher: str = "0"
    peek: bool = False

    @classmethod
    def parse(cls, h: dict, arrays: list) -> PushPull:
        n_push = sum(
            p[1] for p in h.get("push", []) if isinstance(p, list) and len(p) == 2 and isinstance(p[1], int)
        )
        return cls(
            _parts(h, "push", (1, 2, 3), arrays[:n_push]),
            _parts(h, "pull", (0, 1), arrays[n_push:]),
            _field(h, "step", int, optional=True),
            _field(h, "pull_step", int, optional=True),
            str(h.get("pusher", "0")),
            h.get("peek") is True,
        )

    def header(self) -> dict[str, Any]:
        return {
            "op": self.OP,
            "push": [[t, len(a)] for t, a in self.pushes],
            "pull": [[t, len(a)] for t, a in self.pulls],
            "step": self.step,
            "pull_step": self.pull_step,
            "pusher": self.pusher,
            "peek": self.peek,
        }

    def arrays(self) -> list:
        return [x for _, a in self.pushes for x in a] + [x for _, a in self.pulls for x in a]

    def span(self) -> str:
        """push_pull when it does both, else what it does."""
        return "push_pull" if self.pushes and self.pulls else "push" if self.pushes else "pull"


@dataclass(slots=True)
class Norm(_Request):
    """The sum of squares of a sync step's clipped gradients (clip.py)."""

    OP: ClassVar[str] = "norm"
    step: int

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Norm:
        return cls(_field(h, "step", int))


@dataclass(slots=True)
class Apply(_Request):
    """Apply a sync step's held clipped gradients, scaled by `scale` in [0, 1] (clip.py)."""

    OP: ClassVar[str] = "apply"
    step: int
    scale: float

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Apply:
        return cls(_field(h, "step", int), check_scale(h.get("scale")))


@dataclass(slots=True)
class Hold(_Request):
    """Hand a dense table's state to the trainer `holder` (its client id) that updates it alone."""

    OP: ClassVar[str] = "hold"
    UNSENT: ClassVar[tuple[str, ...]] = ("holder",)
    table: str
    holder: str = ""

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Hold:
        return cls(_field(h, "table", str), str(h.get("cid", "")))


@dataclass(slots=True)
class WriteBack(_Request):
    """A held table's state (`arrays`, named by `keys`), `steps` steps after its hold; `final`:
    the hold ends."""

    OP: ClassVar[str] = "write_back"
    UNSENT: ClassVar[tuple[str, ...]] = ("states", "holder")
    table: str
    keys: list[str]
    states: list
    steps: int
    final: bool = False
    holder: str = ""

    @classmethod
    def parse(cls, h: dict, arrays: list) -> WriteBack:
        table, keys = _field(h, "table", str), h.get("keys")
        if (
            not isinstance(keys, list)
            or len(keys) != len(arrays)
            or not all(isinstance(k, str) for k in keys)
        ):
            raise PSError(f"write_back needs field 'keys', one name per array, got {keys!r:.200}")
        return cls(
            table, keys, arrays, _field(h, "steps", int), h.get("final") is True, str(h.get("cid", ""))
        )

    def arrays(self) -> list:
        return list(self.states)


@dataclass(slots=True)
class Assign(_Request):
    """Set a dense table's value, or sparse rows `ids` (admin: imported weights)."""

    OP: ClassVar[str] = "assign"
    ARRAYS: ClassVar[tuple[str, ...]] = ("ids", "values")
    table: str
    values: np.ndarray
    ids: np.ndarray | None = None

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Assign:
        _count("assign", arrays, (1, 2), "[values] or [ids, values]")
        ids, values = _ids_and_last(arrays)
        return cls(_field(h, "table", str), values, ids)


@dataclass(slots=True)
class Save(_Request):
    """Write the shard's tables into directory `dir` (inside the server's checkpoint root)."""

    OP: ClassVar[str] = "save"
    dir: str

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Save:
        return cls(_field(h, "dir", str))


@dataclass(slots=True)
class Load(_Request):
    """Load checkpoint `dir`; `step`: count the applied sync steps from there."""

    OP: ClassVar[str] = "load"
    dir: str
    step: int | None = None

    @classmethod
    def parse(cls, h: dict, arrays: list) -> Load:
        return cls(_field(h, "dir", str), _field(h, "step", int, optional=True))


@dataclass(slots=True)
class Shrink(_Request):
    """A pass end: apply every sparse table's lifecycle (decay, TTL, score threshold:
    runtime/ps/lifecycle.py); the reply carries the rows removed per table."""

    OP: ClassVar[str] = "shrink"


@dataclass(slots=True)
class Stats(_Request):
    OP: ClassVar[str] = "stats"


@dataclass(slots=True)
class Trace(_Request):
    OP: ClassVar[str] = "trace"


@dataclass(slots=True)
class Shutdown(_Request):
    OP: ClassVar[str] = "shutdown"


Request = (
    Hello
    | Pull
    | Push
    | PushPull
    | Norm
    | Apply
    | Hold
    | WriteBack
    | Assign
    | Save
    | Load
    | Shrink
    | Stats
    | Trace
    | Shutdown
)
REQUESTS: dict[str, type] = {
    c.OP: c
    for c in (
        Hello,
        Pull,
        Push,
        PushPull,
        Norm,
        Apply,
        Hold,
        WriteBack,
        Assign,
        Save,
        Load,
        Shrink,
        Stats,
        Trace,
        Shutdown,
    )
}
OPS = tuple(REQUESTS)
ADMIN_OPS = frozenset({"assign", "save", "load", "shrink", "shutdown"})
TRACED_OPS = frozenset({"pull", "push", "push_pull"})  # the requests a traced server records


def parse(h: dict, arrays: list) -> Request:
    """The request of wire header `h` and its arrays; PSError naming what is malformed."""
    cls = REQUESTS.get(h.get("op"))
    if cls is None:
        raise PSError(f"unknown request op {h.get('op')!r:.100}; known ops: {', '.join(OPS)}")
    return cls.parse(h, arrays)
