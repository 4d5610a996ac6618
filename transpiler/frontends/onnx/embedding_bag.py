"""torch's nn.EmbeddingBag exports, recognised and replaced by one `embedding_bag` node (domain
ai.hetps): a pooled embedding lookup whose batch stays dynamic and whose table can be a sparse
parameter-server table (see `onnx_control_flow.straighten`).

- TorchScript writes a `Loop` over the bags: Gather the bag's start / end offsets by the iteration
  number, Slice the indices, Gather the table rows, optionally Mul by the per-sample weights,
  Reduce{Sum,Mean,Max} over axis 0 (`torchscript_bag`).
- dynamo (onnxscript's aten_embedding_bag, mode sum) writes a while-Loop: per bag, If(empty, zeros,
  ReduceSum(Slice(Gather(W, ids)))) appended to a sequence that ConcatFromSequence joins
  (`dynamo_bag`).

Both return None when the Loop has another shape.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from transpiler.frontends.onnx.static import HETPS_DOMAIN, StaticValues, attr, const_true, constant, reads

PASS_THROUGH = ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Gather", "Slice", "Flatten")
_BAG_MODES = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max"}


def bag_node(
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


def _ints(value: np.ndarray | None) -> list[int] | None:
    return None if value is None else [int(x) for x in np.asarray(value).reshape(-1)]


# -- TorchScript: Loop over the bags ------------------------------------------------------------------
class _Body:
    """Pattern matching over a TorchScript bag Loop's body (its nodes by output, values known at
    import time, the iteration number's name)."""

    def __init__(self, body: onnx.GraphProto, static: StaticValues) -> None:
        self.produced = {o: n for n in body.node for o in n.output if o}
        self.local = StaticValues(body, {}, static.opset)
        self.local.values.update(static.values)
        self.local.producer = {**static.producer, **self.produced}
        self.iteration = body.input[0].name

    def op(self, name: str, *types: str) -> onnx.NodeProto | None:
        """The default-domain node of one of `types` producing `name` in the body, else None."""
        n = self.produced.get(name)
        return n if n is not None and n.op_type in types and n.domain in ("", "ai.onnx") else None

    def ints(self, name: str) -> list[int] | None:
        return _ints(self.local.get(name)) if name else None

    def axes(self, n: onnx.NodeProto) -> list[int] | None:
        return self.ints(n.input[1]) if len(n.input) > 1 and n.input[1] else attr(n, "axes")

    def offsets(self, name: str) -> str | None:
        """offsets of Unsqueeze(Gather(offsets, iteration), [0]), else None."""
        u = self.op(name, "Unsqueeze")
        g = self.op(u.input[0], "Gather") if u is not None and self.axes(u) == [0] else None
        ok = (
            g is not None
            and g.input[1] == self.iteration
            and attr(g, "axis", 0) == 0
            and g.input[0] not in self.produced
        )
        return g.input[0] if ok else None

    def sliced(self, name: str) -> tuple[str, str, str] | None:
        """(x, starts, ends) of Slice(x, start, end, [0]) with start / end gathered offsets, else None."""
        s = self.op(name, "Slice")
        if (
            s is None
            or len(s.input) < 4
            or self.ints(s.input[3]) != [0]
            or (len(s.input) > 4 and s.input[4] and self.ints(s.input[4]) != [1])
        ):
            return None
        starts, ends = self.offsets(s.input[1]), self.offsets(s.input[2])
        return (s.input[0], starts, ends) if starts and ends and s.input[0] not in self.produced else None

    def weighted(self, x: str) -> tuple[str, tuple[str, str, str] | None] | None:
        """(the gathered rows, the sliced per-sample weights or None) of the reduction's input `x`:
        Gather(...) or Mul(Gather(...), Unsqueeze(sliced weights, [1])); None for another shape."""
        mul = self.op(x, "Mul")
        if mul is None:
            return x, None
        for a, b in (mul.input, mul.input[::-1]):
            u = self.op(b, "Unsqueeze")
            if self.op(a, "Gather") is not None and u is not None and self.axes(u) == [1]:
                weights = self.sliced(u.input[0])
                if weights:
                    return a, weights
        return None


def torchscript_bag(node: onnx.NodeProto, static: StaticValues) -> list[onnx.NodeProto] | None:
    """One `embedding_bag` node for a Loop in the shape torch's TorchScript exporter writes
    nn.EmbeddingBag as; None when the Loop has another shape."""
    body = attr(node, "body")
    if len(node.input) != 2 or len(body.output) != 2 or len(node.output) != 1:
        return None
    m = _Body(body, static)
    red = m.op(body.output[1].name, *_BAG_MODES)
    if red is None or attr(red, "keepdims", 1) != 0 or m.axes(red) != [0]:
        return None
    if not const_true(m.local, body.output[0].name):
        return None
    found = m.weighted(red.input[0])
    if found is None:
        return None
    x, weights = found
    gather = m.op(x, "Gather")
    if gather is None or attr(gather, "axis", 0) != 0 or gather.input[0] in m.produced:
        return None
    bag, mode = m.sliced(gather.input[1]), _BAG_MODES[red.op_type]
    if bag is None or (weights is not None and (weights[1:] != bag[1:] or mode != "sum")):
        return None
    ids, starts, ends = bag
    if not _counts(static, node.input[0], ends):
        return None
    w = weights[0] if weights else None
    return [bag_node(gather.input[0], ids, starts, ends, w, node.output[0], node.name, mode)]


def _counts(static: StaticValues, trip_count: str, ends: str) -> bool:
    """Whether the trip count is the number of bags: Size / Shape(...)[0] of `ends`."""
    name = trip_count
    for _ in range(8):
        n = static.producer.get(name)
        if n is None:
            return False
        if n.op_type in ("Size", "Shape"):
            return n.input[0] == ends
        if n.op_type not in PASS_THROUGH:
            return False
        name = n.input[0]
    return False


# -- dynamo: a while-Loop appending one pooled row per bag to a sequence --------------------------------
def _concat_of(node: onnx.NodeProto, graph: onnx.GraphProto, static: StaticValues) -> onnx.NodeProto | None:
    """The ConcatFromSequence(axis 0) that alone reads the Loop's sequence (started SequenceEmpty)."""
    consumers = [n for n in graph.node if set(reads(n)) & set(node.output)]
    seq_init = static.producer.get(node.input[3])
    if seq_init is None or seq_init.op_type != "SequenceEmpty" or len(consumers) != 1:
        return None
    concat = consumers[0]
    if (
        concat.op_type != "ConcatFromSequence"
        or list(concat.input) != [node.output[1]]
        or attr(concat, "axis") != 0
        or attr(concat, "new_axis", 0) != 0
    ):
        return None
    return concat


def _pooled_branch(body: onnx.GraphProto, produced: dict) -> onnx.GraphProto | None:
    """The else-branch of If(empty bag, zeros, pooled rows) whose output the body appends."""
    insert = produced.get(body.output[2].name)
    if insert is None or insert.op_type != "SequenceInsert" or insert.input[0] != body.input[3].name:
        return None
    branch = produced.get(insert.input[1])
    if branch is None or branch.op_type != "If":
        return None
    then, other = attr(branch, "then_branch"), attr(branch, "else_branch")
    zeros = {t.name: numpy_helper.to_array(t) for t in then.initializer}
    if len(then.node) or then.output[0].name not in zeros or np.any(zeros[then.output[0].name]):
        return None
    return other


def _bag_slice(other: onnx.GraphProto, static: StaticValues, produced: dict) -> tuple | None:
    """(Slice node of the rows, offsets) of the branch's ReduceSum(Slice(rows, offsets[i],
    offsets[i + 1]), axes [0], keepdims 1); None for another shape."""
    inner = {o: n for n in other.node for o in n.output if o}
    red = inner.get(other.output[0].name)
    sl = inner.get(red.input[0]) if red is not None and red.op_type == "ReduceSum" else None
    if sl is None or sl.op_type != "Slice" or len(sl.input) != 3 or attr(red, "keepdims", 1) != 1:
        return None
    local = StaticValues(other, {}, static.opset)
    local.values.update(static.values)
    local.producer = {**static.producer, **produced, **inner}
    if _ints(local.get(red.input[1]) if len(red.input) > 1 else None) != [0]:
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
    return sl, start.input[0]


def _rows_gather(rows_name: str, static: StaticValues) -> tuple[onnx.NodeProto, str | None] | None:
    """(Gather(W, ids), per-sample weights or None) of rows = Gather(...) [* Unsqueeze(weights, [1])]."""
    rows, weights = static.producer.get(rows_name), None
    if rows is not None and rows.op_type == "Mul":
        unsq = static.producer.get(rows.input[1])
        if unsq is None or unsq.op_type != "Unsqueeze" or _ints(static.get(unsq.input[1])) != [1]:
            return None
        weights, rows = unsq.input[0], static.producer.get(rows.input[0])
    if rows is None or rows.op_type != "Gather" or attr(rows, "axis", 0) != 0:
        return None
    return rows, weights


def dynamo_bag(
    node: onnx.NodeProto, graph: onnx.GraphProto, static: StaticValues, prefix: str
) -> list[onnx.NodeProto] | None:
    """One `embedding_bag` node for the while-Loop torch's dynamo exporter (onnxscript's
    aten_embedding_bag, mode sum) writes: per bag, If(start == end, zeros, ReduceSum(Slice(rows,
    start, end), axis 0)) appended to a sequence that a ConcatFromSequence(axis 0) joins, where
    rows = Gather(W, ids) (times per-sample weights) and start, end = offsets[i], offsets[i + 1].
    The Loop's outputs are replaced, the ConcatFromSequence's output written directly; None when
    the Loop has another shape."""
    body = attr(node, "body")
    if len(node.input) != 4 or len(node.output) != 2 or len(body.input) != 4 or len(body.output) != 3:
        return None
    concat = _concat_of(node, graph, static)
    produced = {o: n for n in body.node for o in n.output if o}
    other = _pooled_branch(body, produced) if concat is not None else None
    found = _bag_slice(other, static, produced) if other is not None else None
    gathered = _rows_gather(found[0].input[0], static) if found is not None else None
    if gathered is None:
        return None
    (rows, weights), offsets, ends = gathered, found[1], f"{prefix}ends"
    return [
        constant(f"{prefix}one", np.array([1], np.int64)),
        constant(f"{prefix}big", np.array([np.iinfo(np.int64).max], np.int64)),
        constant(f"{prefix}axis0", np.array([0], np.int64)),
        helper.make_node("Slice", [offsets, f"{prefix}one", f"{prefix}big", f"{prefix}axis0"], [ends]),
        bag_node(rows.input[0], rows.input[1], offsets, ends, weights, concat.output[0], node.name, "sum"),
    ]
