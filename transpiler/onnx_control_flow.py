"""Control flow that exporters write, made straight-line before import (`straighten`).

- An `If` whose condition is known at import time (a constant, or computed from constants and
  static shapes) is replaced by the nodes of the branch it takes.
- A `Loop` in the shape torch's TorchScript exporter gives `nn.EmbeddingBag` (per bag: Gather the
  bag's start / end offsets by the iteration number, Slice the indices, Gather the table rows,
  optionally Mul by the per-sample weights, Reduce{Sum,Mean,Max} over axis 0) becomes one
  `embedding_bag` node (domain ai.hetps): a pooled embedding lookup whose batch stays dynamic and
  whose table can be a sparse parameter-server table. The while-Loop torch's dynamo exporter writes
  for it (onnxscript: per bag, If(empty, zeros, ReduceSum(Slice(Gather(W, ids)))) appended to a
  sequence, joined by ConcatFromSequence) becomes the same op (mode sum).
- Any other `Loop` whose trip count is known at import time, with a loop condition that stays
  known too, is unrolled (at most MAX_UNROLL iterations).

Control flow that none of these cover stays in the graph with the reason, and the import refuses it
naming the node (`Straightened.refused`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

MAX_UNROLL = 1024
HETPS_DOMAIN = "ai.hetps"  # the domain onnx_export writes hetps-only ops in
_PASS_THROUGH = ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Gather", "Slice", "Flatten")


@dataclass
class Straightened:
    """The model without the control flow that could be resolved; `refused` maps each remaining
    Loop / If node (`refusal_key`) to why it stays."""

    model: onnx.ModelProto
    refused: dict[str, str] = field(default_factory=dict)


def straighten(model: onnx.ModelProto) -> Straightened:
    """Fold constant-condition Ifs, map EmbeddingBag Loops to `embedding_bag`, unroll Loops with an
    import-time trip count; repeat until nothing changes (nested control flow)."""
    if not any(n.op_type in ("Loop", "If") for n in model.graph.node):
        return Straightened(model)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    refused: dict[str, str] = {}
    counter = [0]
    changed = True
    while changed:
        changed, refused = False, {}
        graph = model.graph
        static = _Static(graph, _static_shapes(model), _opset(model))
        nodes: list[onnx.NodeProto] = []
        replaced: set[str] = set()  # outputs of nodes a rewrite took over (dynamo's ConcatFromSequence)
        for node in graph.node:
            if node.output and node.output[0] in replaced:
                continue
            if node.domain not in ("", "ai.onnx") or node.op_type not in ("Loop", "If"):
                nodes.append(node)
                continue
            counter[0] += 1
            prefix = f"{node.name or node.op_type}#{counter[0]}/"
            try:
                if node.op_type == "If":
                    new = _fold_if(node, static, prefix)
                else:
                    new = (
                        _embedding_bag(node, static)
                        or _dynamo_embedding_bag(node, graph, static, prefix)
                        or _unroll(node, static, prefix)
                    )
            except _Refused as e:
                refused[refusal_key(node)] = str(e)
                nodes.append(node)
                continue
            replaced |= {o for n in new for o in n.output} - set(node.output)
            nodes.extend(new)
            changed = True
        del graph.node[:]
        graph.node.extend(nodes)
        if changed:
            _prune_dead(graph)
            _uses_hetps_domain(model)
    return Straightened(model, refused)


def _prune_dead(graph: onnx.GraphProto) -> None:
    """Drop nodes none of whose outputs is read (by a node, a subgraph, or as a graph output), and
    the value_info of values no longer defined."""
    while True:
        read = {o.name for o in graph.output} | {i for n in graph.node for i in _reads(n)}
        keep = [n for n in graph.node if any(o in read for o in n.output if o)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    defined = {o for n in graph.node for o in n.output}
    infos = [vi for vi in graph.value_info if vi.name in defined]
    del graph.value_info[:]
    graph.value_info.extend(infos)


def _reads(node: onnx.NodeProto) -> set[str]:
    """Every value a node reads, its subgraphs' outer references included."""
    names = set(node.input)
    for a in node.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            names |= {i for n in g.node for i in _reads(n)} | {o.name for o in g.output}
    return names


class _Refused(Exception):
    pass


def refusal_key(node: onnx.NodeProto) -> str:
    """How `Straightened.refused` names a node: its first output (unique), else its name."""
    return node.output[0] if node.output else node.name


def _opset(model: onnx.ModelProto) -> int:
    return next(
        (o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), onnx.defs.onnx_opset_version()
    )


def _uses_hetps_domain(model: onnx.ModelProto) -> None:
    if any(n.domain == HETPS_DOMAIN for n in model.graph.node) and not any(
        o.domain == HETPS_DOMAIN for o in model.opset_import
    ):
        model.opset_import.append(helper.make_opsetid(HETPS_DOMAIN, 1))


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
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


class _Static:
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
            if node is None or not _evaluable(node):
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
            outs = ReferenceEvaluator(_one_node_model(node, feeds, self.opset)).run(None, feeds)
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


def _evaluable(node: onnx.NodeProto) -> bool:
    """A default-domain node without subgraphs (what the reference evaluator runs one by one)."""
    return node.domain in ("", "ai.onnx") and not any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    )


def _one_node_model(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> onnx.ModelProto:
    inputs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in feeds.items()
    ]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
    graph = helper.make_graph([node], "static", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


# -- inlining a subgraph ---------------------------------------------------------------------------
def _defined(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    return names | {o for n in graph.node for o in n.output if o}


def _renamed(node: onnx.NodeProto, names: dict[str, str], prefix: str = "") -> onnx.NodeProto:
    """A copy of node reading / writing renamed values (nested subgraphs' references to them too),
    its name prefixed."""
    new = onnx.NodeProto()
    new.CopyFrom(node)
    new.input[:] = [names.get(i, i) for i in node.input]
    new.output[:] = [names.get(o, o) for o in node.output]
    if new.name:
        new.name = prefix + new.name
    for a in new.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            inner = {k: v for k, v in names.items() if k not in _defined(g)}
            for n in g.node:
                n.CopyFrom(_renamed(n, inner))
            for o in g.output:
                o.name = inner.get(o.name, o.name)
    return new


def _inline(body: onnx.GraphProto, prefix: str, bound: dict[str, str]) -> tuple[list, dict[str, str]]:
    """The body's nodes with its values renamed `prefix + name` (its inputs as `bound` says) and its
    initializers as Constants; returns (nodes, the rename map)."""
    names = {n: prefix + n for n in _defined(body)}
    names.update(bound)
    nodes = [helper.make_node("Constant", [], [names[t.name]], value=t) for t in body.initializer]
    nodes += [_renamed(n, names, prefix) for n in body.node]
    return nodes, names


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


# -- If ---------------------------------------------------------------------------------------------
def _fold_if(node: onnx.NodeProto, static: _Static, prefix: str) -> list[onnx.NodeProto]:
    cond = static.get(node.input[0])
    if cond is None:
        raise _Refused(
            f"its condition is not known at import time (it depends on {static.source(node.input[0])})"
        )
    branch = _attr(node, "then_branch" if bool(np.asarray(cond).reshape(-1)[0]) else "else_branch")
    nodes, names = _inline(branch, prefix, {})
    for out, inner in zip(node.output, branch.output, strict=True):
        if out:
            nodes.append(helper.make_node("Identity", [names.get(inner.name, inner.name)], [out]))
    return nodes


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


# -- Loop -------------------------------------------------------------------------------------------
def _const_true(static: _Static, name: str) -> bool:
    v = static.get(name) if name else np.array(True)
    return v is not None and bool(np.asarray(v).reshape(-1)[0])


def _unroll(node: onnx.NodeProto, static: _Static, prefix: str) -> list[onnx.NodeProto]:
    body = _attr(node, "body")
    m = static.get(node.input[0]) if node.input and node.input[0] else None
    if m is None:
        why = (
            "it has no trip count"
            if not (node.input and node.input[0])
            else f"its trip count is not known at import time (it depends on {static.source(node.input[0])})"
        )
        raise _Refused(why + "; only Loops with a known trip count, or torch's EmbeddingBag, are imported")
    trips = int(np.asarray(m).reshape(-1)[0])
    if trips > MAX_UNROLL:
        raise _Refused(f"its trip count {trips} is over the {MAX_UNROLL} iterations hetps unrolls")
    cond_in = node.input[1] if len(node.input) > 1 else ""
    if not _const_true(static, cond_in):
        raise _Refused("its initial loop condition is not a constant true")
    n_carried = len(node.input) - 2
    carried = list(node.input[2:])
    scans: list[list[str]] = [[] for _ in body.output[1 + n_carried :]]
    if trips == 0 and scans:
        raise _Refused("it has scan outputs and a trip count of 0 (their shape is unknown)")
    nodes: list[onnx.NodeProto] = []
    axes0 = f"{prefix}axes0"
    nodes.append(_constant(axes0, np.array([0], np.int64)))
    for i in range(trips):
        it, cond = f"{prefix}{i}/iter", f"{prefix}{i}/cond"
        nodes += [_constant(it, np.array(i, np.int64)), _constant(cond, np.array(True))]
        bound = {body.input[0].name: it, body.input[1].name: cond}
        bound.update({vi.name: c for vi, c in zip(body.input[2:], carried, strict=True)})
        inlined, names = _inline(body, f"{prefix}{i}/", bound)
        nodes += inlined
        outs = [names.get(o.name, o.name) for o in body.output]
        carried = outs[1 : 1 + n_carried]
        for k, s in enumerate(outs[1 + n_carried :]):
            scans[k].append(f"{prefix}{i}/scan{k}")
            nodes.append(helper.make_node("Unsqueeze", [s, axes0], [scans[k][-1]]))
        static.producer.update({o: n for n in nodes for o in n.output if o})
        if not _const_true(static, outs[0]):
            raise _Refused("its loop condition is computed at run time")
    for out, c in zip(node.output[:n_carried], carried, strict=True):
        if out:
            nodes.append(helper.make_node("Identity", [c], [out]))
    for out, parts in zip(node.output[n_carried:], scans, strict=True):
        if out:
            nodes.append(helper.make_node("Concat", parts, [out], axis=0))
    return nodes


# -- torch's EmbeddingBag ----------------------------------------------------------------------------
_BAG_MODES = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max"}


def _embedding_bag(node: onnx.NodeProto, static: _Static) -> list[onnx.NodeProto] | None:
    """One `embedding_bag` node for a Loop in the shape torch exports nn.EmbeddingBag as; None when
    the Loop has another shape."""
    body = _attr(node, "body")
    if len(node.input) != 2 or len(body.output) != 2 or len(node.output) != 1:
        return None
    produced = {o: n for n in body.node for o in n.output if o}
    local = _Static(body, {}, static.opset)
    local.values.update(static.values)
    local.producer = {**static.producer, **produced}
    it = body.input[0].name

    def op(name: str, *types: str) -> onnx.NodeProto | None:
        n = produced.get(name)
        return n if n is not None and n.op_type in types and n.domain in ("", "ai.onnx") else None

    def ints(name: str) -> list[int] | None:
        v = local.get(name) if name else None
        return None if v is None else [int(x) for x in np.asarray(v).reshape(-1)]

    def axes(n: onnx.NodeProto) -> list[int] | None:
        return ints(n.input[1]) if len(n.input) > 1 and n.input[1] else _attr(n, "axes")

    def offsets(name: str) -> str | None:  # Unsqueeze(Gather(offsets, iter), [0]) -> offsets
        u = op(name, "Unsqueeze")
        g = op(u.input[0], "Gather") if u is not None and axes(u) == [0] else None
        ok = g is not None and g.input[1] == it and _attr(g, "axis", 0) == 0 and g.input[0] not in produced
        return g.input[0] if ok else None

    def sliced(name: str) -> tuple[str, str, str] | None:  # Slice(x, start, end, [0]) -> x, starts, ends
        s = op(name, "Slice")
        if (
            s is None
            or len(s.input) < 4
            or ints(s.input[3]) != [0]
            or (len(s.input) > 4 and s.input[4] and ints(s.input[4]) != [1])
        ):
            return None
        starts, ends = offsets(s.input[1]), offsets(s.input[2])
        return (s.input[0], starts, ends) if starts and ends and s.input[0] not in produced else None

    red = op(body.output[1].name, *_BAG_MODES)
    if red is None or _attr(red, "keepdims", 1) != 0 or axes(red) != [0]:
        return None
    if not _const_true(local, body.output[0].name):
        return None
    x, weights = red.input[0], None
    mul = op(x, "Mul")
    if mul is not None:
        for a, b in (mul.input, mul.input[::-1]):
            u = op(b, "Unsqueeze")
            if op(a, "Gather") is not None and u is not None and axes(u) == [1] and sliced(u.input[0]):
                x, weights = a, sliced(u.input[0])
                break
        else:
            return None
    gather = op(x, "Gather")
    if gather is None or _attr(gather, "axis", 0) != 0 or gather.input[0] in produced:
        return None
    bag = sliced(gather.input[1])
    if bag is None or (weights is not None and (weights[1:] != bag[1:] or _BAG_MODES[red.op_type] != "sum")):
        return None
    ids, starts, ends = bag
    if not _counts(static, node.input[0], ends):
        return None
    return [
        _bag_node(
            gather.input[0],
            ids,
            starts,
            ends,
            weights[0] if weights else None,
            node.output[0],
            node.name,
            _BAG_MODES[red.op_type],
        )
    ]


def _bag_node(
    w: str, ids: str, starts: str, ends: str, weights: str | None, out: str, name: str, mode: str
) -> onnx.NodeProto:
    """An ai.hetps `embedding_bag` node (its slot layout as onnx_export writes it)."""
    inputs = [w, ids, starts, ends] + ([weights] if weights else [])
    layout = "W:1,Ids:1,Starts:1,Ends:1" + (",PerSampleWeights:1" if weights else "")
    return helper.make_node(
        "embedding_bag",
        inputs,
        [out],
        name=name or None,
        domain=HETPS_DOMAIN,
        hetps_inputs=layout,
        hetps_outputs="Out:1",
        mode=mode,
    )


def _counts(static: _Static, trip_count: str, ends: str) -> bool:
    """Whether the trip count is the number of bags: Size / Shape(...)[0] of `ends`."""
    name = trip_count
    for _ in range(8):
        n = static.producer.get(name)
        if n is None:
            return False
        if n.op_type in ("Size", "Shape"):
            return n.input[0] == ends
        if n.op_type not in _PASS_THROUGH:
            return False
        name = n.input[0]
    return False


def _dynamo_embedding_bag(
    node: onnx.NodeProto, graph: onnx.GraphProto, static: _Static, prefix: str
) -> list[onnx.NodeProto] | None:
    """One `embedding_bag` node for the while-Loop torch's dynamo exporter (onnxscript's
    aten_embedding_bag, mode sum) writes: per bag, If(start == end, zeros, ReduceSum(Slice(rows,
    start, end), axis 0)) appended to a sequence that a ConcatFromSequence(axis 0) joins, where
    rows = Gather(W, ids) (times per-sample weights) and start, end = offsets[i], offsets[i + 1].
    The Loop's outputs are replaced, the ConcatFromSequence's output written directly; None when
    the Loop has another shape."""
    body = _attr(node, "body")
    if len(node.input) != 4 or len(node.output) != 2 or len(body.input) != 4 or len(body.output) != 3:
        return None
    consumers = [n for n in graph.node if set(_reads(n)) & set(node.output)]
    seq_init = static.producer.get(node.input[3])
    if seq_init is None or seq_init.op_type != "SequenceEmpty" or len(consumers) != 1:
        return None
    concat = consumers[0]
    if (
        concat.op_type != "ConcatFromSequence"
        or list(concat.input) != [node.output[1]]
        or _attr(concat, "axis") != 0
        or _attr(concat, "new_axis", 0) != 0
    ):
        return None
    produced = {o: n for n in body.node for o in n.output if o}
    insert = produced.get(body.output[2].name)
    if insert is None or insert.op_type != "SequenceInsert" or insert.input[0] != body.input[3].name:
        return None
    branch = produced.get(insert.input[1])
    if branch is None or branch.op_type != "If":
        return None
    then, other = _attr(branch, "then_branch"), _attr(branch, "else_branch")
    zeros = {t.name: numpy_helper.to_array(t) for t in then.initializer}
    if len(then.node) or then.output[0].name not in zeros or np.any(zeros[then.output[0].name]):
        return None
    inner = {o: n for n in other.node for o in n.output if o}
    red = inner.get(other.output[0].name)
    sl = inner.get(red.input[0]) if red is not None and red.op_type == "ReduceSum" else None
    if sl is None or sl.op_type != "Slice" or len(sl.input) != 3 or _attr(red, "keepdims", 1) != 1:
        return None
    local = _Static(other, {}, static.opset)
    local.values.update(static.values)
    local.producer = {**static.producer, **produced, **inner}
    axes = local.get(red.input[1]) if len(red.input) > 1 else None
    if axes is None or [int(a) for a in np.asarray(axes).reshape(-1)] != [0]:
        return None
    start, end = produced.get(sl.input[1]), produced.get(sl.input[2])
    if (
        start is None
        or end is None
        or start.op_type != "Slice"
        or end.op_type != "Slice"
        or start.input[0] != end.input[0]
        or start.input[0] in produced
    ):
        return None
    offsets = start.input[0]
    rows, weights = static.producer.get(sl.input[0]), None
    if rows is not None and rows.op_type == "Mul":
        unsq = static.producer.get(rows.input[1])
        if (
            unsq is None
            or unsq.op_type != "Unsqueeze"
            or static.get(unsq.input[1]) is None
            or [int(a) for a in np.asarray(static.get(unsq.input[1])).reshape(-1)] != [1]
        ):
            return None
        weights, rows = unsq.input[0], static.producer.get(rows.input[0])
    if rows is None or rows.op_type != "Gather" or _attr(rows, "axis", 0) != 0:
        return None
    ends = f"{prefix}ends"
    nodes = [
        _constant(f"{prefix}one", np.array([1], np.int64)),
        _constant(f"{prefix}big", np.array([np.iinfo(np.int64).max], np.int64)),
        _constant(f"{prefix}axis0", np.array([0], np.int64)),
        helper.make_node("Slice", [offsets, f"{prefix}one", f"{prefix}big", f"{prefix}axis0"], [ends]),
    ]
    nodes.append(
        _bag_node(rows.input[0], rows.input[1], offsets, ends, weights, concat.output[0], node.name, "sum")
    )
    return nodes
