"""Shapes and small integer values known at import time even where some dims are not.

TorchScript writes `x.squeeze(dim)` as `If(Equal(Gather(Shape(x), dim), 1))` with a Squeeze and an
Identity branch. When x comes out of `Reshape(y, Concat(Slice(Shape(y)), [1, 12]))` and y's batch
is dynamic, x's shape is [batch, 1, 12]: dim 1 is 1 whatever the batch, but no value there is fully
known, so `static.StaticValues` (which evaluates fully known values only) cannot decide the
`If`. `shape_facts` propagates *partially* known shapes and values instead: every shape dim and
every element of a small integer tensor is an int or an `Unknown` that says where it came from
(which dim of which value), through Shape, Size, Slice, Gather, Concat, Reshape, Unsqueeze,
Squeeze, Cast, Identity and elementwise Add / Sub / Mul / Div / Equal / Less / Greater / Not. Dims
it proves are handed back to ONNX's shape inference (as value_info) so that they flow through the
other ops too, until nothing new is learnt.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from transpiler.frontends.onnx.model import infer_shapes
from transpiler.frontends.onnx.static import attr

MAX_VALUE = 64  # elements: a larger tensor is data, not shape arithmetic
MAX_ROUNDS = 8  # hand-backs to ONNX's shape inference


class Unknown:
    """A dim or element not known at import time; `reason` names where it comes from."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Unknown({self.reason!r})"


Dim = int | Unknown
Shape = tuple[Dim, ...]


@dataclass
class ShapeFacts:
    """Partially known shapes (`shapes`) and values (`values`: object arrays of Python numbers and
    `Unknown`s) of a graph's values."""

    shapes: dict[str, Shape] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)

    def value(self, name: str) -> np.ndarray | None:
        """The value of `name` when every element is known, else None."""
        v = self.values.get(name)
        if v is None or _first_unknown(v) is not None:
            return None
        return np.array(v.tolist())

    def unknown(self, name: str) -> str | None:
        """Where the first unknown element of `name` comes from (None: no partial value at all)."""
        v = self.values.get(name)
        u = None if v is None else _first_unknown(v)
        return u.reason if u is not None else None


def _first_unknown(v: np.ndarray) -> Unknown | None:
    return next((e for e in v.flat if isinstance(e, Unknown)), None)


def _known(shape: Shape | None) -> int:
    return -1 if shape is None else sum(isinstance(d, int) for d in shape)


def _obj(arr: np.ndarray) -> np.ndarray:
    return np.array(arr.tolist(), dtype=object) if arr.ndim else np.array(arr.item(), dtype=object)


# -- ONNX's shape inference, partially ----------------------------------------------------------
def _inferred(graph: onnx.GraphProto) -> tuple[dict[str, Shape], dict[str, int]]:
    """(shape, elem type) of every typed value; an unknown dim says which dim of which value it is."""
    shapes, types = {}, {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        types[vi.name] = t.elem_type
        if t.HasField("shape"):
            shapes[vi.name] = tuple(
                d.dim_value if d.HasField("dim_value") else Unknown(_dim_reason(vi.name, i, d.dim_param))
                for i, d in enumerate(t.shape.dim)
            )
    return shapes, types


def _dim_reason(name: str, i: int, symbol: str) -> str:
    named = symbol and not symbol.startswith("unk__")  # ONNX's inference names dims it cannot tell unk__k
    return f"dim {i} of {name!r}" + (f" (symbolic {symbol!r})" if named else "")


def shape_facts(model: onnx.ModelProto) -> ShapeFacts:
    """Propagate partial shapes and values through the top-level graph, handing the dims proved
    back to ONNX's shape inference until it learns nothing new (at most MAX_ROUNDS times)."""
    work, facts = model, ShapeFacts()
    for _ in range(MAX_ROUNDS):
        graph = infer_shapes(work) or work.graph
        inferred, types = _inferred(graph)
        facts = _propagate(work.graph, inferred)
        outputs = {o.name for o in work.graph.output}  # declared by the model: left alone
        better = {
            n
            for n, s in facts.shapes.items()
            if n in types and n not in outputs and _known(s) > _known(inferred.get(n))
        }
        if not better:
            break
        if work is model:  # the caller's model stays as it is
            work = onnx.ModelProto()
            work.CopyFrom(model)
        infos = [vi for vi in work.graph.value_info if vi.name not in better]
        infos += [
            helper.make_tensor_value_info(
                n, types[n], [d if isinstance(d, int) else None for d in facts.shapes[n]]
            )
            for n in sorted(better)
        ]
        del work.graph.value_info[:]
        work.graph.value_info.extend(infos)
    return facts


# -- one node at a time --------------------------------------------------------------------------
def _propagate(graph: onnx.GraphProto, inferred: dict[str, Shape]) -> ShapeFacts:
    facts = ShapeFacts(dict(inferred))
    for t in graph.initializer:
        if int(np.prod(t.dims, dtype=np.int64)) <= MAX_VALUE:  # (tables are not read)
            _set_const(facts, t.name, numpy_helper.to_array(t))
        else:
            facts.shapes[t.name] = tuple(t.dims)
    for node in graph.node:
        rule = _RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if rule is None:
            continue
        try:
            rule(node, facts)
        except (ValueError, TypeError, IndexError, ZeroDivisionError, OverflowError):
            continue  # not shape arithmetic this module can follow: ONNX's inferred shapes stand
    return facts


def _set_const(facts: ShapeFacts, name: str, arr: np.ndarray) -> None:
    facts.shapes[name] = tuple(arr.shape)
    if arr.size <= MAX_VALUE and arr.dtype.kind in "biuf":
        facts.values[name] = _obj(arr)


def _set(facts: ShapeFacts, name: str, shape: Shape | None, value: np.ndarray | None = None) -> None:
    """Record an output: a proved dim wins over ONNX's unknown one, a known one stays."""
    if value is not None:
        value = np.asarray(value, dtype=object)
        facts.values[name] = value
        shape = tuple(value.shape)
    if shape is None:
        return
    old = facts.shapes.get(name)
    if old is not None and len(old) == len(shape):
        shape = tuple(
            o if isinstance(o, int) and not isinstance(d, int) else d for o, d in zip(old, shape, strict=True)
        )
    facts.shapes[name] = shape


def _arg(node: onnx.NodeProto, facts: ShapeFacts, k: int, name: str):
    """A fully known argument: input k when present (its value), else attribute `name`."""
    if len(node.input) > k and node.input[k]:
        v = facts.value(node.input[k])
        if v is None:
            raise ValueError(f"argument {name} not known")
        return v.tolist()
    return attr(node, name)


def _constant(node, facts):
    a = node.attribute[0]
    if a.name == "value":
        _set_const(facts, node.output[0], numpy_helper.to_array(a.t))
    elif a.name in ("value_int", "value_ints", "value_float", "value_floats"):
        _set_const(facts, node.output[0], np.array(helper.get_attribute_value(a)))


def _shape(node, facts):
    s = facts.shapes.get(node.input[0])
    if s is not None:
        start, end = attr(node, "start", 0), attr(node, "end", None)
        _set(facts, node.output[0], None, np.array(list(s[start:end]) or [], dtype=object).reshape(-1))


def _size(node, facts):
    s = facts.shapes.get(node.input[0])
    if s is not None:
        u = next((d for d in s if isinstance(d, Unknown)), None)
        _set(
            facts,
            node.output[0],
            None,
            np.array(u if u is not None else int(np.prod(s, dtype=np.int64)), dtype=object),
        )


def _gather(node, facts):
    v = facts.values.get(node.input[0])
    idx = facts.value(node.input[1])
    if v is not None and idx is not None:
        axis = attr(node, "axis", 0) % v.ndim
        idx = np.where(idx < 0, idx + v.shape[axis], idx)
        _set(facts, node.output[0], None, np.take(v, idx, axis=axis))


def _slice(node, facts):
    v = facts.values.get(node.input[0])
    if v is None:
        return
    starts, ends = _arg(node, facts, 1, "starts"), _arg(node, facts, 2, "ends")
    axes = _arg(node, facts, 3, "axes") or list(range(len(starts)))
    steps = _arg(node, facts, 4, "steps") or [1] * len(starts)
    index = [slice(None)] * v.ndim
    for st, en, ax, sp in zip(starts, ends, axes, steps, strict=True):
        index[ax % v.ndim] = slice(*slice(int(st), int(en), int(sp)).indices(v.shape[ax % v.ndim]))
    _set(facts, node.output[0], None, v[tuple(index)])


def _concat(node, facts):
    parts = [facts.values.get(n) for n in node.input]
    if parts and all(p is not None for p in parts):
        _set(facts, node.output[0], None, np.concatenate(parts, axis=attr(node, "axis", 0)))


def _reshape(node, facts):
    data, target = facts.shapes.get(node.input[0]), facts.values.get(node.input[1])
    if data is None or target is None or target.ndim != 1:
        return
    allowzero = attr(node, "allowzero", 0)
    out = [data[i] if (isinstance(d, int) and d == 0 and not allowzero) else d for i, d in enumerate(target)]
    if sum(isinstance(d, int) and d == -1 for d in out) == 1:
        rest = [d for d in out if not (isinstance(d, int) and d == -1)]
        if all(isinstance(d, int) for d in (*data, *rest)):
            out = [
                int(np.prod(data)) // int(np.prod(rest)) if isinstance(d, int) and d == -1 else d for d in out
            ]
        else:
            out = [
                Unknown(f"the -1 of Reshape {node.output[0]!r}") if isinstance(d, int) and d == -1 else d
                for d in out
            ]
    v = facts.values.get(node.input[0])
    if v is not None and all(isinstance(d, int) for d in out):
        _set(facts, node.output[0], None, v.reshape(out))
    else:
        _set(facts, node.output[0], tuple(out))


def _axes(node, facts, rank: int) -> list[int]:
    axes = _arg(node, facts, 1, "axes")
    if axes is None:
        raise ValueError("no axes")
    return sorted(int(a) % rank for a in axes)


def _unsqueeze(node, facts):
    s = facts.shapes.get(node.input[0])
    if s is None:
        return
    n_axes = len(_arg(node, facts, 1, "axes"))
    out = list(s)
    for a in _axes(node, facts, len(s) + n_axes):
        out.insert(a, 1)
    _reshaped(node, facts, tuple(out))


def _squeeze(node, facts):
    s = facts.shapes.get(node.input[0])
    if s is None:
        return
    axes = _axes(node, facts, len(s))
    _reshaped(node, facts, tuple(d for i, d in enumerate(s) if i not in axes))


def _reshaped(node, facts, shape: Shape) -> None:
    v = facts.values.get(node.input[0])
    if v is not None:
        _set(facts, node.output[0], None, v.reshape([int(d) for d in shape]))
    else:
        _set(facts, node.output[0], shape)


def _identity(node, facts):
    _set(facts, node.output[0], facts.shapes.get(node.input[0]), facts.values.get(node.input[0]))


def _cast(node, facts):
    v = facts.values.get(node.input[0])
    if v is None:
        return _identity(node, facts)
    kind = np.dtype(helper.tensor_dtype_to_np_dtype(attr(node, "to"))).kind
    convert = {"b": bool, "i": int, "u": int, "f": float}.get(kind)
    if convert is not None:
        _set(facts, node.output[0], None, _elementwise(convert, v))


def _elementwise(fn: Callable, *arrays: np.ndarray) -> np.ndarray:
    """fn over broadcast object arrays; an element with an Unknown operand is that Unknown."""

    def one(*xs):
        return next((x for x in xs if isinstance(x, Unknown)), None) or fn(*xs)

    return np.asarray(np.frompyfunc(one, len(arrays), 1)(*arrays), dtype=object)


def _int_div(a, b):
    """ONNX Div: true division of floats, integers truncated toward zero."""
    if isinstance(a, float) or isinstance(b, float):
        return a / b
    q = abs(a) // abs(b)
    return -q if (a < 0) != (b < 0) else q


def _binary(fn: Callable):
    def rule(node, facts):
        a, b = facts.values.get(node.input[0]), facts.values.get(node.input[1])
        if a is not None and b is not None:
            _set(facts, node.output[0], None, _elementwise(fn, a, b))

    return rule


def _not(node, facts):
    v = facts.values.get(node.input[0])
    if v is not None:
        _set(facts, node.output[0], None, _elementwise(operator.not_, v))


_RULES: dict[str, Callable[[onnx.NodeProto, ShapeFacts], None]] = {
    "Constant": _constant,
    "Shape": _shape,
    "Size": _size,
    "Gather": _gather,
    "Slice": _slice,
    "Concat": _concat,
    "Reshape": _reshape,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Identity": _identity,
    "Cast": _cast,
    "Not": _not,
    "Add": _binary(operator.add),
    "Sub": _binary(operator.sub),
    "Mul": _binary(operator.mul),
    "Div": _binary(_int_div),
    "Equal": _binary(operator.eq),
    "Less": _binary(operator.lt),
    "Greater": _binary(operator.gt),
}


class LazyShapeFacts:
    """`shape_facts(model)`, computed on first use (most Ifs fold without it)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        self._facts: ShapeFacts | None = None

    def get(self) -> ShapeFacts:
        if self._facts is None:
            self._facts = shape_facts(self._model)
        return self._facts
