"""The messages of a run, one small record per kind, and their compact wire headers.

Every message travels as a `runtime.transport.wire` frame: a MessagePack header plus raw array buffers (never
pickle). The header keeps the single-letter keys the runtime has always used, because tensor
messages go out once per micro-batch and segment; each record names its kind (`KIND`, the header's
`"k"`) and maps its fields to header keys (`KEYS`). `header(msg)` writes one, `parse(h, kinds)`
reads one back into the record of its kind, with a `ProtocolError` naming what is wrong.

Between trainers: `Tensors` (one micro-batch's tensors for one destination; the arrays ride as buffers,
see `channels.pack_tensors`; between two gpu trainers on one device a descriptor of device buffers
instead, with `DeviceOf` and `Released`: runtime/trainer/ipc.py), `Announce` (a reader's items of a
step, to the trainers of the other types), `End` (a reader's last step). From the driver to readers:
`Grant`. From every process to the driver, each naming its sender (`who`): `Ready`, `StepReport`,
`Losses` (scores and labels as buffers), `Reports` (a trainer's step reports together:
runtime/transport/reports.py), `End`, `Done` (statistics; trace spans as a buffer) and `Failed` (a
traceback).
From evaluation workers to the driver of a parallel `evaluate` / `predict`: `Scored`, `Done`, `Failed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ops_registry.errors import HetpsError


class ProtocolError(HetpsError, RuntimeError):
    """A message of an unknown kind, or one that lacks a field of its kind."""


@dataclass(slots=True)
class Tensors:
    KIND: ClassVar[str] = "t"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("step", "s"),
        ("origin", "o"),
        ("mb", "m"),
        ("descs", "v"),
        ("dev", "d"),
    )
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"dev"})  # (left out of the header when None)
    step: int
    origin: int
    mb: int
    descs: list  # [[name, height or None]] (channels.pack_tensors)
    dev: list | None = None  # tensors sent device to device (runtime/trainer/ipc.py's IpcPart)


@dataclass(slots=True)
class Announce:
    KIND: ClassVar[str] = "step"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("step", "s"),
        ("origin", "o"),
        ("global_size", "g"),
        ("items", "items"),
    )
    step: int
    origin: int
    global_size: int
    items: list  # [[micro-batch, examples]] of the items this destination takes part in


@dataclass(slots=True)
class End:
    """A reader's last step: no step >= `step` runs (to peers; to the driver with `who`)."""

    KIND: ClassVar[str] = "end"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("step", "s"), ("origin", "o"), ("who", "who"))
    step: int
    origin: int
    who: str = ""


@dataclass(slots=True)
class Grant:
    KIND: ClassVar[str] = "grant"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("upto", "upto"), ("final", "final"))
    upto: int | None
    final: bool


@dataclass(slots=True)
class WriteBack:
    """To a trainer holding dense tables (runtime/ps/held_tables.py): write them back once steps < `step`
    are applied (the driver pauses there for a checkpoint or an evaluation)."""

    KIND: ClassVar[str] = "write_back"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("step", "s"),)
    step: int


@dataclass(slots=True)
class DeviceOf:
    """A gpu trainer's CUDA device (`runtime.trainer.ipc.device_key`), to the other gpu trainers:
    tensors between two on one device go device to device."""

    KIND: ClassVar[str] = "device"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("who", "who"), ("key", "key"))
    who: str
    key: str


@dataclass(slots=True)
class Released:
    """A gpu trainer has copied out a peer's device buffers (`slots`, runtime/trainer/ipc.py): to
    that peer, which may write them again."""

    KIND: ClassVar[str] = "released"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("who", "who"), ("slots", "slots"))
    who: str
    slots: list


@dataclass(slots=True)
class Ready:
    KIND: ClassVar[str] = "ready"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("who", "who"),)
    who: str


@dataclass(slots=True)
class StepReport:
    """A reader started a step: its items of it and its examples of a global batch of `global_size`."""

    KIND: ClassVar[str] = "step"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("who", "who"),
        ("step", "s"),
        ("items", "items"),
        ("examples", "n"),
        ("global_size", "g"),
    )
    who: str
    step: int
    items: int
    examples: int
    global_size: int


@dataclass(slots=True)
class Losses:
    """The loss of each of a step's items: [[examples, loss]] (scores and labels as buffers)."""

    KIND: ClassVar[str] = "losses"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("who", "who"), ("step", "s"), ("items", "items"))
    who: str
    step: int
    items: list


@dataclass(slots=True)
class Reports:
    """A trainer's step reports (`StepReport`, `Losses`) in one message: [[header, number of its
    arrays]], the arrays in that order (runtime/transport/reports.py)."""

    KIND: ClassVar[str] = "reports"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("who", "who"), ("msgs", "r"))
    who: str
    msgs: list


@dataclass(slots=True)
class Done:
    KIND: ClassVar[str] = "done"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("who", "who"), ("stats", "stats"))
    who: str
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Failed:
    KIND: ClassVar[str] = "error"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("who", "who"), ("traceback", "tb"))
    who: str
    traceback: str


@dataclass(slots=True)
class Scored:
    """An evaluation worker's forward pass of one batch (runtime/evaluation/workers.py): where the
    batch sits in the data (`order`), its loss (None for predict); the prediction (and labels) as
    buffers."""

    KIND: ClassVar[str] = "scored"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("who", "who"), ("order", "o"), ("loss", "l"))
    who: str
    order: list  # [worker or batch index, local batch index]: sorted, the data's order
    loss: float | None


Message = (
    Tensors
    | DeviceOf
    | Released
    | Announce
    | End
    | Grant
    | WriteBack
    | Ready
    | StepReport
    | Losses
    | Reports
    | Done
    | Failed
    | Scored
)

TO_TRAINER: dict[str, type] = {
    c.KIND: c for c in (Tensors, Announce, End, Grant, WriteBack, DeviceOf, Released)
}
TO_DRIVER: dict[str, type] = {c.KIND: c for c in (Ready, StepReport, Losses, Reports, End, Done, Failed)}
TO_EVALUATOR: dict[str, type] = {c.KIND: c for c in (Scored, Done, Failed)}


def header(msg: Message) -> dict[str, Any]:
    """The wire header of `msg`: {"k": its kind, short key: value, ...}."""
    h: dict[str, Any] = {"k": msg.KIND}
    optional = getattr(msg, "OPTIONAL", ())
    for name, key in msg.KEYS:
        value = getattr(msg, name)
        if value is not None or name not in optional:
            h[key] = value
    return h


def parse(h: dict[str, Any], kinds: dict[str, type]) -> Message:
    """The record of header `h`, of one of `kinds` (TO_TRAINER or TO_DRIVER)."""
    cls = kinds.get(h.get("k"))
    if cls is None:
        raise ProtocolError(
            f"unexpected message kind {h.get('k')!r} (expected one of {sorted(kinds)}; header {h})"
        )
    optional = getattr(cls, "OPTIONAL", ())
    try:
        return cls(*[h.get(key) if name in optional else h[key] for name, key in cls.KEYS])
    except KeyError as e:
        raise ProtocolError(f"a {cls.__name__} message lacks its field {e.args[0]!r} (header {h})") from None
