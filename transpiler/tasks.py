"""Tasks: the per-task loss and label facts of a multi-task program.

A multi-task program trains several outputs, each against its own label feed with its own loss
(ESMM: pCTR against the click, pCTCVR = pCTR x pCVR against click-and-buy, both over all
impressions). Its loss (`attrs["loss_name"]`) is the weighted sum of the task losses, so one
backward pass over that sum trains every task. `attrs["tasks"]` lists the tasks in order as
dicts (a Program round-trips through JSON), read back as `Task` records by `tasks_of`;
`attrs["score_names"]` holds the pairs [pred_1, label_1, pred_2, label_2, ...] the AUCs rank.
A single-task program has no `tasks` attr and one [pred, label] pair.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from transpiler.ir import Program


@dataclass(frozen=True)
class Task:
    """One task: its name, the prediction it scores (`pred`), its label feed, its loss kind
    (bce, bce_with_logits, mse), the var holding its mean loss and its weight in the total."""

    name: str
    pred: str
    label: str
    kind: str
    loss: str
    weight: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def set_tasks(program: Program, tasks: list[Task]) -> None:
    """Record `tasks` on `program` (attrs["tasks"], and their [pred, label] pairs as score_names)."""
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names must be unique, got {names}")
    program.attrs["tasks"] = [t.to_dict() for t in tasks]
    program.attrs["score_names"] = [n for t in tasks for n in (t.pred, t.label)]


def tasks_of(program: Program) -> list[Task]:
    """The program's tasks in order ([] for a single-task program)."""
    return [Task(**d) for d in program.attrs.get("tasks") or ()]


def task_names(programs: dict[str, Program] | list[Program]) -> list[str]:
    """The task names of whichever of `programs` records them (a plan's loss sub-program)."""
    progs = programs.values() if isinstance(programs, dict) else programs
    return next(([t.name for t in tasks_of(p)] for p in progs if p.attrs.get("tasks")), [])


def add_total_loss(program: Program, tasks: list[Task], name: str = "loss") -> str:
    """Append the weighted sum of the tasks' losses (a `scale` per weight other than 1, one `sum`)
    as the program's loss, record the tasks (`set_tasks`) and return the loss's name."""
    block = program.global_block()
    terms = []
    for t in tasks:
        if t.weight == 1.0:
            terms.append(t.loss)
            continue
        scaled = _unused(block, f"{t.loss}_weighted")
        block.create_var(scaled, shape=(), dtype=block.var(t.loss).dtype)
        program.append_op("scale", {"X": [t.loss]}, {"Out": [scaled]}, {"scale": t.weight, "bias": 0.0})
        terms.append(scaled)
    total = _unused(block, name)
    block.create_var(total, shape=(), dtype=block.var(tasks[0].loss).dtype)
    program.append_op("sum", {"data_0": terms}, {"sum": [total]})
    program.attrs["loss_name"] = total
    set_tasks(program, tasks)
    return total


def _unused(block: Any, base: str) -> str:
    name, k = base, 0
    while block.has_var(name):
        k += 1
        name = f"{base}_{k}"
    return name
