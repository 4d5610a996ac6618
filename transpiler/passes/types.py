"""What the passes of `transpile` return: one typed record per pass (a leaf module: it imports no pass).

Each pass changes the program it is given in place (ops, their `op_device`) and returns its record;
`transpiler.passes.pipeline` hands the records to the passes that require them, and the Plan is
made from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transpiler.ir import SegmentRef
from transpiler.tables import TableSpec

Reasons = dict[str, str]  # str(op id) -> why the op runs where it does (`Plan.explain`)


@dataclass
class Placement:
    """`assign_devices`: every op's `op_device` is set on the op; `ops`: str(op id) -> (op type,
    trainer type or "ps") of every op of the program it placed (optimizer ops included, which
    insert_ps then removes); why, by op id."""

    trainer_types: list[str]
    ops: dict[str, tuple[str, str]] = field(default_factory=dict)
    reasons: Reasons = field(default_factory=dict)


@dataclass
class Tables:
    """`insert_ps`: the parameter-server tables, and why each pull/push/unique_ids op it inserted
    runs where it does."""

    specs: list[TableSpec]
    reasons: Reasons = field(default_factory=dict)


@dataclass
class Channels:
    """`insert_comm`: one channel per tensor crossing from one trainer type to another ({"tensor",
    "src", "dst", "shape", "dtype", "bytes_per_example", "direction"}: the plan file's format), and
    why each send/recv op it inserted runs where it does."""

    channels: list[dict[str, Any]]
    reasons: Reasons = field(default_factory=dict)


@dataclass
class SegmentOrder:
    """`order_segments`: per trainer type, the run segments stored in its sub-program
    (`Program.segments`)."""

    segments: dict[str, list[list[SegmentRef]]]
