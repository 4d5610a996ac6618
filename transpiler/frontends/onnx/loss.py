"""Losses an exporter wrote as raw ops: which tensor is the prediction, and an optional log clamp.

torch's TorchScript exporter writes `BCELoss` as `-(y * Log(p) + (1 - y) * Log(1 - p))` with `p =
Sigmoid(logit)`: no loss op a trainer could recognise, so nobody knew which tensor to score for
the AUC. `find_score` finds the prediction `p` and the label `y` feeding such a loss; `clamp_logs`
puts a `Clip(min=eps)` before every `Log` the loss is computed from — torch clamps the log inside
`BCELoss` (at -100), the exported graph does not, so a saturated sigmoid gives log(0) = -inf. The
clamp changes the model's maths, so it is the user's choice (`from_onnx(..., log_clamp=eps)`).
`stable_logs` (on by default) is not a clamp: it rewrites `Log(Sigmoid(z))` as `-Softplus(-z)` and
`Log(1 - Sigmoid(z))` as `-Softplus(z)`: the same function, rounded once instead of through
`1 - sigmoid` (closer to the float64 value than the exported float32 ops), finite (and with finite
gradients) where the sigmoid saturates to 0 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from transpiler.frontends.onnx.model import OnnxImportError
from transpiler.ir import Program, Var
from transpiler.tasks import Task, add_total_loss

PASS_THROUGH = ("Clip", "Identity")  # a Log's input is read through these to find the prediction


@dataclass(frozen=True)
class Score:
    """The tensors the AUC is computed from: the prediction (probability or logit) and the label."""

    pred: str
    label: str


class _Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.graph = model.graph
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.consts = {t.name for t in self.graph.initializer} | {
            n.output[0] for n in self.graph.node if n.op_type == "Constant"
        }
        self.inputs = [vi.name for vi in self.graph.input if vi.name not in self.consts]

    def ancestors(self, name: str) -> set[str]:
        """Every value `name` is computed from, itself included."""
        seen, todo = set(), [name]
        while todo:
            v = todo.pop()
            if v in seen or not v:
                continue
            seen.add(v)
            node = self.producer.get(v)
            if node is not None:
                todo.extend(node.input)
        return seen

    def through(self, name: str) -> str:
        """`name` with Clip / Identity producers looked through."""
        while (node := self.producer.get(name)) is not None and node.op_type in PASS_THROUGH:
            name = node.input[0]
        return name

    def one_minus(self, name: str) -> str | None:
        """x when `name` is Sub(1, x) (looked through Clip / Identity), else None."""
        node = self.producer.get(self.through(name))
        if node is None or node.op_type != "Sub" or self._const(node.input[0]) != 1.0:
            return None
        return self.through(node.input[1])

    def _const(self, name: str) -> float | None:
        arr = self.const_array(name)
        return float(arr.reshape(-1)[0]) if arr is not None and arr.size == 1 else None

    def const_array(self, name: str) -> np.ndarray | None:
        """The value of an initializer or `Constant` node output `name`, else None."""
        for t in self.graph.initializer:
            if t.name == name:
                return numpy_helper.to_array(t)
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def sigmoid_input(self, name: str) -> str | None:
        """z when `name` is Sigmoid(z) (looked through Identity only: a Clip changes values), else None."""
        while (node := self.producer.get(name)) is not None and node.op_type == "Identity":
            name = node.input[0]
        return node.input[0] if node is not None and node.op_type == "Sigmoid" else None


def find_score(model: onnx.ModelProto, loss: str, pred: str | None = None) -> Score | None:
    """The prediction and label of the loss `loss`, or None when they cannot be told apart.

    The prediction is `pred` when given; else the `x` of a binary cross-entropy written as
    `Log(x)` and `Log(1 - x)`; else the output of a `Sigmoid` that a `Log` reads. The label is the
    one graph input the loss reads that the prediction does not."""
    g = _Graph(model)
    upstream = g.ancestors(loss)
    if pred is not None:
        if pred not in upstream:
            raise OnnxImportError(
                f"pred {pred!r} is not a value the loss {loss!r} is computed from; "
                "name the tensor holding the model's prediction (probability or logit)"
            )
    else:
        pred = _detect_pred(g, upstream)
        if pred is None:
            return None
    labels = [n for n in g.inputs if n in upstream and n not in g.ancestors(pred)]
    return Score(pred, labels[0]) if len(labels) == 1 else None


def _detect_pred(g: _Graph, upstream: set[str]) -> str | None:
    logs = [g.through(n.input[0]) for n in g.graph.node if n.op_type == "Log" and n.output[0] in upstream]
    complements = {g.one_minus(x) for x in logs}
    bce = [x for x in logs if x in complements]
    if bce:
        return bce[0]
    for x in logs:
        node = g.producer.get(x)
        if node is not None and node.op_type == "Sigmoid":
            return x
    return None


def unclamped_logs(model: onnx.ModelProto, loss: str) -> int:
    """How many Logs the loss is computed from read a value with no Clip before it."""
    g = _Graph(model)
    upstream = g.ancestors(loss)
    return sum(
        1
        for n in g.graph.node
        if n.op_type == "Log"
        and n.output[0] in upstream
        and getattr(g.producer.get(n.input[0]), "op_type", None) != "Clip"
    )


def clamp_logs(model: onnx.ModelProto, loss: str, eps: float) -> tuple[onnx.ModelProto, int]:
    """(a copy of `model` where every Log that `loss` is computed from reads Clip(x, min=eps),
    the number of Logs clamped). log(eps) is then the smallest term: eps=1e-7 bounds it at -16.1."""
    if not eps > 0:
        raise ValueError(f"log_clamp must be > 0 (the smallest value a Log may read), not {eps!r}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    upstream = _Graph(out).ancestors(loss)
    nodes, done = [], 0
    for i, node in enumerate(out.graph.node):
        if node.op_type == "Log" and node.output[0] in upstream:
            eps_name, clipped = f"{node.output[0]}.clamp_min", f"{node.output[0]}.clamped_input"
            dtype = helper.tensor_dtype_to_np_dtype(_elem_type(out, node.input[0]))
            nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [eps_name],
                    name=f"{node.name or i}.clamp_min",
                    value=numpy_helper.from_array(np.array(eps, dtype=dtype)),
                )
            )
            nodes.append(
                helper.make_node("Clip", [node.input[0], eps_name], [clipped], name=f"{node.name or i}.clamp")
            )
            node.input[0] = clipped
            done += 1
        nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, done


def _elem_type(model: onnx.ModelProto, name: str) -> int:
    inferred = onnx.shape_inference.infer_shapes(model).graph
    for vi in [*inferred.value_info, *inferred.input, *inferred.output]:
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi.type.tensor_type.elem_type
    return onnx.TensorProto.FLOAT


@dataclass(frozen=True)
class StableLog:
    """One Log rewritten by `stable_logs`: the node, the pattern it computed and its replacement."""

    node: str
    pattern: str
    replacement: str

    def __str__(self) -> str:
        return f"{self.node}: {self.pattern} -> {self.replacement}"


def stable_logs(model: onnx.ModelProto, loss: str) -> tuple[onnx.ModelProto, list[StableLog]]:
    """(a copy of `model` where every Log that `loss` is computed from of the form `Log(Sigmoid(z))`
    reads `-Softplus(-z)` and every `Log(Sub(1, Sigmoid(z)))` reads `-Softplus(z)`, the rewrites).

    Exact maths (log-sigmoid), not a clamp: Softplus is evaluated as logaddexp(0, x), so the result
    differs from the graph's only where float32 rounds sigmoid to 0 or 1 and the graph's log gives
    -inf. The `1` may be a scalar or broadcast Constant / initializer of ones; a broadcast one
    multiplies the result (by 1, exactly) so the output keeps its shape. The Sigmoid stays (it may
    be scored for the AUC); a `Sub` left unread is dropped."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = _Graph(out)
    upstream = g.ancestors(loss)
    nodes: list[onnx.NodeProto] = []
    done: list[StableLog] = []
    subs: set[str] = set()  # the `1 - Sigmoid(z)` values the rewritten Logs read
    for i, node in enumerate(out.graph.node):
        form = _log_sigmoid_form(g, node) if node.op_type == "Log" and node.output[0] in upstream else None
        if form is None:
            nodes.append(node)
            continue
        z, complement, ones = form
        name, y = node.name or f"Log_{i}", node.output[0]
        sp_in = z if complement else f"{y}.neg_logit"
        if not complement:
            nodes.append(helper.make_node("Neg", [z], [sp_in], name=f"{name}.neg_logit"))
        nodes.append(helper.make_node("Softplus", [sp_in], [f"{y}.softplus"], name=f"{name}.softplus"))
        neg_out = y if ones is None else f"{y}.unbroadcast"
        nodes.append(helper.make_node("Neg", [f"{y}.softplus"], [neg_out], name=f"{name}.neg"))
        if ones is not None:
            nodes.append(helper.make_node("Mul", [neg_out, ones], [y], name=f"{name}.broadcast"))
        if complement:
            subs.add(node.input[0])
        done.append(
            StableLog(name, "log(1 - sigmoid(z))", "-softplus(z)")
            if complement
            else StableLog(name, "log(sigmoid(z))", "-softplus(-z)")
        )
    if not done:
        return model, done
    del out.graph.node[:]
    read = {v for n in nodes for v in n.input} | {o.name for o in out.graph.output}
    out.graph.node.extend(n for n in nodes if not (n.output[0] in subs and n.output[0] not in read))
    return out, done


def _log_sigmoid_form(g: _Graph, log_node: onnx.NodeProto) -> tuple[str, bool, str | None] | None:
    """(z, whether the Log reads 1 - Sigmoid(z), the name of a non-scalar `1` or None) for a Log
    reading Sigmoid(z) or Sub(1, Sigmoid(z)); None for any other Log."""
    x = log_node.input[0]
    if (z := g.sigmoid_input(x)) is not None:
        return z, False, None
    sub = g.producer.get(x)
    if sub is None or sub.op_type != "Sub" or (z := g.sigmoid_input(sub.input[1])) is None:
        return None
    ones = g.const_array(sub.input[0])
    if ones is None or ones.size == 0 or not np.all(ones == 1):
        return None
    return z, True, (sub.input[0] if ones.ndim else None)


LOSSES = ("bce", "bce_with_logits", "mse", "softmax_ce")


def attach_loss(program: Program, output: str, loss: str, label: str = "label", name: str = "loss") -> Var:
    """Append a data input `label` and a mean `loss` of `output` against it; set loss_name.

    bce: binary cross entropy on probabilities (logs floored at -100); bce_with_logits: the same
    on logits, computed stably; mse: mean squared error; softmax_ce: cross entropy of softmax over
    class axis 1 against int64 class ids (label shape = output's without that axis).
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, not {loss!r}")
    block = program.global_block()
    if block.has_var(label):
        raise OnnxImportError(
            f"label name {label!r} is already a variable of the model; pass label=<an unused name>"
        )
    pred = program.var(output)
    shape = pred.shape
    if loss == "softmax_ce":
        shape = None if shape is None else shape[:1] + shape[2:]
    dtype = "int64" if loss == "softmax_ce" else pred.dtype
    block.create_var(label, shape=shape, dtype=dtype, stop_gradient=True)
    program.append_op(
        "data", {}, {"Out": [label]}, {"shape": list(shape) if shape is not None else None, "dtype": dtype}
    )
    name = _unused(block, name)
    block.create_var(name, shape=(), dtype=pred.dtype)
    if loss == "softmax_ce":
        program.append_op(
            "softmax_cross_entropy_loss",
            {"scores": [output], "labels": [label]},
            {"output": [name]},
            {"reduction": "mean", "ignore_index": None},
        )
    else:
        op_type, slots = {
            "bce": ("bce_loss", ("X", "Label")),
            "bce_with_logits": ("sigmoid_cross_entropy_with_logits", ("X", "Label")),
            "mse": ("square_error", ("X", "Y")),
        }[loss]
        elem = _unused(block, f"{name}_elementwise")
        block.create_var(elem, shape=pred.shape, dtype=pred.dtype)
        program.append_op(op_type, {slots[0]: [output], slots[1]: [label]}, {"Out": [elem]})
        program.append_op("reduce_mean", {"data": [elem]}, {"reduced": [name]}, {"keepdims": 0})
    program.attrs["loss_name"] = name
    return block.var(name)


def attach_losses(
    program: Program,
    losses: dict[str, tuple[str, str]],
    weights: dict[str, float] | None = None,
) -> Var:
    """Multi-task training: for each `losses` entry {output: (loss kind, label feed)} a mean loss of
    that graph output against its own new data input, and as the program's loss their weighted sum
    (`weights`: {output: weight}, 1.0 where not given); the tasks recorded (transpiler/tasks.py)."""
    outputs = program.attrs["fetch_names"]
    weights = dict(weights or {})
    if not losses:
        raise OnnxImportError("losses= is empty: give {output: (loss, label)} for at least one output")
    if unknown := [k for k in [*losses, *weights] if k not in outputs]:
        raise OnnxImportError(
            f"losses/weights name {unknown}, which are not graph outputs; the outputs are {outputs}"
        )
    if extra := [k for k in weights if k not in losses]:
        raise OnnxImportError(f"weights name {extra}, which have no loss in losses=")
    tasks = []
    for out, spec in losses.items():
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and all(isinstance(x, str) for x in spec)):
            raise OnnxImportError(
                f"losses[{out!r}] must be (loss, label), like ('bce', 'click'), got {spec!r}"
            )
        kind, label = spec
        if kind == "softmax_ce":
            raise OnnxImportError(f"losses[{out!r}]: a task loss is one of bce, bce_with_logits, mse")
        var = attach_loss(program, out, kind, label, name=f"loss_{out}")
        tasks.append(Task(out, out, label, kind, var.name, float(weights.get(out, 1.0))))
    return program.var(add_total_loss(program, tasks))


def _unused(block, base: str) -> str:
    name, k = base, 0
    while block.has_var(name):
        k += 1
        name = f"{base}_{k}"
    return name
