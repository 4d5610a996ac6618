"""A trainer's step reports to the driver, sent together.

Every step a reader reports its items (`StepReport`) and the loss trainer its losses (`Losses`); one
message each to the driver costs all three processes a send, a receive, a wake-up and a MAC per
step. A trainer's `ReportQueue` keeps them and sends them as one `Reports` message once the oldest
is `every_s` old (checked when it queues one, and by the trainer's loop, which waits no longer than
that while reports are queued), and before any other report (`Ready`, `End`, `Done`), so the driver
sees a trainer's reports in the order it made them. Each carries its age when sent, so the driver
dates a step when it was done, not when its report arrived (`History.time`: no clock is shared
between hosts, an age needs none). `every_s` 0 sends each at once: the driver asks for that when it
grants steps as losses come in (`train(until_loss=...)`), where a late loss would hold the readers
back. The driver unpacks a `Reports` message (`unpack`) into the messages it carries.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from runtime.transport.channels import Outbox
from runtime.transport.messages import Losses, Message, ProtocolError, Reports, StepReport, header, parse

EVERY_S = 0.1  # how long a trainer may keep its step reports (the driver records steps that late)
MAX_AGE_S = 3600.0  # a report older than that when sent is refused as malformed
BATCHED: dict[str, type] = {c.KIND: c for c in (StepReport, Losses)}  # what a Reports message carries


class ReportQueue:
    """A trainer's reports to the driver at `driver`, step reports kept up to `every_s` seconds."""

    def __init__(self, out: Outbox, driver: str, who: str, every_s: float) -> None:
        self.out, self.driver, self.who, self.every_s = out, driver, who, every_s
        self.queued: list[tuple[dict[str, Any], list, float]] = []  # (header, arrays, when made)

    def step(self, msg: StepReport | Losses, arrays: list = ()) -> None:
        """Queue a step report; send the queue once its oldest is due."""
        if self.every_s <= 0:
            self.out.send(self.driver, header(msg), arrays)
            return
        self.queued.append((header(msg), list(arrays), time.perf_counter()))
        if self.due_in() == 0.0:
            self.flush()

    def losses(self, t: int, items: list) -> None:
        """Queue step t's losses: (examples, loss, [scores, labels, ...] or []) of each of its items
        (a multi-task plan: one scores, labels pair per task)."""
        arrays = []
        if items and items[0][2]:
            arrays = [np.concatenate([r[2][i] for r in items]) for i in range(len(items[0][2]))]
        self.step(Losses(self.who, t, [[n, loss] for n, loss, _ in items]), arrays)

    def now(self, msg: Message, arrays: list = ()) -> None:
        """Send `msg` at once, after the queued reports."""
        self.flush()
        self.out.send(self.driver, header(msg), arrays)

    def due_in(self) -> float | None:
        """Seconds until the queue must go (0: now); None when nothing is queued."""
        if not self.queued:
            return None
        return max(0.0, self.queued[0][2] + self.every_s - time.perf_counter())

    def flush(self) -> None:
        if not self.queued:
            return
        now = time.perf_counter()
        msgs = [[sub, len(a), now - made] for sub, a, made in self.queued]
        arrays = [a for _, sub_arrays, _ in self.queued for a in sub_arrays]
        self.queued = []
        self.out.send(self.driver, header(Reports(self.who, msgs)), arrays)


def unpack(msg: Reports, arrays: list) -> Iterator[tuple[Message, list, float]]:
    """The (message, its arrays, its age in seconds when sent) a `Reports` message carries, each
    checked: a ProtocolError names what is wrong (a kind it may not carry, a bad count or age,
    arrays left over)."""
    if not isinstance(msg.msgs, list):
        raise ProtocolError(f"a Reports message needs a list of [header, arrays, age], got {msg.msgs!r:.200}")
    at = 0
    for entry in msg.msgs:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], dict)):
            raise ProtocolError(f"a Reports entry is not [header, number of arrays, age]: {entry!r:.200}")
        sub, n, age = entry
        if not isinstance(n, int) or n < 0 or at + n > len(arrays):
            raise ProtocolError(f"a Reports entry claims {n!r} of the message's {len(arrays)} arrays")
        if not isinstance(age, (int, float)) or not 0 <= age <= MAX_AGE_S:
            raise ProtocolError(f"a Reports entry's age {age!r:.50} is not between 0 and {MAX_AGE_S} s")
        yield parse(sub, BATCHED), arrays[at : at + n], float(age)
        at += n
    if at != len(arrays):
        raise ProtocolError(f"a Reports message carries {len(arrays)} arrays, its entries {at}")
