"""The driver's loop during a run: collect the processes' reports, hand steps to the History in
order, grant steps to the readers (until_loss, pauses), and name a process that failed or stopped."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from runtime.driver.history import History, TrainingError
from runtime.driver.pauses import Pauses
from runtime.driver.settings import ResolvedRun
from runtime.engines import Engine
from runtime.evaluation.metrics import auc
from runtime.telemetry.outputs import Telemetry, unpack_spans
from runtime.transport import reports
from runtime.transport.channels import Inbox, Outbox
from runtime.transport.messages import (
    TO_DRIVER,
    Done,
    Failed,
    Grant,
    Losses,
    Message,
    ProtocolError,
    Ready,
    Reports,
    StepReport,
    WriteBack,
    header,
    parse,
)
from runtime.transport.process_id import ProcessId

LOOKAHEAD = 3
LOSS_WINDOW = 10
STOPPED_S = 1.0  # a process the engine sees stopped this long is named as the run's failure


@dataclass
class _StepTally:
    """The driver's tally of one step: data readers that reported it, items, examples, loss reports
    received (`got`), summed loss, and the scores and labels for its AUC."""

    readers: int = 0
    items: int = 0
    examples: int = 0
    got: int = 0
    at: float = 0.0  # when its last report was made (the driver's clock)
    loss: float = 0.0
    scores: list = field(default_factory=list)
    labels: list = field(default_factory=list)


class Listener:
    """The driver's loop: collect reports, grant steps (until_loss), watch the processes."""

    def __init__(
        self,
        settings: ResolvedRun,
        eng: Engine,
        inbox: Inbox,
        out: Outbox,
        endpoints: dict[str, str],
        history: History,
        callback: Callable[[dict], None] | None,
        tel: Telemetry,
        pauses: Pauses,
        t0: float,
    ) -> None:
        self.settings, self.eng, self.inbox, self.out = settings, eng, inbox, out
        self.names = list(endpoints)
        self.endpoints, self.history, self.callback = endpoints, history, callback
        self.tel, self.pauses = tel, pauses
        self.readers = [n for n in self.names if ProcessId.parse(n).kind == settings.reader]
        self.steps: dict[int, _StepTally] = {}
        self.next = pauses.start  # next step to hand to the history
        self.grant, self.final = self.first_grant(), False
        self.ready: set[str] = set()
        self.done: set[str] = set()
        self.stopped: dict[str, float] = {}  # name -> when the engine first saw it stopped
        self.watched = 0.0  # when `watch` last looked at the processes
        self.pausing = False  # a pause (checkpoint, evaluation) is under way: no step advances
        self.t0, self.t_start = t0, time.perf_counter()
        history.started_at = self.t_start

    def run(self) -> None:
        last = checked = time.perf_counter()
        timeout = self.settings.stall_timeout
        while len(self.done) < len(self.names):
            msg = self.inbox.recv(200)
            now = time.perf_counter()
            if msg is not None:
                last = now
                self._handle(*msg)
            if now - checked >= 0.2:  # however busy the inbox, look at the processes 5 times a second
                checked = now
                self._check_processes()
                if now - last > timeout:
                    raise TrainingError(
                        "the run",
                        f"no report from any process for {timeout} s (finished: {sorted(self.done)})",
                    )
        self.history.wall_s = time.perf_counter() - self.t_start

    def _handle(self, h: dict, arrays: list) -> None:
        try:
            msg = parse(h, TO_DRIVER)
            now = time.perf_counter()
            if isinstance(msg, Reports):  # a trainer's step reports together (runtime/transport/reports.py)
                for sub, sub_arrays, age in reports.unpack(msg, arrays):
                    self._take(sub, sub_arrays, now - age)
            else:
                self._take(msg, arrays, now)
        except ProtocolError as e:
            raise TrainingError(h.get("who", "?"), f"sent an unknown report: {e}") from None
        self._advance()

    def _take(self, msg: Message, arrays: list, now: float) -> None:
        """Take one report, made at `now` (the driver's clock)."""
        if isinstance(msg, Failed):
            raise TrainingError(msg.who, "\n" + msg.traceback)
        if isinstance(msg, Ready):
            self.ready.add(msg.who)
            if len(self.ready) == len(self.names):
                self.t_start = self.history.started_at = now
                self.history.startup_s = now - self.t0
        elif isinstance(msg, StepReport):
            st = self.steps.setdefault(msg.step, _StepTally())
            st.readers, st.items, st.examples = (
                st.readers + 1,
                st.items + msg.items,
                st.examples + msg.examples,
            )
        elif isinstance(msg, Losses):
            self._tally_losses(msg, arrays)
        elif isinstance(msg, Done):
            self.done.add(msg.who)
            self.history.trainers[msg.who] = msg.stats
            if arrays:  # its trace spans
                self.tel.spans(msg.who, unpack_spans(arrays[0]))
        if isinstance(msg, (StepReport, Losses)):  # a step ends with its last report
            st = self.steps[msg.step]
            st.at = max(st.at, now)

    def _tally_losses(self, msg: Losses, arrays: list) -> None:
        st = self.steps.setdefault(msg.step, _StepTally())
        st.got += len(msg.items)
        mean = self.settings.loss_reduction == "mean"
        st.loss += sum(loss * (n if mean else 1) for n, loss in msg.items)
        if arrays and len(arrays) % 2 == 0:  # a (scores, labels) pair per task
            st.scores.append(arrays[0::2])
            st.labels.append(arrays[1::2])

    def _advance(self) -> None:
        """Hand completed steps to the history in order; grant more steps (until_loss)."""
        while (
            not self.pausing
            and (st := self.steps.get(self.next)) is not None
            and st.readers == len(self.readers)
            and st.got == st.items
        ):
            del self.steps[self.next]
            self._record(st)
            self.next += 1
            self._grant()

    def _record(self, st: _StepTally) -> None:
        h = self.history
        loss = st.loss / max(st.examples, 1) if self.settings.loss_reduction == "mean" else st.loss
        tasks = getattr(self.settings, "tasks", ())  # a multi-task plan's task names
        aucs, pairs, binary = _task_aucs(st)
        score, label = pairs[0] if pairs else (None, None)
        binary = bool(binary) and binary[0]
        h.loss.append(loss)
        h.auc.append(aucs[0] if aucs else float("nan"))
        for name, a in zip(tasks, aucs, strict=False):
            h.task_auc.setdefault(name, []).append(a)
        h.examples.append(st.examples)
        h.time.append(max(st.at - self.t_start, h.time[-1] if h.time else 0.0))  # (in step order)
        if binary:
            h.scores.append((score, label))
            del h.scores[:-100]
        if self.callback is not None:
            self.callback(
                {
                    "step": self.next,
                    "loss": loss,
                    "auc": h.auc[-1],
                    "examples": st.examples,
                    "time": h.time[-1],
                    **({"task_auc": dict(zip(tasks, aucs, strict=False))} if tasks else {}),
                }
            )

    def first_grant(self) -> int | None:
        """The grant of the run's first step (`grant_at`): readers start with it."""
        return self.grant_at(self.pauses.start)

    def grant_at(self, step: int) -> int | None:
        """Once steps < `step` are recorded, readers may start steps < this (None: any step):
        LOOKAHEAD steps ahead for until_loss, and never past the next pause (a checkpoint or
        evaluation: runtime/driver/pauses.py)."""
        limits = [step + LOOKAHEAD] if self.settings.until_loss is not None else []
        pause = self.pauses.next_pause(step)
        if pause is not None:
            limits.append(pause)
        return min(limits, default=None)

    def _grant(self) -> None:
        if self.pauses.due(self.next):
            for t in set(self.settings.held.values()):  # (their trainer writes held tables back first)
                self.out.send(self.endpoints[str(ProcessId(t, 0))], header(WriteBack(self.next)))
            self.pausing = True
            try:
                self.pauses.pause(self.next, self.history, self.tel)
            except TrainingError:
                raise  # (a process the watch named while the pause waited for it)
            except Exception as e:
                raise TrainingError(
                    f"the pause at step {self.next} (checkpoint / evaluation)", f"{type(e).__name__}: {e}"
                ) from e
            finally:
                self.pausing = False
        until = self.settings.until_loss
        if self.final or (until is None and self.grant is None):  # (None: readers run to the end)
            return
        if until is not None:
            recent = self.history.loss[-LOSS_WINDOW:]
            if len(recent) == LOSS_WINDOW and np.mean(recent) <= until:
                self.final = True
        if not self.final:
            self.grant = self.grant_at(self.next)
        for r in self.readers:
            self.out.send(self.endpoints[r], header(Grant(self.grant, self.final)))

    def watch(self) -> None:
        """What `run` does five times a second, for the driver's waits outside it (the shards'
        start-up, a pause's save, applied-count wait or evaluation: the driver's PSClient calls it
        while a request waits): raise TrainingError naming a process that failed or stopped."""
        now = time.perf_counter()
        if now - self.watched >= 0.2:
            self.watched = now
            self._check_processes()

    def _check_processes(self) -> None:
        """Raise TrainingError for a process that ended before it finished its part."""
        self.stopped = watch_processes(self.eng, self.done, self._recv, self.stopped)

    def _recv(self, timeout_ms: float) -> None:
        msg = self.inbox.recv(timeout_ms)
        if msg is not None:
            self._handle(*msg)


def watch_processes(
    eng: Engine, done: set[str], recv: Callable[[float], None], stopped: dict[str, float]
) -> dict[str, float]:
    """Raise TrainingError naming a process of `eng` that ended before it was `done` (a server, never
    done, always), after `recv(ms)` (receive and handle one report) had half a second to take its
    last reports or traceback, or one the engine has seen stopped for STOPPED_S; else return the
    stopped ones with since when (pass it back in the next call)."""
    for name, failure in eng.ended().items():
        if failure is None and name in done:
            continue
        deadline = time.perf_counter() + 0.5  # its last reports (or traceback) may be on the way
        while time.perf_counter() < deadline and name not in done:
            recv(50)
        if name in done and failure is None:
            continue
        raise TrainingError(name, failure.how if failure else "exited before the run finished")
    now, stalled = time.perf_counter(), eng.stalled()
    stopped = {name: stopped.get(name, now) for name in stalled}
    for name, since in stopped.items():
        if now - since >= STOPPED_S:
            raise TrainingError(
                name, f"{stalled[name]} for {now - since:.1f} s; the run cannot go on without it"
            )
    return stopped


def _task_aucs(st: _StepTally) -> tuple[list[float], list[tuple[np.ndarray, np.ndarray]], list[bool]]:
    """Per task (one for a single-task plan): the AUC of the step's predictions when its labels
    are binary (NaN otherwise), the (scores, labels) it ranked and whether the labels are binary."""
    if not st.scores:
        return [], [], []
    pairs = [
        (np.concatenate([s[k] for s in st.scores]), np.concatenate([y[k] for y in st.labels]))
        for k in range(len(st.scores[0]))
    ]
    binary = [bool(((y == 0) | (y == 1)).all()) for _, y in pairs]
    aucs = [auc(y, s) if b else float("nan") for (s, y), b in zip(pairs, binary, strict=True)]
    return aucs, pairs, binary
