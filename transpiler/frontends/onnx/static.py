"""ONNX values known at import time, and small NodeProto helpers the control-flow rewrites share
(`onnx_control_flow`, `onnx_embedding_bag`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

HETPS_DOMAIN = "ai.hetps"  # the domain onnx_export writes hetps-only ops in


def reads(node: onnx.NodeProto) -> set[str]:
    """Every value a node reads, its subgraphs' outer references included."""
    names = set(node.input)
    for a in node.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            names |= {i for n in g.node for i in reads(n)} | {o.name for o in g.output}
    return names


def default_opset(model: onnx.ModelProto) -> int:
    """The model's ai.onnx opset version (the newest known when it imports none)."""
    return next(
        (o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), onnx.defs.onnx_opset_version()
    )


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Fully known shapes (no symbolic / unknown dim) by ONNX's shape inference."""
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - then only constants are static
        graph = model.graph
    out = {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        t = vi.type.tensor_type
        if (
            vi.type.HasField("tensor_type")
            and t.HasField("shape")
            and all(d.HasField("dim_value") for d in t.shape.dim)
        ):
            out[vi.name] = tuple(d.dim_value for d in t.shape.dim)
    return out


class StaticValues:
    """Values known at import time: initializers, Constants, Shape / Size of statically shaped
    values, and default-domain nodes (without subgraphs) over those, evaluated by ONNX's reference
    evaluator."""

    def __init__(self, graph: onnx.GraphProto, shapes: dict[str, tuple[int, ...]], opset: int) -> None:
        self.opset = opset
        self.values: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.shapes = shapes
        self.inputs = {i.name for i in graph.input} - set(self.values)
        self.unknown: set[str] = set()  # values found not to be known at import time

    def get(self, name: str) -> np.ndarray | None:
        """The value of `name` if known at import time, else None (ancestors walked iteratively,
        each evaluated or marked unknown once)."""
        stack = [name]
        while stack:
            n = stack[-1]
            if n in self.values or n in self.unknown:
                stack.pop()
                continue
            node = self.producer.get(n)
            if node is None or not evaluable(node):
                self.unknown.add(n)
                stack.pop()
                continue
            ins = [] if node.op_type in ("Shape", "Size") else [i for i in node.input if i]
            pending = [i for i in ins if i not in self.values and i not in self.unknown]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if any(i in self.unknown for i in ins) or not self._evaluate(node):
                self.unknown.update(o for o in node.output if o)
        return self.values.get(name)

    def _evaluate(self, node: onnx.NodeProto) -> bool:
        """Run one node of known inputs (Shape / Size: of a statically shaped value) by ONNX's
        reference evaluator; False when it cannot be."""
        from onnx.reference import ReferenceEvaluator

        if node.op_type in ("Shape", "Size"):  # only the shape matters: a zero array of it
            shape = self.shapes.get(node.input[0])
            if shape is None:
                return False
            feeds = {node.input[0]: np.zeros(shape, np.float32)}
        else:
            feeds = {i: self.values[i] for i in node.input if i}
        try:
            outs = ReferenceEvaluator(one_node_model(node, feeds, self.opset)).run(None, feeds)
        except Exception:  # noqa: BLE001 - not evaluable: not static
            return False
        for o, v in zip(node.output, outs, strict=False):
            if o:
                self.values[o] = np.asarray(v)
        return True

    def source(self, name: str) -> str:
        """The graph input a value depends on, for a refusal's message (or the value itself)."""
        seen, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n in self.inputs:
                return f"graph input {n!r}"
            if n in seen or n not in self.producer:
                continue
            seen.add(n)
            todo.extend(i for i in self.producer[n].input if i)
        return repr(name)


def evaluable(node: onnx.NodeProto) -> bool:
    """A default-domain node without subgraphs (what the reference evaluator runs one by one)."""
    return node.domain in ("", "ai.onnx") and not any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    )


def one_node_model(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> onnx.ModelProto:
    inputs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in feeds.items()
    ]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
    graph = helper.make_graph([node], "static", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def const_true(static: StaticValues, name: str) -> bool:
    v = static.get(name) if name else np.array(True)
    return v is not None and bool(np.asarray(v).reshape(-1)[0])
