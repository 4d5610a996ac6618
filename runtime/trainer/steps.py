"""A trainer's step book: the steps it knows of, which it may start (the driver's grant), which are
complete, how far it has pushed, and when its run ends (see `runtime.trainer.process` for how steps
flow). The trainer tells the book what happens; the book refuses what cannot happen (a step pushed
twice or out of order, more items done than known, a grant that goes back)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class StepState:
    """One step on one trainer: its items and how many have run, what its readers announced, its
    pulled tables and accumulated gradients (`PSAccess`), its items' reports and message leases."""

    items: int = 0  # items of this step on this trainer (known so far)
    done: int = 0
    announced: set[int] = field(default_factory=set)  # readers whose announcement arrived
    dense: dict[str, Any] = field(default_factory=dict)  # pulled dense tables
    grads: dict[str, Any] = field(default_factory=dict)  # accumulated dense gradients
    summed: set[str] = field(default_factory=set)  # dense tables whose gradient is a buffer of ours
    rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)  # sparse
    # sparse, per item: (ids, rows) with one row per lookup of the item's prefetched feed, in order
    fed_rows: dict[str, dict[tuple, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    # a table with show/click, per item: (its ids' occurrences, [n, 2] float32 (1, label) of each)
    shows: dict[str, dict[tuple, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    reports: list[tuple[int, float, list]] = field(default_factory=list)  # (size, loss, [score, label])
    leases: list[Any] = field(default_factory=list)  # release() of its messages read in place

    def add_items(self, n: int) -> None:
        """n more items of this step run on this trainer."""
        self.items += n

    def item_done(self, t: int, report: tuple[int, float, list] | None = None) -> None:
        """One of step t's items has run all its segments (`report`: its size, loss and scores)."""
        if self.done >= self.items:
            raise RuntimeError(f"step {t}: an item finished beyond the {self.items} items known of it")
        self.done += 1
        if report is not None:
            self.reports.append(report)

    def release_leases(self) -> None:
        """Hand back the step's messages read in place (once its push is made)."""
        for release in self.leases:
            release()
        self.leases.clear()


@dataclass
class Ahead:
    """A sync reader's next step, made while the current one runs: its share of a global batch,
    (batch, n, lo, hi) with rows [lo, hi) of batch its share of n (None: the run ends before the
    step), and its items."""

    step: int
    got: tuple | None
    items: list[Any]


class StepBook:
    """Steps of one trainer. A reader makes its steps (`start`, `end_at`) as far as the driver's
    grant lets it (`grant`, `granted`) and up to `last`; any other trainer learns them from the
    readers' announcements (`announce`) and end steps (`reader_ended`). Items run (`item_done`);
    steps < `flushed` are pushed (`to_push`, `complete`); a resumed run starts at `start`."""

    def __init__(
        self,
        name: str,
        is_reader: bool,
        readers: int,
        start: int = 0,
        grant: int | None = None,
        last: int | None = None,
    ) -> None:
        self.name, self.is_reader, self.readers = name, is_reader, readers
        self.steps: dict[int, StepState] = {}
        self.flushed = start
        self.next_step = start  # readers: the next step to announce
        self.end: int | None = None  # readers: no step >= end runs
        self.ends: dict[int, int] = {}  # others: reader index -> its end step
        self.upto, self.final = grant, False  # readers start steps < upto (None: any), see `grant`
        self.last = last  # readers: no step >= last runs (None: as far as the data and grants go)

    def step(self, t: int) -> StepState:
        st = self.steps.get(t)
        if st is None:
            st = self.steps[t] = StepState()
        return st

    # -- what happens to steps ------------------------------------------------------------------
    def start(self, t: int, items: int) -> StepState:
        """A reader starts step t (the next one) with `items` items of its own."""
        if t != self.next_step or self.end is not None:
            raise RuntimeError(
                f"{self.name}: cannot start step {t}: the next step is {self.next_step}"
                + (f" and the run ends at step {self.end}" if self.end is not None else "")
            )
        st = self.step(t)
        st.add_items(items)
        self.next_step = t + 1
        return st

    def end_at(self, t: int) -> None:
        """A reader's run ends before step t (the next one): no step >= t runs."""
        if self.end is not None or t != self.next_step:
            raise RuntimeError(
                f"{self.name}: cannot end the run at step {t}: the next step is {self.next_step}"
                + (f" and it already ends at step {self.end}" if self.end is not None else "")
            )
        self.end = t

    def announce(self, t: int, origin: int, items: int) -> None:
        """Reader `origin` announced its step t, of which `items` items run here."""
        st = self.step(t)
        if origin in st.announced:
            raise RuntimeError(f"{self.name}: reader {origin} announced step {t} twice")
        st.announced.add(origin)
        st.add_items(items)

    def reader_ended(self, origin: int, t: int) -> None:
        """Reader `origin` runs no step >= t."""
        if self.ends.get(origin, t) != t:
            before = self.ends[origin]
            raise RuntimeError(f"{self.name}: reader {origin} ended the run at step {t}, before at {before}")
        self.ends[origin] = t

    def item_done(self, t: int, report: tuple[int, float, list] | None = None) -> None:
        """One item of step t has run all its segments (`report`: its size, loss and scores)."""
        if t < self.flushed:
            raise RuntimeError(f"{self.name}: an item of step {t} finished after the step was pushed")
        self.step(t).item_done(t, report)

    def lease(self, t: int, release: Any) -> None:
        """A message of step t is read in place until the step is pushed; then `release()`."""
        self.step(t).leases.append(release)

    def to_push(self) -> StepState | None:
        """The oldest step not pushed yet, when complete (else None)."""
        return self.steps.get(self.flushed) if self.is_complete(self.flushed) else None

    def complete(self, t: int) -> StepState:
        """Step t (the oldest not pushed yet, complete) is pushed: forget it; return its state."""
        if t < self.flushed:
            raise RuntimeError(f"{self.name}: step {t} was pushed already (steps < {self.flushed} are)")
        if t > self.flushed:
            raise RuntimeError(f"{self.name}: step {t} cannot be pushed before step {self.flushed}")
        if not self.is_complete(t):
            raise RuntimeError(f"{self.name}: step {t} cannot be pushed: {self._progress(t)}")
        self.flushed = t + 1
        return self.steps.pop(t)

    def grant(self, upto: int | None, final: bool) -> None:
        """The driver's grant: a reader may start steps < upto (None: any); `final`: no step >= upto
        runs. Grants only go forward."""
        backwards = upto is not None and (self.upto is None or upto < self.upto)
        if self.final or backwards:
            raise RuntimeError(
                f"{self.name}: a grant of steps < {upto} (final: {final}) after the grant of steps "
                f"< {self.upto} (final: {self.final}): grants only go forward"
            )
        self.upto, self.final = upto, final

    # -- what the book says ---------------------------------------------------------------------
    def granted(self, t: int) -> bool:
        """Whether a reader may make step t now (past a final grant: to end the run there)."""
        return self.upto is None or t < self.upto or self.final

    def ends_before(self, t: int) -> bool:
        """Whether the run ends before step t: past the last step, or past a final grant."""
        return (self.last is not None and t >= self.last) or (
            self.final and self.upto is not None and t >= self.upto
        )

    def is_complete(self, t: int) -> bool:
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

    def _progress(self, t: int) -> str:
        st = self.steps.get(t)
        if st is None:
            return "nothing of it is known yet"
        told = "" if self.is_reader else f", announced by readers {sorted(st.announced)} of {self.readers}"
        return f"{st.done} of its {st.items} items have run{told}"

    def describe(self) -> str:
        """What a non-reader has heard from the readers (for a stall's error message)."""
        told = {t: sorted(s.announced) for t, s in self.steps.items()}
        return f"readers that announced each step: {told}; end steps from readers: {self.ends}"
