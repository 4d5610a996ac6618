"""Reading an ONNX model for import: load, check and upgrade it (`load_onnx`), rewrite GatherND row
reads as Gather (`gather_nd_rows`), and type its values the way onnxruntime does (`lenient_types`)."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference, version_converter

from transpiler.errors import ModelImportError
from transpiler.frontends.onnx.static import default_opset


class OnnxImportError(ModelImportError):
    """The model cannot be imported; the message says what to change."""


MIN_OPSET = 13  # older models are upgraded to it by onnx.version_converter


def load_onnx(model_or_path) -> onnx.ModelProto:
    """Parse, check (the checker's message on failure) and upgrade to MIN_OPSET if older."""
    where = ""
    if isinstance(model_or_path, (str, os.PathLike)):
        path = Path(model_or_path)
        where = f" {path}"
        if not path.is_file():
            raise OnnxImportError(f"no ONNX model at {path}")
        try:
            model = onnx.load(path)
        except Exception as e:  # protobuf's DecodeError and friends
            raise OnnxImportError(f"cannot parse{where} as an ONNX model: {e}") from None
        checked: onnx.ModelProto | str = str(path)  # by path: external data, models over 2 GB
    elif isinstance(model_or_path, onnx.ModelProto):
        model = checked = model_or_path
    else:
        raise TypeError(f"from_onnx takes an onnx.ModelProto or a path, not {type(model_or_path).__name__}")
    try:
        onnx.checker.check_model(checked)
    except onnx.checker.ValidationError as e:
        raise OnnxImportError(f"invalid ONNX model{where}: {e}") from None
    version = default_opset(model)
    if version < 7:
        model = _legacy_prelu_slopes(model)
    if version < MIN_OPSET:
        try:
            model = version_converter.convert_version(model, MIN_OPSET)
        except Exception as e:
            raise OnnxImportError(
                f"opset {version} model{where}: ONNX's version converter could not "
                f"upgrade it to opset {MIN_OPSET}: {e}"
            ) from None
    return model


def _legacy_prelu_slopes(model: onnx.ModelProto) -> onnx.ModelProto:
    """PRelu before opset 7 applied a [C] slope per channel (axis 1); from opset 7 on it broadcasts
    like numpy (trailing axes), and ONNX's version converter leaves it. Reshape such constant slopes
    to [C, 1, ...] so the upgraded model means what the old one did."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    inits = {t.name: t for t in model.graph.initializer}
    ranks = {
        n: len(s) for n, (_, s) in graph_types(infer_shapes(model) or model.graph).items() if s is not None
    }
    for node in model.graph.node:
        if node.op_type != "PRelu" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        slope = numpy_helper.to_array(inits[node.input[1]])
        rank = ranks.get(node.input[0], 0)
        if slope.ndim == 1 and slope.size > 1 and rank > 2:
            inits[node.input[1]].CopyFrom(
                numpy_helper.from_array(slope.reshape((-1,) + (1,) * (rank - 2)), node.input[1])
            )
            for vi in model.graph.input:  # IR < 4 lists initializers as inputs too
                if vi.name == node.input[1]:
                    vi.CopyFrom(
                        helper.make_tensor_value_info(
                            vi.name, vi.type.tensor_type.elem_type, [slope.size] + [1] * (rank - 2)
                        )
                    )
    return model


def graph_types(graph: onnx.GraphProto) -> dict[str, tuple[str | None, tuple[int, ...] | None]]:
    """(dtype, shape) of the graph's typed values (inputs, outputs, value_info)."""
    types = {}
    for what, vis in (
        ("graph input", graph.input),
        ("graph output", graph.output),
        ("value", graph.value_info),
    ):
        for vi in vis:
            types[vi.name] = tensor_type(vi, what)
    return types


def np_dtype(elem_type: int) -> str:
    """numpy dtype name of an ONNX TensorProto element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def tensor_type(vi: onnx.ValueInfoProto, what: str) -> tuple[str | None, tuple[int, ...] | None]:
    """(dtype, shape) of a value; unknown / symbolic dims are -1, an unknown shape is None."""
    if not vi.type.HasField("tensor_type"):
        kind = vi.type.WhichOneof("value") or "unknown"
        raise OnnxImportError(f"{what} {vi.name!r} has {kind} type; hetps imports tensors only")
    t = vi.type.tensor_type
    dtype = np_dtype(t.elem_type) if t.elem_type else None
    if not t.HasField("shape"):
        return dtype, None
    return dtype, tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)


class OnnxShapeWarning(UserWarning):
    """A declared shape disagreed with the computed one in a compatible way; the computed one is used."""


Shape = tuple[int, ...]


def infer_shapes(model: onnx.ModelProto) -> onnx.GraphProto | None:
    """ONNX's shape inference (propagating constant shape values when it can); None when it fails."""
    for data_prop in (True, False):
        try:
            return shape_inference.infer_shapes(model, data_prop=data_prop).graph
        except Exception:  # noqa: BLE001 - inference is a convenience: vars then keep unknown shapes
            continue
    return None


Dim = int | str | None  # fixed, symbolic (a dim_param), unknown


def _symbol(dim_param: str) -> str | None:
    """A symbolic dim's name; None for none or for the `unk__<k>` names ONNX's inference makes up
    for dims it could not tell."""
    return dim_param if dim_param and not dim_param.startswith("unk__") else None


def _dims(graph: onnx.GraphProto) -> dict[str, tuple[Dim, ...]]:
    """The dims of every typed value with a shape (tensors only)."""
    out = {}
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if t is not None and t.HasField("shape"):
            out[vi.name] = tuple(
                d.dim_value if d.HasField("dim_value") else _symbol(d.dim_param) for d in t.shape.dim
            )
    return out


def merge_shape(declared: tuple[Dim, ...], computed: tuple[Dim, ...]) -> tuple[Shape, bool] | None:
    """onnxruntime's lenient merge of a declared shape into the computed one: (the shape, -1 for
    symbolic / unknown dims; whether the declaration disagreed), or None when they are incompatible.

    Same rank: a computed fixed dim wins (a different declared fixed dim is incompatible), a computed
    symbolic dim wins over a declared fixed one (a disagreement), an unknown computed dim takes the
    declared one. Another rank: compatible when equal once size-1 dims are dropped (rank 0 vs [1],
    [N] vs [N, 1]; an unknown computed dim may be a 1); the computed shape wins (a disagreement),
    its one unknown dim worked out from a fully known declared size (rank 0 vs [?] gives [1]).
    """

    def fixed(d: Dim) -> bool:
        return isinstance(d, int)

    if len(declared) != len(computed):
        d1 = [d for d in declared if d != 1]
        c1 = [c for c in computed if c != 1 and c is not None]  # an unknown dim may be a 1
        if len(d1) != len(c1) or any(fixed(d) and fixed(c) and d != c for d, c in zip(d1, c1, strict=True)):
            return None
        shape = [c if fixed(c) else -1 for c in computed]
        if all(map(fixed, declared)) and computed.count(None) == 1 and shape.count(-1) == 1:
            size, rest = math.prod(declared), math.prod(c for c in shape if c != -1)
            if rest and size % rest == 0:  # the one unknown dim follows from the declared size
                shape[shape.index(-1)] = size // rest
        return tuple(shape), True
    shape, disagrees = [], False
    for d, c in zip(declared, computed, strict=True):
        if fixed(c):
            if fixed(d) and d != c:
                return None
            shape.append(c)
        elif c is None:  # inference could not tell: keep what the model says
            shape.append(d if fixed(d) else -1)
        else:
            disagrees |= fixed(d)
            shape.append(-1)
    return tuple(shape), disagrees


def lenient_types(model: onnx.ModelProto) -> dict[str, tuple[str | None, Shape | None]]:
    """(dtype, shape) of every value ONNX's shape inference can type, as onnxruntime sees them.

    Shapes are computed from the graph inputs with the declared graph-output and value-info shapes
    set aside, then the declarations are merged in (`merge_shape`): where one disagrees with the
    computed shape but is compatible (rank 0 vs [1], a fixed dim vs a symbolic one) the computed
    shape wins and one OnnxShapeWarning names the value; an incompatible declaration is an
    OnnxImportError. A value whose shape cannot be computed keeps its declared one.
    """
    types = graph_types(infer_shapes(model) or model.graph)  # the model's own declarations win here
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    del stripped.graph.value_info[:]
    for vi in stripped.graph.output:
        if vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
    computed_graph = infer_shapes(stripped)
    if computed_graph is None:
        return types
    declared = _dims(model.graph)
    outputs = {o.name for o in model.graph.output}
    for name, dims in _dims(computed_graph).items():
        dtype = types.get(name, (None, None))[0]
        if name not in declared:
            types[name] = (dtype, tuple(d if isinstance(d, int) else -1 for d in dims))
            continue
        merged = merge_shape(declared[name], dims)
        what = "graph output" if name in outputs else "value"
        show = (
            [d if d is not None else "?" for d in declared[name]],
            [d if d is not None else "?" for d in dims],
        )
        if merged is None:
            raise OnnxImportError(
                f"{what} {name!r} is declared with shape {show[0]}, but the graph computes {show[1]}; "
                "fix or remove the declaration (the model's value_info / graph output)"
            )
        shape, disagrees = merged
        if disagrees:
            warnings.warn(
                f"{what} {name!r}: declared shape {show[0]} disagrees with the computed "
                f"{show[1]}; using {list(shape)} (-1 = any), as onnxruntime's lenient merge "
                "does",
                OnnxShapeWarning,
                stacklevel=4,
            )
        types[name] = (dtype, shape)
    return types


def gather_nd_rows(model: onnx.ModelProto) -> onnx.ModelProto:
    """GatherND(data, indices) with batch_dims 0 and indices ending in a dim of 1 reads whole rows:
    it is Gather(data, Squeeze(indices, [-1]), axis 0), exactly. Rewritten so, a 2-D weight read
    that way is an embedding table too (paddle2onnx writes index lookups as GatherND)."""
    picked = [
        n
        for n in model.graph.node
        if n.op_type == "GatherND"
        and n.domain in ("", "ai.onnx")
        and not any(a.name == "batch_dims" and a.i != 0 for a in n.attribute)
    ]
    if not picked:
        return model
    shapes = graph_types(infer_shapes(model) or model.graph)
    rows = [n for n in picked if (shapes.get(n.input[1], (None, None))[1] or (0,))[-1:] == (1,)]
    if not rows:
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = []
    for node in model.graph.node:
        if any(node.output == r.output for r in rows):
            ids, axes = f"{node.output[0]}.row_ids", f"{node.output[0]}.last_axis"
            nodes += [
                helper.make_node(
                    "Constant", [], [axes], value=numpy_helper.from_array(np.array([-1], np.int64))
                ),
                helper.make_node("Squeeze", [node.input[1], axes], [ids]),
                helper.make_node("Gather", [node.input[0], ids], list(node.output), name=node.name, axis=0),
            ]
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model
