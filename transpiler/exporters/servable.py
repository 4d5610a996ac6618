"""The forward graph of a Plan, for evaluation, prediction and a servable ONNX export.

`forward_graph(plan)` joins the forward parts of every trainer type's sub-program into one Program:
forward and loss ops plus the parameter-server pulls (`pull_dense`, `unique_ids` + `pull_sparse`),
with the send/recv pairs dropped (a recv's output has the name of the tensor sent) and backward,
push and optimizer ops gone. Ops keep their ids; they are put in an order where every input is
made before it is read. The prediction output is the one forward result that no op reads and that
is not the loss (e.g. `sigmoid(logit)`); name it with `output=` when a program has several. A
multi-task plan (transpiler/tasks.py) predicts every task's output (`ForwardGraph.outputs`).
The runtime runs this graph with the pulls answered by the parameter servers or a checkpoint
(`runtime.evaluate`); `servable_program` turns the pulls into parameters for `to_onnx`.

`export_inference(plan, path, values)` writes one standard ONNX model (default domain only): the
inputs are the plan's feeds the prediction needs (never the label), the output is the prediction
(a multi-task plan: one output per task, named as in the plan),
every table is an initializer holding `values` (a sparse table as its full [vocab, dim] array; an
embedding lookup becomes a Gather over the raw ids). Models over 2 GB keep their initializers in
an external data file beside `path` (ONNX's external data format).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ops_registry import get_op
from transpiler.exporters.forward import score_names
from transpiler.ir import Op, Program, Var
from transpiler.tasks import Task, tasks_of

if TYPE_CHECKING:
    from transpiler.plan import Plan

PULLS = ("pull_dense", "pull_sparse", "unique_ids")
ONNX_LIMIT = 2 * 1024**3 - 64 * 1024**2  # protobuf's 2 GB, less room for the graph itself


@dataclass
class ForwardGraph:
    """The forward ops of a whole plan (see the module docstring)."""

    program: Program
    feeds: list[str]  # what the prediction needs from the data (the label excluded)
    label_feeds: list[str]  # feeds only the loss reads
    output: str  # the prediction (a multi-task plan's: its first task's)
    loss: str | None
    tasks: list[Task] = field(default_factory=list)  # a multi-task plan's, predicting them all

    @property
    def outputs(self) -> list[str]:
        """The predictions: every task's for a multi-task graph, else the one output."""
        return [t.pred for t in self.tasks] or [self.output]

    def pruned(self, targets: list[str]) -> Program:
        """The graph with only the ops `targets` need (a copy)."""
        return _prune(self.program, targets)


def forward_graph(plan: Plan, output: str | None = None) -> ForwardGraph:
    """The forward graph of `plan`, predicting `output` (default: see the module docstring)."""
    ops = [
        op
        for prog in plan.programs.values()
        for op in prog.ops
        if op.role in ("forward", "loss") or op.type in PULLS
    ]
    prog = Program()
    block = prog.global_block()
    for p in plan.programs.values():
        for name, var in p.vars.items():
            block.vars.setdefault(name, var.copy())
    block.set_ops(_ordered([op.copy() for op in ops]))
    for op in block.ops:
        if "training_mode" in get_op(op.type, where=f"op id {op.id}").attrs:
            block.update_op(op, attrs={"training_mode": 0})  # dropout and the like: inference behaviour
    feeds = [op.outputs["Out"][0] for op in block.ops if op.type == "data"]
    read = {n for op in block.ops for n in op.input_names()}
    sinks = [n for op in block.ops if op.type != "data" for n in op.output_names() if n not in read]
    tasks = next((t for p in plan.programs.values() if (t := tasks_of(p))), []) if output is None else []
    if tasks:
        output = tasks[0].pred
    if output is None:
        loss_deps = _ancestors(block.ops, [plan.loss_name]) if plan.loss_name else set()
        found = [n for n in sinks if n != plan.loss_name and n not in loss_deps]
        scored = next((s[0] for p in plan.programs.values() if (s := score_names(p))), None)
        if not found and scored is not None:  # the loss reads the prediction (an attached ONNX loss)
            found = [scored]
        if len(found) != 1:
            raise ValueError(
                f"cannot tell the plan's prediction output: forward results no op reads "
                f"(besides the loss {plan.loss_name!r}): {found or 'none'}; name it with "
                "output=..."
            )
        output = found[0]
    elif not any(output in op.output_names() for op in block.ops):
        raise ValueError(
            f"output {output!r} is not made by a forward op of the plan; forward results no op reads: {sinks}"
        )
    needed = _ancestors(block.ops, [t.pred for t in tasks] or [output])
    return ForwardGraph(
        prog,
        [f for f in feeds if f in needed],
        [f for f in feeds if f not in needed],
        output,
        plan.loss_name,
        tasks,
    )


def _ordered(ops: list[Op]) -> list[Op]:
    """`ops` in an order where each op's inputs are made before it (parameters come from pulls)."""
    made = {n for op in ops for n in op.output_names()}
    have: set[str] = set()
    out, pending = [], list(ops)
    while pending:
        ready = [op for op in pending if all(n in have or n not in made for n in op.input_names())]
        if not ready:
            raise ValueError(
                f"the plan's forward ops form a cycle or read unmade values: "
                f"{[str(op) for op in pending[:3]]}"
            )
        for op in ready:
            out.append(op)
            have.update(op.output_names())
        pending = [op for op in pending if op not in ready]
    return out


def _ancestors(ops: list[Op], targets: list[str]) -> set[str]:
    need = set(targets)
    for op in reversed(ops):
        if need & set(op.output_names()):
            need.update(op.input_names())
    return need


def _prune(program: Program, targets: list[str]) -> Program:
    out = program.clone()
    block = out.global_block()
    need = set(targets)
    kept = []
    for op in reversed(block.ops):
        if need & set(op.output_names()):
            kept.append(op)
            need.update(op.input_names())
    block.set_ops(kept[::-1])
    used = {n for op in block.ops for n in op.input_names() + op.output_names()}
    block.vars = {n: v for n, v in block.vars.items() if n in used}
    return out


def servable_program(graph: ForwardGraph, tables: dict[str, np.ndarray]) -> Program:
    """The prediction part of `graph` with its pulls replaced by parameters holding `tables`
    (full arrays by table name): `pull_dense` outputs become parameters, and an embedding that
    gathers pulled rows (`unique_ids` -> `pull_sparse` -> embedding(W=rows, Ids=Index)) gathers
    from the whole table with the raw ids."""
    prog = graph.pruned(graph.outputs)
    block = prog.global_block()
    made = {n: op for op in block.ops for n in op.output_names()}
    params: dict[str, np.ndarray] = {}
    kept = []
    for op in block.ops:
        if op.type == "pull_dense":
            params[op.outputs["Out"][0]] = tables[op.attrs["table"]]
        elif op.type in ("pull_sparse", "unique_ids"):
            continue
        else:
            for slot, names in op.inputs.items():
                for n in names:
                    src = made.get(n)
                    if (
                        src is not None
                        and src.type in ("pull_sparse", "unique_ids")
                        and not (op.type == "embedding" and slot in ("W", "Ids"))
                    ):
                        raise ValueError(
                            f"op {op} reads {n!r} from {src.type}: only embedding lookups of "
                            "pulled rows can be exported"
                        )
            if (
                op.type == "embedding"
                and (src := made.get(op.inputs["W"][0])) is not None
                and src.type == "pull_sparse"
            ):
                table = src.attrs["table"]
                uniq = made[src.inputs["Ids"][0]]
                op.inputs = {**op.inputs, "W": [table], "Ids": uniq.inputs["Ids"]}
                value = params[table] = tables[table]
                block.vars[table] = Var(
                    table,
                    tuple(np.shape(value)),
                    str(np.asarray(value).dtype),
                    persistable=True,
                    is_parameter=True,
                )
            kept.append(op)
    block.set_ops(kept)
    used = {n for op in kept for n in op.input_names() + op.output_names()}
    block.vars = {n: v for n, v in block.vars.items() if n in used}
    prog.params = params
    return prog


def export_inference(
    plan: Plan,
    path: str | Path,
    tables: dict[str, np.ndarray],
    output: str | None = None,
    opset: int | None = None,
    external_over: int = ONNX_LIMIT,
    raw_dense: list[dict] | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write the servable ONNX model of `plan` with table values `tables` to `path` (see the module
    docstring) and check it with `onnx.checker`; ValueError when the graph would need a
    non-standard op. Initializers go to `<path>.data` (ONNX external data) when the tables hold
    more than `external_over` bytes. `raw_dense`: the model takes raw dense columns in place of the
    `dense` feed (`with_raw_dense`); `metadata`: the model's metadata_props."""
    import onnx

    from transpiler.exporters.onnx import DOMAIN, to_onnx

    graph = forward_graph(plan, output)
    prog = servable_program(graph, tables)
    model = to_onnx(prog, outputs=graph.outputs, params=prog.params, opset=opset, name="hetps-inference")
    custom = sorted({n.op_type for n in model.graph.node if n.domain == DOMAIN})
    if custom:
        raise ValueError(
            f"the forward graph has ops without a standard ONNX form ({custom}); a servable "
            "export needs ONNX ops only"
        )
    del model.opset_import[:]
    model.opset_import.append(onnx.helper.make_opsetid("", opset or plan_opset(prog)))
    if raw_dense:
        with_raw_dense(model, "dense", raw_dense)
    for k, v in (metadata or {}).items():
        model.metadata_props.add(key=k, value=v)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    big = sum(np.asarray(v).nbytes for v in tables.values()) > external_over
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=big,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data",
    )
    onnx.checker.check_model(str(path), full_check=True)  # by path: external data too
    return path


def plan_opset(program: Program) -> int:
    from transpiler.exporters.onnx import DEFAULT_OPSET

    return int(program.attrs.get("onnx_opset") or DEFAULT_OPSET)


def with_raw_dense(model, feed: str, columns: list[dict]) -> None:
    """Make ONNX `model` take raw dense values: its input `feed` ([n, width] float32, the
    transformed columns side by side) becomes one float64 input [n, width] per column, each filled
    where NaN (`fill`; None: left NaN), transformed (`transform`: none | log1p | standardize with
    `mean`, `std`) and cast, the results concatenated into `feed` inside the graph (in float64,
    as the data reader computes them, then float32)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    old = next((i for i in g.input if i.name == feed), None)
    if old is None:
        raise ValueError(f"the model has no input {feed!r} to take raw dense values for")
    nodes, parts, inputs = [], [], []

    def const(name: str, value: float) -> str:
        g.initializer.append(numpy_helper.from_array(np.array(value, np.float64), name))
        return name

    for c in columns:
        x, n = c["name"], f"raw.{c['name']}"
        inputs.append(helper.make_tensor_value_info(x, TensorProto.DOUBLE, ["n", c["width"]]))
        if c["fill"] is not None:
            nodes += [
                helper.make_node("IsNaN", [x], [f"{n}.nan"]),
                helper.make_node("Where", [f"{n}.nan", const(f"{n}.fill", c["fill"]), x], [f"{n}.filled"]),
            ]
            x = f"{n}.filled"
        if c["transform"] == "log1p":
            nodes += [
                helper.make_node("Max", [x, const(f"{n}.zero", 0.0)], [f"{n}.pos"]),
                helper.make_node("Add", [f"{n}.pos", const(f"{n}.one", 1.0)], [f"{n}.p1"]),
                helper.make_node("Log", [f"{n}.p1"], [f"{n}.t"]),
            ]
            x = f"{n}.t"
        elif c["transform"] == "standardize":
            nodes += [
                helper.make_node("Sub", [x, const(f"{n}.mean", c["mean"])], [f"{n}.c"]),
                helper.make_node("Div", [f"{n}.c", const(f"{n}.std", c["std"])], [f"{n}.t"]),
            ]
            x = f"{n}.t"
        nodes.append(helper.make_node("Cast", [x], [f"{n}.f32"], to=TensorProto.FLOAT))
        parts.append(f"{n}.f32")
    nodes.append(helper.make_node("Concat", parts, [feed], axis=1))
    rest = [i for i in g.input if i.name != feed]
    del g.input[:]
    g.input.extend([*inputs, *rest])
    body = list(g.node)
    del g.node[:]
    g.node.extend([*nodes, *body])
    onnx.checker.check_model(model)
