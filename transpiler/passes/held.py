"""Which dense tables a trainer keeps: those only one trainer process of a run ever reads or updates.

A dense table that one trainer alone pulls and pushes gains nothing from a parameter server: every
step it would travel to the shard and back whole (the gpu trainer's MLP: 2 MB each way per step),
only for the shard to apply that one trainer's gradient. Such a table is *held* by its trainer
instead (as Paddle's heter PS keeps the dense parameters on its GPU trainers): the trainer takes
the table's state from the servers when it starts, applies each step's gradient itself with the
table's own optimizer (`runtime.ps.held_tables`), and writes the state back before every checkpoint and
evaluation and at the end of the run. The arithmetic is the servers' (one optimizer step per
trainer step, in step order), so a sync run is unchanged to the bit.

`held_dense` decides it from the plan alone: a dense table with an optimizer, not clipped by global
norm (a clipped step needs every table's gradient on the servers, runtime/ps/clip.py), whose pulls
and pushes are all in one trainer type's program, of which the run starts one trainer. The cost
model (transpiler/cost/model.py) and the runtime (runtime/driver/train.py) both ask it.
"""

from __future__ import annotations

from typing import Any

from transpiler.tables import TableSpec

DENSE_OPS = ("pull_dense", "push_dense")


def held_dense(programs: dict[str, Any], tables: list[TableSpec], counts: dict[str, int]) -> dict[str, str]:
    """{table: the trainer type that holds it} for the dense tables one trainer process alone uses
    (`programs`: trainer type -> its Program; `counts`: trainers per type)."""
    users: dict[str, set[str]] = {}
    pushed: set[str] = set()
    for t, prog in programs.items():
        for op in prog.ops:
            if op.type in DENSE_OPS:
                users.setdefault(op.attrs["table"], set()).add(t)
                if op.type == "push_dense":
                    pushed.add(op.attrs["table"])
    out = {}
    for spec in tables:
        types = users.get(spec.name, set())
        if (
            spec.kind == "dense"
            and spec.optimizer is not None
            and spec.clip_norm is None
            and spec.name in pushed
            and len(types) == 1
            and counts.get(next(iter(types))) == 1
        ):
            out[spec.name] = next(iter(types))
    return out
