"""Pass 5, split: one sub-program per trainer type, its ops in the original (global) order.

Each sub-program keeps op ids (so `fwd_id`, placement reasons and channels still refer to them),
holds the vars its ops mention, and records `trainer_type`, its `feeds` (data ops) and, when the
loss is computed there, `loss_name`. Parameter values stay out: trainers pull them.
"""

from __future__ import annotations

from transpiler.ir import Op, Program


def split(
    program: Program,
    trainer_types: list[str] | None = None,
    loss_name: str | None = None,
    score_names: list[str] | None = None,
    tasks: list[dict] | None = None,
) -> dict[str, Program]:
    """{trainer type: sub-program} of a placed program, in `trainer_types` order (then the others, in
    the order their first op comes). The sub-program that computes `loss_name` records it, and
    `score_names` ([prediction, label] pairs for the AUCs) when it holds them, and the `tasks` of a
    multi-task program (transpiler/tasks.py).

    The sub-programs take `program`'s Op objects (no copies: transpile owns the program it splits);
    split a `program.clone()` to keep using the original. Vars are copied per sub-program.
    """
    groups: dict[str, list[Op]] = {}
    names: dict[str, dict[str, None]] = {}
    loss = loss_name
    loss_dev = None
    for op in program.ops:
        dev = op.attrs.get("op_device")
        if not dev or dev == "ps":
            raise ValueError(
                f"op {op.type!r} (id {op.id}) has op_device {dev!r}; run assign_devices "
                "and insert_ps (which moves optimizer ops to the server) before split"
            )
        if dev not in groups:
            groups[dev], names[dev] = [], {}
        groups[dev].append(op)
        seen = names[dev]
        for slots in (op.inputs, op.outputs):
            for vs in slots.values():
                seen.update(dict.fromkeys(vs))
        if (
            loss_dev is None
            and op.attrs.get("op_role") != "comm"
            and loss in seen
            and any(loss in vs for vs in op.outputs.values())
        ):
            loss_dev = dev
    order = [t for t in trainer_types or [] if t in groups]
    order += [t for t in groups if t not in order]
    block_vars = program.global_block().vars
    out = {}
    for dev in order:
        sub = Program()
        sub._next_id = program._next_id
        sub.global_block().vars = {n: block_vars[n].copy() for n in names[dev] if n in block_vars}
        sub.global_block().set_ops(groups[dev])
        sub.attrs = {
            "trainer_type": dev,
            "feeds": [op.outputs["Out"][0] for op in groups[dev] if op.type == "data"],
        }
        if dev == loss_dev:
            _record_loss(sub, loss, score_names, tasks)
        out[dev] = sub
    return out


def _record_loss(
    sub: Program, loss: str | None, score_names: list[str] | None, tasks: list[dict] | None
) -> None:
    """The loss sub-program's `loss_name`, its `score_names` when it holds them all, and the tasks of
    a multi-task program (whose predictions and labels must all be there, for their AUCs)."""
    sub.attrs["loss_name"] = loss
    held = [n for n in score_names or () if n in sub.global_block().vars]
    if score_names and len(held) == len(score_names):
        sub.attrs["score_names"] = list(score_names)
    if not tasks:
        return
    if away := [n for n in score_names or () if n not in held]:
        raise ValueError(
            f"the tasks' predictions and labels must reach the trainer type {sub.attrs['trainer_type']!r} "
            f"that computes the loss, for their AUCs; {away} do not (name the values the task losses read)"
        )
    sub.attrs["tasks"] = [dict(t) for t in tasks]
