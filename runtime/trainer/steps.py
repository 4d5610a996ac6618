"""A trainer's step book: the steps it knows of, which are complete, how far it has pushed, and
when its run ends (see `runtime.trainer.process` for how steps flow)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class StepState:
    items: int = 0  # items of this step on this trainer (known so far)
    done: int = 0
    announced: set[int] = field(default_factory=set)  # readers whose announcement arrived
    dense: dict[str, Any] = field(default_factory=dict)  # pulled dense tables
    grads: dict[str, Any] = field(default_factory=dict)  # accumulated dense gradients
    summed: set[str] = field(default_factory=set)  # dense tables whose gradient is a buffer of ours
    rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)  # sparse
    # sparse, per item: (ids, rows) with one row per lookup of the item's prefetched feed, in order
    fed_rows: dict[str, dict[tuple, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    reports: list[tuple[int, float, list]] = field(default_factory=list)  # (size, loss, [score, label])
    leases: list[Any] = field(default_factory=list)  # release() of its messages read in place


@dataclass
class Ahead:
    """A sync reader's next step, made while the current one runs: its share of a global batch,
    (batch, n, lo, hi) with rows [lo, hi) of batch its share of n (None: the run ends before the
    step), and its items."""

    step: int
    got: tuple | None
    items: list[Any]


class StepBook:
    """Steps of one trainer. A reader makes its steps (`next_step`, `end`); any other trainer
    learns them from the readers' announcements (`StepState.announced`) and end steps (`ends`).
    Steps < `flushed` are pushed; a resumed run starts at `start`."""

    def __init__(self, name: str, is_reader: bool, readers: int, start: int = 0) -> None:
        self.name, self.is_reader, self.readers = name, is_reader, readers
        self.steps: dict[int, StepState] = {}
        self.flushed = start
        self.next_step = start  # readers: the next step to announce
        self.end: int | None = None  # readers: no step >= end runs
        self.ends: dict[int, int] = {}  # others: reader index -> its end step

    def step(self, t: int) -> StepState:
        st = self.steps.get(t)
        if st is None:
            st = self.steps[t] = StepState()
        return st

    def complete(self, t: int) -> bool:
        """Every item of step t on this trainer has run (and, on a non-reader, every reader has
        announced its items of it)."""
        st = self.steps.get(t)
        if self.is_reader:
            return st is not None and st.done == st.items and t < self.next_step
        if st is None:
            return False
        return len(st.announced) == self.readers and st.done == st.items

    def finished(self) -> bool:
        """Every step of the run is pushed (a non-reader: once every reader told its end step)."""
        if self.is_reader:
            return self.end is not None and self.flushed >= self.end
        if len(self.ends) < self.readers:
            return False
        ends = set(self.ends.values())
        if len(ends) != 1:
            raise RuntimeError(f"{self.name}: reader trainers disagree on the last step: {self.ends}")
        return self.flushed >= ends.pop()

    def describe(self) -> str:
        """What a non-reader has heard from the readers (for a stall's error message)."""
        told = {t: sorted(s.announced) for t, s in self.steps.items()}
        return f"readers that announced each step: {told}; end steps from readers: {self.ends}"
