"""What `train`'s driver does between steps: periodic checkpoints and held-out evaluation.

At a pause step b (a multiple of `checkpoint_every` or `eval_every`, before the run's last step)
readers may not start step b (the driver grants steps < b only); once the driver has handed step
b-1 to the History it waits until the servers have applied every push of the steps before b
(`checkpoints.wait_applied`), then saves `DIR/step-b` (`checkpoints.save`) and / or evaluates
`eval_data` with the current tables (`forward.evaluate_with`, peek pulls: nothing changes), then
grants the next steps. At the end of the run the same happens once more (a final checkpoint, a
final evaluation). A pause stops the readers for as long as it takes: a save or an evaluation
longer than `stall_timeout` makes the waiting trainers give up, so keep held-out sets modest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.driver import checkpoints
from runtime.evaluation.forward import batches_of, check_grouping, client_source, evaluate_grouped
from runtime.ps import PSClient
from transpiler.exporters.servable import ForwardGraph, forward_graph
from transpiler.plan import Plan


@dataclass
class Pauses:
    plan: Plan
    data: Any
    start: int  # the run's first step (a resumed run: the checkpoint's step)
    end: int | None  # steps=, when given (no pause at or after it)
    pushes: dict[str, int]  # pushes per step and table (trainers that push it)
    settings: dict[str, Any]
    root: Path | None = None  # checkpoint directory
    every: int | None = None
    keep: int = 2
    eval_data: Any = None
    eval_every: int | None = None
    timeout: float = 60.0
    output: str | None = None  # the prediction the evaluation scores (None: found)
    graph: ForwardGraph | None = None
    client: PSClient | None = None  # the driver's (admin) client, set once the servers run
    saved: list[int] = field(default_factory=list)
    evaluated: list[int] = field(default_factory=list)
    group: str | None = None  # the column of the held-out GAUC (None: none)
    slice_by: str | None = None  # the column of the held-out per-slice figures (None: none)

    def __post_init__(self) -> None:  # (the values were checked by their records: driver/settings.py)
        if self.eval_data is not None:
            self.graph = forward_graph(self.plan, self.output)  # a plan whose prediction is unclear fails now
        if self.group is not None or self.slice_by is not None:  # an unknown column fails now too
            first = next(iter(batches_of(self.eval_data)), None)
            check_grouping(self.graph, self.group, self.slice_by, self.eval_data, first)

    def _periods(self) -> list[int]:
        return [p for p in (self.every, self.eval_every) if p is not None]

    def next_pause(self, step: int) -> int | None:
        """The first pause step after `step` (None: no more pauses)."""
        got = [(step // p + 1) * p for p in self._periods()]
        b = min(got, default=None)
        return None if b is None or (self.end is not None and b >= self.end) else b

    def due(self, step: int) -> bool:
        return (
            step > self.start
            and any(step % p == 0 for p in self._periods())
            and (self.end is None or step < self.end)
        )

    def pause(self, step: int, history: Any, tel: Any) -> None:
        """At pause step `step`: wait for the servers, then save and / or evaluate as due."""
        checkpoints.wait_applied(
            self.client, {t: (step - self.start) * n for t, n in self.pushes.items()}, self.timeout
        )
        if self.every is not None and step % self.every == 0:
            self.save(step)
        if self.eval_every is not None and step % self.eval_every == 0:
            self.evaluate(step, history, tel)

    def finish(self, step: int, history: Any, tel: Any) -> None:
        """The end of the run (every process done): the final evaluation (the final save is `save`)."""
        if self.eval_data is not None and step not in self.evaluated:
            self.evaluate(step, history, tel)

    def save(self, step: int) -> Path | None:
        if self.root is None or step in self.saved:
            return None
        state = checkpoints.run_state(self.plan, step, self.data, self.settings)
        path = checkpoints.save(self.client, self.root, state, self.keep)
        self.saved.append(step)
        return path

    def evaluate(self, step: int, history: Any, tel: Any) -> None:
        got = evaluate_grouped(
            self.graph,
            client_source(self.client),
            self.eval_data,
            self.plan.loss_reduction,
            self.group,
            self.slice_by,
        )
        record = {"step": step, **got}
        history.eval.append(record)
        tel.eval(record)
        self.evaluated.append(step)


def resume_state(plan: Plan, resume: str | None, steps: int | None) -> tuple[Path | None, int]:
    """(the checkpoint to load, the step to start at) for `train(resume=...)`."""
    if resume is None:
        return None, 0
    path = checkpoints.latest(resume)
    state = checkpoints.check_resume(plan, path)
    if steps is not None and state.step >= steps:
        raise ValueError(
            f"checkpoint {str(path)!r} is at step {state.step}, so steps={steps} (which counts "
            "the whole run) has nothing left to train; ask for more steps"
        )
    return path, state.step
