"""Show/click from training: which label feed counts the clicks of which sparse table's rows.

A sparse table with a `lifecycle` (runtime/ps/lifecycle.py, Paddle's `CtrCommonAccessor`) keeps per
row a show and a click count. They come from training, as Paddle's `PushSparseVarsWithLabelAsync`
does: each looked-up id occurrence shows once and clicks by its sample's label. `record_show_click`
(run by `transpile` after the split) finds, per such table, the label feed (the first task's label:
the prediction/label pair of the loss, `transpiler.exporters.forward.score_names`) and the id feeds
whose `unique_ids` the table's rows are pulled for, and records them on the reader's sub-program
(`attrs["show_click"]`, a list of `ShowClick` dicts, so a saved plan keeps them); the reader's
trainers send them with their sparse pushes (runtime/trainer/ps_access.py).

Refused with a PlanError naming the table: a lifecycle table whose lookups are not on the trainer
type that reads the label (its trainers could not pair ids with labels), whose lookup ids are not a
feed (an occurrence must map to one sample), or a plan with no label feed to count clicks from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transpiler.errors import PlanError
from transpiler.exporters.forward import score_names
from transpiler.ir import Program
from transpiler.tables import TableSpec

ATTR = "show_click"


@dataclass(frozen=True)
class ShowClick:
    """Table `table`'s rows count shows and clicks: each occurrence of an id in the feeds `ids`
    shows once, and clicks by the value of feed `label` for its sample (row of the feed)."""

    table: str
    label: str
    ids: tuple[str, ...]


def show_click_of(program: Program) -> dict[str, ShowClick]:
    """{table: its ShowClick} recorded on `program` ({} on a trainer type that sends none)."""
    out = {}
    for d in program.attrs.get(ATTR) or ():
        out[d["table"]] = ShowClick(d["table"], d["label"], tuple(d["ids"]))
    return out


def _label(programs: dict[str, Program]) -> str | None:
    """The label feed of the (first task's) loss, found in whichever sub-program holds it."""
    return next((names[1] for p in programs.values() if (names := score_names(p))), None)


def _lookup_feeds(program: Program, table: str) -> list[str | None]:
    """Per pull of `table` in `program`: the feed its ids are the `unique_ids` of (None: not a feed)."""
    made = {n: op for op in program.ops for n in op.output_names()}
    feeds = set(program.attrs.get("feeds") or ())
    out: list[str | None] = []
    for op in program.ops:
        if op.type == "pull_sparse" and op.attrs.get("table") == table:
            src = made.get(op.inputs["Ids"][0])
            x = src.inputs["Ids"][0] if src is not None and src.type == "unique_ids" else None
            out.append(x if x in feeds else None)
    return out


def record_show_click(programs: dict[str, Program], tables: list[TableSpec]) -> dict[str, ShowClick]:
    """Record on the reader's sub-program the ShowClick of every sparse table with a lifecycle (see
    the module docstring); PlanError listing every table it cannot be made for."""
    life = [t.name for t in tables if t.kind == "sparse" and t.lifecycle is not None]
    if not life:
        return {}
    readers = [t for t, p in programs.items() if p.attrs.get("feeds")]
    label = _label(programs)
    if label is None or len(readers) != 1 or label not in programs[readers[0]].attrs["feeds"]:
        raise PlanError(
            f"tables {life} have a lifecycle (show/click from the labels) but the plan has no label "
            f"feed read by one trainer type (label {label!r}, reader types {readers}): give the "
            "program a loss over a label feed, or drop `lifecycle`"
        )
    reader, out, problems = readers[0], {}, []
    for table in life:
        where = [t for t, p in programs.items() if _lookup_feeds(p, table)]
        feeds = _lookup_feeds(programs[reader], table)
        if where != [reader]:
            problems.append(
                f"table {table!r}: its lookups run on trainer types {where}, but the label "
                f"{label!r} is read on {reader!r}: place the lookups on {reader!r} (e.g. "
                f"config.op_type_devices={{'embedding': ...}}) or drop `lifecycle`"
            )
        elif None in feeds:
            problems.append(
                f"table {table!r}: a lookup's ids are not a feed of {reader!r}, so its occurrences "
                "cannot be paired with a sample's label: look up feed ids directly or drop `lifecycle`"
            )
        else:
            out[table] = ShowClick(table, label, tuple(dict.fromkeys(feeds)))
    if problems:
        raise PlanError("show/click statistics cannot be counted:\n  " + "\n  ".join(problems))
    programs[reader].attrs[ATTR] = [{**asdict(s), "ids": list(s.ids)} for s in out.values()]
    return out
