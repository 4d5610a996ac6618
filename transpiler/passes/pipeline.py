"""The passes of `transpile`, as a list (torch.fx's pass manager, kept small).

Each `Pass` names its function, the results it requires and the one it ensures (a field of
`Context`). `run_passes` runs them in order on one `Context`: it refuses a pass whose requirement
no earlier pass ensured, stores each pass's typed result (`transpiler.passes.types`), and lints the
program after every pass (`Program.lint`; after `split`, every sub-program), so a `LintError` names
the pass that broke an invariant.

append_backward -> assign_devices -> insert_ps -> insert_comm -> split -> segment_order; `transpile`
(transpiler/plan.py) makes the Plan from the results and verifies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transpiler.config import TranspileConfig
from transpiler.ir import LintError, Program, lint_segments
from transpiler.passes.assign_devices import assign_devices
from transpiler.passes.backward import append_backward
from transpiler.passes.insert_comm import insert_comm
from transpiler.passes.insert_ps import insert_ps
from transpiler.passes.segment_order import order_segments
from transpiler.passes.split import split
from transpiler.passes.types import Channels, Placement, SegmentOrder, Tables


@dataclass
class Context:
    """What the passes read and make: the program they change in place (a clone of the user's), the
    config, and each pass's result (None until the pass that ensures it ran)."""

    program: Program
    config: TranspileConfig
    loss: str | None = None  # append_backward: the loss var (None: a program without a loss)
    placement: Placement | None = None
    tables: Tables | None = None
    channels: Channels | None = None
    programs: dict[str, Program] | None = None  # split: trainer type -> sub-program
    segment_order: SegmentOrder | None = None


@dataclass(frozen=True)
class Pass:
    """One pass: `run(context)` returns the result stored as `context.<ensures>`."""

    name: str
    run: Callable[[Context], Any]
    requires: tuple[str, ...] = ()
    ensures: str = ""


def _backward(c: Context) -> str | None:
    """The loss (`attrs["loss_name"]`, else the output of the loss op); backward ops appended when
    the program has a loss but none (an ONNX import, a forward program)."""
    prog = c.program
    loss = prog.attrs.get("loss_name") or next(
        (op.output_names()[0] for op in prog.ops if op.role == "loss"), None
    )
    if loss and not any(op.role == "backward" for op in prog.ops):
        append_backward(prog, loss)
    return loss


def _split(c: Context) -> dict[str, Program]:
    assert c.placement is not None
    attrs = c.program.attrs
    return split(c.program, c.placement.trainer_types, c.loss, attrs.get("score_names"), attrs.get("tasks"))


PASSES: tuple[Pass, ...] = (
    Pass("append_backward", _backward, ensures="loss"),
    Pass("assign_devices", lambda c: assign_devices(c.program, c.config), ensures="placement"),
    Pass("insert_ps", lambda c: insert_ps(c.program, c.config), ("placement",), "tables"),
    Pass("insert_comm", lambda c: insert_comm(c.program), ("placement", "tables"), "channels"),
    Pass("split", _split, ("loss", "placement", "tables", "channels"), "programs"),
    Pass("segment_order", lambda c: order_segments(c.programs), ("programs",), "segment_order"),
)


def run_passes(passes: Sequence[Pass], context: Context) -> Context:
    """Run `passes` in order on `context` (changed in place, and returned), linting after each."""
    linted: dict[int, int] = {}  # id(program) -> its version when last linted
    _lint("the source program (a clone)", context, linted)
    made: list[str] = []
    for p in passes:
        missing = [r for r in p.requires if r not in made]
        if missing:
            raise ValueError(
                f"pass {p.name!r} requires {missing}, which no pass before it ensures (run so far: "
                f"{[q.name for q in passes[: passes.index(p)]]}); put the pass that makes it first"
            )
        result = p.run(context)
        if p.ensures:
            setattr(context, p.ensures, result)
            made.append(p.ensures)
        _lint(p.name, context, linted)
    return context


def _lint(name: str, c: Context, linted: dict[int, int]) -> None:
    """`Program.lint` of the sub-programs once split made them, else of the program, each skipped
    when its ops did not change since it was last linted (its run segments then still checked); a
    LintError names the pass `name` (and the trainer type)."""
    programs = {name: c.program}
    if c.programs:
        programs = {f"{name} (trainer {t})": p for t, p in c.programs.items()}
    for where, prog in programs.items():
        try:
            if linted.get(id(prog)) != prog.version:
                prog.lint()
                linted[id(prog)] = prog.version
            elif prog.segments is not None:
                lint_segments(prog)
        except LintError as e:
            raise LintError(f"after {where}: {e}") from None
