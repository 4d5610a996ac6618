"""Control flow that exporters write, made straight-line before import (`straighten`).

- An `If` whose condition is known at import time (a constant, or computed from constants and
  static shapes) is replaced by the nodes of the branch it takes.
- A `Loop` in the shape torch's TorchScript or dynamo exporter gives `nn.EmbeddingBag` becomes one
  `embedding_bag` node (domain ai.hetps; see `onnx_embedding_bag`): a pooled embedding lookup whose
  batch stays dynamic and whose table can be a sparse parameter-server table.
- Any other `Loop` whose trip count is known at import time, with a loop condition that stays
  known too, is unrolled (at most MAX_UNROLL iterations).

Control flow that none of these cover stays in the graph with the reason, and the import refuses it
naming the node (`Straightened.refused`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from transpiler.frontends.onnx.embedding_bag import dynamo_bag, torchscript_bag
from transpiler.frontends.onnx.shape_values import LazyShapeFacts
from transpiler.frontends.onnx.static import (
    HETPS_DOMAIN,
    StaticValues,
    attr,
    const_true,
    constant,
    default_opset,
    reads,
    static_shapes,
)

MAX_UNROLL = 1024


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
        static = StaticValues(graph, static_shapes(model), default_opset(model))
        facts = LazyShapeFacts(model)  # partially known shapes, for Ifs StaticValues cannot decide
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
                    new = _fold_if(node, static, prefix, facts)
                else:
                    new = (
                        torchscript_bag(node, static)
                        or dynamo_bag(node, graph, static, prefix)
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
        read = {o.name for o in graph.output} | {i for n in graph.node for i in reads(n)}
        keep = [n for n in graph.node if any(o in read for o in n.output if o)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    defined = {o for n in graph.node for o in n.output}
    infos = [vi for vi in graph.value_info if vi.name in defined]
    del graph.value_info[:]
    graph.value_info.extend(infos)


class _Refused(Exception):
    pass


def refusal_key(node: onnx.NodeProto) -> str:
    """How `Straightened.refused` names a node: its first output (unique), else its name."""
    return node.output[0] if node.output else node.name


def _uses_hetps_domain(model: onnx.ModelProto) -> None:
    if any(n.domain == HETPS_DOMAIN for n in model.graph.node) and not any(
        o.domain == HETPS_DOMAIN for o in model.opset_import
    ):
        model.opset_import.append(helper.make_opsetid(HETPS_DOMAIN, 1))


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


# -- If ---------------------------------------------------------------------------------------------
def _fold_if(
    node: onnx.NodeProto, static: StaticValues, prefix: str, facts: LazyShapeFacts
) -> list[onnx.NodeProto]:
    cond = static.get(node.input[0])
    if cond is None:  # decided by dims that are known although the shapes holding them are not
        cond = facts.get().value(node.input[0])
    if cond is None:
        dim = facts.get().unknown(node.input[0])
        raise _Refused(
            f"its condition is not known at import time (it depends on {dim}, which no static shape fixes)"
            if dim
            else f"its condition is not known at import time (it depends on {static.source(node.input[0])})"
        )
    branch = attr(node, "then_branch" if bool(np.asarray(cond).reshape(-1)[0]) else "else_branch")
    nodes, names = _inline(branch, prefix, {})
    for out, inner in zip(node.output, branch.output, strict=True):
        if out:
            nodes.append(helper.make_node("Identity", [names.get(inner.name, inner.name)], [out]))
    return nodes


# -- Loop -------------------------------------------------------------------------------------------


def _unroll(node: onnx.NodeProto, static: StaticValues, prefix: str) -> list[onnx.NodeProto]:
    body = attr(node, "body")
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
    if not const_true(static, cond_in):
        raise _Refused("its initial loop condition is not a constant true")
    n_carried = len(node.input) - 2
    carried = list(node.input[2:])
    scans: list[list[str]] = [[] for _ in body.output[1 + n_carried :]]
    if trips == 0 and scans:
        raise _Refused("it has scan outputs and a trip count of 0 (their shape is unknown)")
    nodes: list[onnx.NodeProto] = []
    axes0 = f"{prefix}axes0"
    nodes.append(constant(axes0, np.array([0], np.int64)))
    for i in range(trips):
        it, cond = f"{prefix}{i}/iter", f"{prefix}{i}/cond"
        nodes += [constant(it, np.array(i, np.int64)), constant(cond, np.array(True))]
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
        if not const_true(static, outs[0]):
            raise _Refused("its loop condition is computed at run time")
    for out, c in zip(node.output[:n_carried], carried, strict=True):
        if out:
            nodes.append(helper.make_node("Identity", [c], [out]))
    for out, parts in zip(node.output[n_carried:], scans, strict=True):
        if out:
            nodes.append(helper.make_node("Concat", parts, [out], axis=0))
    return nodes
