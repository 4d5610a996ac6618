"""A trainer's items (micro-batches of a step, the Executor's ctx when their segments run), where
their tensors go (`route`), and the tensors between trainers (`Mail`: the send / recv ops)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.exec.device import Copies, to_host


def route(
    counts: dict[str, int], reader: str, dst_type: str, origin: int, mb: int, micro_batches: int
) -> int:
    """Index of the trainer of type `dst_type` that handles micro-batch `mb` of reader `origin`:
    the reader itself for the reader type, else round robin over (origin, mb)."""
    if dst_type == reader:
        return origin
    return (origin * micro_batches + mb) % counts[dst_type]


@dataclass
class Item:
    """Micro-batch `mb` of step `step` read by reader `origin`: the ctx of its segments' runs."""

    step: int
    origin: int
    mb: int
    size: int
    global_size: int
    feed: dict[str, np.ndarray] | None = None
    seg: int = 0
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.step, self.origin, self.mb)


class Mail:
    """Tensors between trainers, for the send / recv ops (a `comm_ops.CommBackend`): what a
    segment sends waits in `outgoing` until the trainer takes it after the segment
    (`take_outgoing`); what arrives (`deliver`) waits per item in `arrived` until its recv runs.

    On a gpu trainer a tensor's copy to the device starts when it arrives (`Copies`: pinned buffer,
    copy stream), so it overlaps the kernels of the item running meanwhile; `to_host` copies what
    a segment sends back off the device the same way. (Between two gpu trainers on one device the
    trainer sends and receives device buffers instead: runtime/trainer/ipc.py.)"""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.copies = Copies(xp) if xp is not np else None
        self.arrived: dict[tuple[int, int, int], dict[str, Any]] = {}
        self.outgoing: list[tuple[str, str, Any]] = []

    def send(self, it: Item, dst: str, name: str, value: Any) -> None:
        self.outgoing.append((dst, name, value))

    def take_outgoing(self) -> list[tuple[str, str, Any]]:
        """What the segment just run sends, (destination type, name, value) each; the queue is empty after."""
        out, self.outgoing = self.outgoing, []
        return out

    def deliver(self, key: tuple[int, int, int], tensors: dict[str, Any]) -> None:
        """Tensors of item `key` arrived; each waits for its recv. One arriving while a tensor of the
        same name still waits for the item is refused (one send/recv pair per tensor and crossing)."""
        if self.copies is not None:
            tensors = self.copies.to_device_all(tensors)
        box = self.arrived.get(key)
        if box is None:
            self.arrived[key] = tensors
            return
        for name, value in tensors.items():
            if name in box:
                raise RuntimeError(f"tensor {name!r} of item {key} arrived twice before its recv ran")
            box[name] = value

    def forget(self, key: tuple[int, int, int]) -> None:
        """Item `key` has run: drop what is left of its tensors."""
        self.arrived.pop(key, None)

    def recv(self, it: Item, name: str) -> Any:
        return self.arrived[it.key].pop(name)

    def to_host_all(self, values: list[Any]) -> list[Any]:
        """A segment's sent values on the host (on a gpu trainer off the device through the copy
        stream, one wait for all of them)."""
        return [to_host(v) for v in values] if self.copies is None else self.copies.to_host_all(values)

    def missing(self, it: Item, names: list[str]) -> list[str]:
        got = self.arrived.get(it.key, {})
        return [n for n in names if n not in got]
