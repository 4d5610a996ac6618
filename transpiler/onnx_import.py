"""from_onnx: an ONNX model -> a hetps Program that carries its parameter values.

The mapping is thin because the registry follows ONNX: `OpDef.onnx` names an op's ONNX type and its
slots are the schema's input/output names, so a node's positional inputs land in slots by
`onnx.defs.get_schema(type, opset)`. What import adds on top:

- float initializers other than 0-d ones (torch's dynamo exporter stores scalar constants as
  initializers), and float `Constant`s of more than one element (paddle2onnx stores weights that
  way), become trainable parameters whose values travel in `program.params`; other constants read
  as tensors become `constant` ops (values in the program) up to MAX_PROGRAM_CONSTANT elements,
  persistable non-trainable vars beyond;
- a constant input that ONNX passes as a tensor but the op also takes as an attribute of the same
  name (Reshape's shape, Reduce*'s axes, Slice's starts, Dropout's ratio, ...) is folded into it;
- `Identity` is folded away (kept only where it produces a graph output);
- a `Gather` (axis 0) whose data is a 2-D float initializer used only by such Gathers becomes an
  `embedding` lookup of a sparse table (row-sparse gradient, a parameter-server table candidate);
- graph inputs become `data` ops (category io), so placement sees where data enters;
- models older than opset 13 are upgraded by ONNX's own version converter first;
- control flow is made straight-line first (`onnx_control_flow.straighten`): an `If` on a condition
  known at import time is folded, torch's `nn.EmbeddingBag` Loop becomes a pooled `embedding_bag`
  lookup (its table a sparse one), a `Loop` with an import-time trip count is unrolled; any other
  Loop / If is refused with the node named and the reason;
- nodes of the domain ai.hetps (what `to_onnx` writes for hetps-only ops) import as those ops;
- shapes are lenient like onnxruntime's: a declared graph-output / value-info shape that disagrees
  with the computed one but is compatible (rank 0 vs [1], a fixed dim vs a symbolic one) gives way to
  the computed one with an OnnxShapeWarning naming the value (`lenient_types`).
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import defs, helper, numpy_helper, shape_inference, version_converter

from ops_registry import by_onnx, get_op, has_op, list_ops

from .ir import Program, Var
from .onnx_control_flow import HETPS_DOMAIN, refusal_key, straighten

log = logging.getLogger("hetps.onnx")

MAX_PROGRAM_CONSTANT = 4096  # elements: a smaller non-trainable constant is a `constant` op, not a
# persistable var (which a transpiled plan would serve from a parameter server, pulled every step)
MIN_OPSET = 13  # older models are upgraded to it by onnx.version_converter
LOSSES = ("bce", "bce_with_logits", "mse", "softmax_ce")

# ONNX renamed some slots between opsets; our ops use the newest names (BatchNormalization-9 -> 15).
SLOT_ALIASES = {"BatchNormalization": {"mean": "input_mean", "var": "input_var"}}
OUT_SLOT_ALIASES = {"BatchNormalization": {"mean": "running_mean", "var": "running_var"}}
# ONNX defaults of optional tensor inputs that differ from our ops' attribute defaults.
ABSENT_INPUT_DEFAULTS = {"Dropout": {"training_mode": 0}}


class OnnxImportError(ValueError):
    """The model cannot be imported; the message says what to change."""


class UnsupportedOnnxOpsError(OnnxImportError):
    """The graph uses op types hetps does not implement; `unsupported` maps each to its nodes."""

    def __init__(self, unsupported: dict[str, list[str]]) -> None:
        self.unsupported = unsupported
        lines = [f"  {t}: {', '.join(nodes)}" for t, nodes in sorted(unsupported.items())]
        super().__init__(f"{len(unsupported)} unsupported ONNX op type(s) (nodes listed):\n"
                         + "\n".join(lines) + "\nsupported: " + ", ".join(supported_onnx_ops()))


def supported_onnx_ops() -> list[str]:
    """The ONNX op types (default domain) that from_onnx maps."""
    types = {get_op(n).onnx for n in list_ops() if get_op(n).onnx}
    return sorted(types | {"Constant"})


def from_onnx(model_or_path: onnx.ModelProto | str | os.PathLike, loss: str | None = None,
              label: str | None = None, *, dynamic_batch: bool = True, pred: str | None = None,
              log_clamp: float | None = None, stable_log: bool = True) -> Program:
    """Import an ONNX model (a ModelProto or a path; external data files beside it are loaded).

    Variable names are the ONNX value names; `program.fetch_names` lists the graph outputs
    and `program.params` holds the parameter values, so `Executor().run(program, feed, fetch_list)`
    runs it as is. `loss` ("bce" on probabilities, "bce_with_logits", "mse", or "softmax_ce" with
    class ids, class axis 1) attaches a mean loss on the first graph output against a new data input
    `label` (default "label"); without it, a graph whose first scalar float output is a loss is
    trainable as is. Either way `program.attrs["loss_name"]` names the loss.

    - `dynamic_batch`: a batch size fixed in the graph's inputs (a traced export) is made dynamic
      when nothing in the graph depends on it (see `transpiler.onnx_batch`); logged either way.
    - `pred`: for a loss inside the graph, the tensor holding the prediction (probability or logit)
      to score the AUC with; by default it is found in a binary cross-entropy written as raw
      `Log`/`Sigmoid` ops. `program.attrs["score_names"]` = [prediction, label] when known.
    - `log_clamp`: an opt-in change of the model's maths: every `Log` the in-graph loss is computed
      from reads `Clip(x, min=log_clamp)`, as torch's BCELoss clamps and its export does not.
      With `stable_log`, it applies to the Logs the rewrite leaves.
    - `stable_log` (default True): the in-graph loss's `Log(Sigmoid(z))` is evaluated as
      `-Softplus(-z)` and `Log(1 - Sigmoid(z))` as `-Softplus(z)` (see `transpiler.onnx_loss`):
      the same function, more accurate in float32, finite where the sigmoid saturates; logged.
    """
    from .onnx_batch import BatchDim, free_batch, leading_batch

    model = _load(model_or_path)
    fixed = leading_batch(model)
    batch = BatchDim(fixed, False, "dynamic_batch=False") if fixed else BatchDim()
    if not dynamic_batch:
        straight = straighten(model)
    else:
        freed, freed_batch = free_batch(model)
        straight = straighten(freed)
        # control flow resolved only on the traced shapes (an If on Shape(x)[0]): keep them
        kept = straighten(model) if freed_batch.freed and straight.refused else None
        if kept is not None and len(kept.refused) < len(straight.refused):
            straight = kept
            batch = BatchDim(fixed, False, "the graph's control flow is resolved from the input shapes")
        else:
            model, batch = freed, freed_batch
    if batch.message():
        log.warning("%s", batch.message())
    program = _Importer(straight.model, straight.refused).build()
    outputs = program.attrs["fetch_names"]
    if loss is not None:
        if pred is not None or log_clamp is not None:
            raise OnnxImportError("pred / log_clamp apply to a loss inside the graph, not to an attached "
                                  f"loss={loss!r} (whose prediction is the first output)")
        attach_loss(program, outputs[0], loss, label or "label")
        return program
    for name in outputs:
        v = program.var(name)
        if v.shape is not None and len(v.shape) <= 1 and all(d == 1 for d in v.shape) \
                and np.dtype(v.dtype).kind == "f":
            program.attrs["loss_name"] = name
            break
    return _score_in_graph_loss(model, program, pred, log_clamp, stable_log)


def _score_in_graph_loss(model: onnx.ModelProto, program: Program, pred: str | None,
                         log_clamp: float | None, stable_log: bool) -> Program:
    """The in-graph loss's prediction and label (`score_names`), its Log(Sigmoid) patterns
    evaluated stably (`stable_log`) and its other Logs clamped when asked."""
    from .onnx_loss import clamp_logs, find_score, stable_logs, unclamped_logs

    loss = program.attrs.get("loss_name")
    if loss is None:
        if pred is not None or log_clamp is not None:
            raise OnnxImportError("pred / log_clamp need a loss: the graph has no scalar float output; "
                                  "attach one with loss=... (CLI: --loss)")
        return program
    score = find_score(model, loss, pred)  # on the graph as exported: its Sigmoid is the prediction
    rewritten = model
    if stable_log:
        rewritten, done = stable_logs(model, loss)
        if done:
            log.warning("stable_log: %d Log node(s) of the loss %r evaluated exactly without overflow (%s); "
                        "import with stable_log=False (CLI: --no-stable-log) to keep the exported ops",
                        len(done), loss, "; ".join(map(str, done)))
    if log_clamp is not None:
        rewritten, n = clamp_logs(rewritten, loss, log_clamp)
        if n or not stable_log:
            log.warning("log_clamp=%g: %d Log node(s) of the loss %r read Clip(x, min=%g)%s", log_clamp, n,
                        loss, log_clamp, " (the ones stable_log left)" if stable_log else "")
        else:
            log.warning("log_clamp=%g: no Log of the loss %r is left to clamp (stable_log rewrote them); "
                        "import with stable_log=False (CLI: --no-stable-log) to clamp the exported ones",
                        log_clamp, loss)
    elif n := unclamped_logs(rewritten, loss):
        log.warning("the loss %r takes the Log of %d value(s) with no clamp: a saturated prediction gives "
                    "log(0) = -inf and NaN gradients. torch's BCELoss clamps its logs, its export does not; "
                    "to clamp, import with log_clamp=1e-7 (CLI: --clamp-log 1e-7)", loss, n)
    if rewritten is not model:
        attrs = program.attrs
        straight = straighten(rewritten)
        program = _Importer(straight.model, straight.refused).build()
        program.attrs["loss_name"] = attrs["loss_name"]
    if score is None:
        return program
    for name in (score.pred, score.label):
        if not program.global_block().has_var(name):
            raise OnnxImportError(f"pred {name!r} is folded away on import (an Identity output); name "
                                  "the tensor the Identity reads")
    program.attrs["score_names"] = [score.pred, score.label]
    return program


def _load(model_or_path) -> onnx.ModelProto:
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
            raise OnnxImportError(f"opset {version} model{where}: ONNX's version converter could not "
                                  f"upgrade it to opset {MIN_OPSET}: {e}") from None
    return model


def _legacy_prelu_slopes(model: onnx.ModelProto) -> onnx.ModelProto:
    """PRelu before opset 7 applied a [C] slope per channel (axis 1); from opset 7 on it broadcasts
    like numpy (trailing axes), and ONNX's version converter leaves it. Reshape such constant slopes
    to [C, 1, ...] so the upgraded model means what the old one did."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    inits = {t.name: t for t in model.graph.initializer}
    ranks = {n: len(s) for n, (_, s) in _graph_types(_infer(model) or model.graph).items() if s is not None}
    for node in model.graph.node:
        if node.op_type != "PRelu" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        slope = numpy_helper.to_array(inits[node.input[1]])
        rank = ranks.get(node.input[0], 0)
        if slope.ndim == 1 and slope.size > 1 and rank > 2:
            inits[node.input[1]].CopyFrom(numpy_helper.from_array(
                slope.reshape((-1,) + (1,) * (rank - 2)), node.input[1]))
            for vi in model.graph.input:  # IR < 4 lists initializers as inputs too
                if vi.name == node.input[1]:
                    vi.CopyFrom(helper.make_tensor_value_info(
                        vi.name, vi.type.tensor_type.elem_type, [slope.size] + [1] * (rank - 2)))
    return model


def _graph_types(graph: onnx.GraphProto) -> dict[str, tuple[str | None, tuple[int, ...] | None]]:
    """(dtype, shape) of the graph's typed values (inputs, outputs, value_info)."""
    types = {}
    for what, vis in (("graph input", graph.input), ("graph output", graph.output),
                      ("value", graph.value_info)):
        for vi in vis:
            types[vi.name] = _tensor_type(vi, what)
    return types


def default_opset(model: onnx.ModelProto) -> int:
    """The model's ai.onnx opset version (the newest known when it imports none)."""
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return defs.onnx_opset_version()


def np_dtype(elem_type: int) -> str:
    """numpy dtype name of an ONNX TensorProto element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def _tensor_type(vi: onnx.ValueInfoProto, what: str) -> tuple[str | None, tuple[int, ...] | None]:
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


def _infer(model: onnx.ModelProto) -> onnx.GraphProto | None:
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
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else _symbol(d.dim_param)
                                 for d in t.shape.dim)
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
    types = _graph_types(_infer(model) or model.graph)  # the model's own declarations win here
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    del stripped.graph.value_info[:]
    for vi in stripped.graph.output:
        if vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
    computed_graph = _infer(stripped)
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
        show = [d if d is not None else "?" for d in declared[name]], \
            [d if d is not None else "?" for d in dims]
        if merged is None:
            raise OnnxImportError(
                f"{what} {name!r} is declared with shape {show[0]}, but the graph computes {show[1]}; "
                "fix or remove the declaration (the model's value_info / graph output)")
        shape, disagrees = merged
        if disagrees:
            warnings.warn(f"{what} {name!r}: declared shape {show[0]} disagrees with the computed "
                          f"{show[1]}; using {list(shape)} (-1 = any), as onnxruntime's lenient merge "
                          "does", OnnxShapeWarning, stacklevel=4)
        types[name] = (dtype, shape)
    return types


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    a = node.attribute[0]
    if a.name == "value":
        return numpy_helper.to_array(a.t)
    plain = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
             "value_ints": np.int64}
    if a.name not in plain:
        raise OnnxImportError(f"Constant node {node.name!r}: {a.name} (strings / sparse tensors) is "
                              "not supported")
    return np.array(helper.get_attribute_value(a), dtype=plain[a.name])


def _attr_value(op_type: str, a: onnx.AttributeProto) -> dict[str, Any]:
    """Our attrs for one ONNX attribute (ONNX names; dtypes as numpy names, bytes as str)."""
    v = helper.get_attribute_value(a)
    if op_type == "ConstantOfShape" and a.name == "value":
        arr = numpy_helper.to_array(v).reshape(-1)
        return {"value": arr[0].item(), "dtype": arr.dtype.name}
    if op_type == "Cast" and a.name == "to":
        return {"to": np_dtype(v)}
    if isinstance(v, bytes):
        v = v.decode()
    elif isinstance(v, list) and v and isinstance(v[0], bytes):
        v = [x.decode() for x in v]
    elif isinstance(v, (onnx.TensorProto, onnx.GraphProto)):
        raise OnnxImportError(f"{op_type} attribute {a.name!r}: tensor / graph attributes are not supported")
    return {a.name: v}


def _node_desc(node: onnx.NodeProto, i: int) -> str:
    return node.name or f"#{i} ({', '.join(node.output)})"


def gather_nd_rows(model: onnx.ModelProto) -> onnx.ModelProto:
    """GatherND(data, indices) with batch_dims 0 and indices ending in a dim of 1 reads whole rows:
    it is Gather(data, Squeeze(indices, [-1]), axis 0), exactly. Rewritten so, a 2-D weight read
    that way is an embedding table too (paddle2onnx writes index lookups as GatherND)."""
    picked = [n for n in model.graph.node if n.op_type == "GatherND" and n.domain in ("", "ai.onnx")
              and not any(a.name == "batch_dims" and a.i != 0 for a in n.attribute)]
    if not picked:
        return model
    shapes = _graph_types(_infer(model) or model.graph)
    rows = [n for n in picked if (shapes.get(n.input[1], (None, None))[1] or (0,))[-1:] == (1,)]
    if not rows:
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = []
    for node in model.graph.node:
        if any(node.output == r.output for r in rows):
            ids, axes = f"{node.output[0]}.row_ids", f"{node.output[0]}.last_axis"
            nodes += [helper.make_node("Constant", [], [axes],
                                       value=numpy_helper.from_array(np.array([-1], np.int64))),
                      helper.make_node("Squeeze", [node.input[1], axes], [ids]),
                      helper.make_node("Gather", [node.input[0], ids], list(node.output), name=node.name,
                                       axis=0)]
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


class _Importer:
    """One import: constants, aliases (folded Identity), then vars and ops in graph order."""

    def __init__(self, model: onnx.ModelProto, refused: dict[str, str] | None = None) -> None:
        self.refused = refused or {}  # control flow `straighten` left in the graph: why
        model = self.model = gather_nd_rows(model)
        self.graph = model.graph
        self.opset = default_opset(model)
        self.outputs = [o.name for o in self.graph.output]
        self.program = Program()
        self.types: dict[str, tuple[str | None, tuple[int, ...] | None]] = {}
        self.consts: dict[str, np.ndarray] = {}
        self.weights: set[str] = set()  # consts that become trainable parameters
        self.alias: dict[str, str] = {}
        self.used: set[str] = set()  # consts read as tensors (not folded into attributes)
        self.tables: set[str] = set()

    # -- analysis ----------------------------------------------------------------------
    def _check_supported(self) -> None:
        bad: dict[str, list[str]] = {}
        for i, node in enumerate(self.graph.node):
            if node.domain == HETPS_DOMAIN and has_op(node.op_type):
                continue  # a hetps op (written by to_onnx, or by straighten for EmbeddingBag)
            if node.domain not in ("", "ai.onnx"):
                bad.setdefault(f"{node.domain}::{node.op_type}", []).append(_node_desc(node, i))
            elif node.op_type != "Constant" and by_onnx(node.op_type) is None:
                why = self.refused.get(refusal_key(node))
                bad.setdefault(node.op_type, []).append(_node_desc(node, i) + (f" ({why})" if why else ""))
        if bad:
            raise UnsupportedOnnxOpsError(bad)

    def _infer_types(self) -> None:
        self.types.update(lenient_types(self.model))

    def _collect_constants(self) -> None:
        for t in self.graph.initializer:
            arr = numpy_helper.to_array(t)
            self.consts[t.name] = arr
            if arr.dtype.kind == "f" and arr.ndim > 0:  # 0-d: a constant (dynamo's val_<k>, a Pow's 2)
                self.weights.add(t.name)
        if self.graph.sparse_initializer:
            raise OnnxImportError("sparse initializers are not supported: store them dense")
        for node in self.graph.node:
            if node.op_type == "Constant":
                arr = _constant_value(node)
                self.consts[node.output[0]] = arr
                if arr.dtype.kind == "f" and arr.size > 1:
                    self.weights.add(node.output[0])

    def _find_tables(self) -> None:
        """2-D float weights read only as Gather(axis 0) data: embedding tables."""
        readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in self.graph.node:
            for k, n in enumerate(node.input):
                readers.setdefault(self.resolve(n), []).append((node, k))
        for name in self.weights:
            uses = readers.get(name, [])
            if self.consts[name].ndim == 2 and uses and name not in self.outputs and all(
                    k == 0 and (node.op_type == "Gather" and self._axis(node) == 0
                                or node.domain == HETPS_DOMAIN and node.op_type == "embedding_bag")
                    for node, k in uses):
                self.tables.add(name)

    @staticmethod
    def _axis(node: onnx.NodeProto) -> int:
        return next((a.i for a in node.attribute if a.name == "axis"), 0)

    def resolve(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    # -- conversion ----------------------------------------------------------------------
    def build(self) -> Program:
        self._check_supported()
        self._infer_types()
        self._collect_constants()
        for node in self.graph.node:  # fold Identity first: table detection looks through it
            if node.op_type == "Identity" and node.output[0] not in self.outputs:
                self.alias[node.output[0]] = node.input[0]
        self._find_tables()
        pending = [self._convert(i, node) for i, node in enumerate(self.graph.node)
                   if node.op_type != "Constant" and node.output[0] not in self.alias]
        self._declare_vars(pending)
        for op_type, ins, outs, attrs in pending:
            self.program.append_op(op_type, ins, outs, attrs)
        self.program.attrs.update(fetch_names=list(self.outputs), onnx_opset=self.opset)
        return self.program

    def _convert(self, i: int, node: onnx.NodeProto) -> tuple[str, dict, dict, dict]:
        if node.domain == HETPS_DOMAIN:
            return self._convert_hetps(node)
        schema = defs.get_schema(node.op_type, self.opset, node.domain)
        inputs = [self.resolve(n) if n else "" for n in node.input]
        if node.op_type == "Gather" and inputs[0] in self.tables:
            self.used.add(inputs[0])
            return "embedding", {"W": [inputs[0]], "Ids": [inputs[1]]}, \
                {"Out": [node.output[0]]}, {"is_sparse": 1}
        opdef = by_onnx(node.op_type)
        attrs: dict[str, Any] = {}
        for a in schema.attributes.values():
            if a.default_value.name:
                attrs.update(_attr_value(node.op_type, a.default_value))
        for a in node.attribute:
            attrs.update(_attr_value(node.op_type, a))
        ins: dict[str, list[str]] = {}
        aliases = SLOT_ALIASES.get(node.op_type, {})
        for k, name in enumerate(inputs):
            formal = schema.inputs[min(k, len(schema.inputs) - 1)]
            slot = aliases.get(formal.name, formal.name)
            if slot not in opdef.in_slots:
                raise OnnxImportError(f"{node.op_type} node {_node_desc(node, i)}: input {formal.name!r} "
                                      f"has no slot in hetps op {opdef.name!r} ({opdef.in_slots})")
            if not name:
                continue
            if slot in opdef.attrs and name in self.consts:  # a constant argument: fold it
                attrs[slot] = self.consts[name].tolist()
                continue
            ins.setdefault(slot, []).append(name)
            self.used.add(name)
        for slot, value in ABSENT_INPUT_DEFAULTS.get(node.op_type, {}).items():
            if slot not in ins and slot not in attrs:
                attrs[slot] = value
        if node.op_type == "Split" and "split" not in ins and attrs.get("split") is None \
                and not attrs.get("num_outputs"):
            attrs["num_outputs"] = len(node.output)
        outs: dict[str, list[str]] = {}
        out_aliases = OUT_SLOT_ALIASES.get(node.op_type, {})
        for k, name in enumerate(node.output):
            formal = schema.outputs[min(k, len(schema.outputs) - 1)]
            slot = out_aliases.get(formal.name, formal.name)
            if name and slot not in opdef.out_slots:
                raise OnnxImportError(f"{node.op_type} node {_node_desc(node, i)}: output {formal.name!r} "
                                      f"is not produced by hetps op {opdef.name!r} ({opdef.out_slots})")
            if name:
                outs.setdefault(slot, []).append(name)
        if opdef.differentiable:  # gradient rules read outputs ONNX lets a node omit (mask, log_prob)
            for slot in opdef.out_slots:
                if slot not in outs and not opdef.is_variadic(slot):
                    outs[slot] = [f"{node.output[0]}.{slot}"]
        return opdef.name, ins, outs, attrs

    def _convert_hetps(self, node: onnx.NodeProto) -> tuple[str, dict, dict, dict]:
        """A node of domain ai.hetps: a hetps op, its slot layout in hetps_inputs / hetps_outputs
        ("slot:count,..."), its other attributes plain."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        slots = []
        for names, layout in ((node.input, attrs.pop("hetps_inputs", "")),
                              (node.output, attrs.pop("hetps_outputs", ""))):
            out, k = {}, 0
            for part in filter(None, layout.split(",")):
                slot, count = part.split(":")
                out[slot] = [self.resolve(n) for n in names[k:k + int(count)]]
                k += int(count)
            slots.append(out)
        attrs.pop("op_role", None)
        if node.op_type == "embedding_bag":
            attrs["is_sparse"] = int(slots[0]["W"][0] in self.tables)
        self.used.update(n for names in slots[0].values() for n in names)
        return node.op_type, slots[0], slots[1], attrs

    def _declare_vars(self, pending: list[tuple[str, dict, dict, dict]]) -> None:
        block, program = self.program.global_block(), self.program
        for vi in self.graph.input:
            if vi.name in self.consts:  # an initializer listed as input (IR < 4): a parameter
                continue
            dtype, shape = _tensor_type(vi, "graph input")
            block.create_var(vi.name, shape=shape, dtype=dtype or "float32", stop_gradient=True)
            program.append_op("data", {}, {"Out": [vi.name]},
                              {"shape": list(shape) if shape is not None else None, "dtype": dtype})
        for name, arr in self.consts.items():
            if name not in self.used and name not in self.outputs:
                continue  # folded into attributes, or unused
            w = name in self.weights
            if not w and arr.size <= MAX_PROGRAM_CONSTANT and name not in self.outputs:
                block.create_var(name, shape=arr.shape, dtype=arr.dtype.name, trainable=False,
                                 stop_gradient=True)
                program.append_op("constant", {}, {"output": [name]},
                                  {"value": arr.tolist(), "dtype": arr.dtype.name})
                continue
            block.create_var(name, shape=arr.shape, dtype=arr.dtype.name, persistable=True,
                             is_parameter=w, trainable=w, stop_gradient=not w,
                             is_sparse=name in self.tables)
            program.params[name] = np.array(arr)  # owned and writable: optimizers update in place
        for _, _, outs, _ in pending:
            for names in outs.values():
                for n in names:
                    dtype, shape = self.types.get(n, (None, None))
                    block.create_var(n, shape=shape, dtype=dtype or "float32")


def attach_loss(program: Program, output: str, loss: str, label: str = "label") -> Var:
    """Append a data input `label` and a mean `loss` of `output` against it; set loss_name.

    bce: binary cross entropy on probabilities (logs floored at -100); bce_with_logits: the same
    on logits, computed stably; mse: mean squared error; softmax_ce: cross entropy of softmax over
    class axis 1 against int64 class ids (label shape = output's without that axis).
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, not {loss!r}")
    block = program.global_block()
    if block.has_var(label):
        raise OnnxImportError(f"label name {label!r} is already a variable of the model; pass "
                              "label=<an unused name>")
    pred = program.var(output)
    shape = pred.shape
    if loss == "softmax_ce":
        shape = None if shape is None else shape[:1] + shape[2:]
    dtype = "int64" if loss == "softmax_ce" else pred.dtype
    block.create_var(label, shape=shape, dtype=dtype, stop_gradient=True)
    program.append_op("data", {}, {"Out": [label]},
                      {"shape": list(shape) if shape is not None else None, "dtype": dtype})
    name = _unused(block, "loss")
    block.create_var(name, shape=(), dtype=pred.dtype)
    if loss == "softmax_ce":
        program.append_op("softmax_cross_entropy_loss", {"scores": [output], "labels": [label]},
                          {"output": [name]}, {"reduction": "mean", "ignore_index": None})
    else:
        op_type, slots = {"bce": ("bce_loss", ("X", "Label")),
                          "bce_with_logits": ("sigmoid_cross_entropy_with_logits", ("X", "Label")),
                          "mse": ("square_error", ("X", "Y"))}[loss]
        elem = _unused(block, f"{name}_elementwise")
        block.create_var(elem, shape=pred.shape, dtype=pred.dtype)
        program.append_op(op_type, {slots[0]: [output], slots[1]: [label]}, {"Out": [elem]})
        program.append_op("reduce_mean", {"data": [elem]}, {"reduced": [name]}, {"keepdims": 0})
    program.attrs["loss_name"] = name
    return block.var(name)


def _unused(block, base: str) -> str:
    name, k = base, 0
    while block.has_var(name):
        k += 1
        name = f"{base}_{k}"
    return name
