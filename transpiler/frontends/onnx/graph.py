"""One ONNX graph -> a hetps Program (`GraphImporter`): constants and parameters, folded Identity,
embedding tables, then vars and ops in graph order (see `onnx_import` for what the mapping does)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import defs, helper, numpy_helper

from ops_registry import by_onnx, get_op, has_op, list_ops
from transpiler.frontends.onnx.control_flow import refusal_key
from transpiler.frontends.onnx.model import (
    OnnxImportError,
    gather_nd_rows,
    lenient_types,
    np_dtype,
    tensor_type,
)
from transpiler.frontends.onnx.static import HETPS_DOMAIN, default_opset
from transpiler.ir import Program

MAX_PROGRAM_CONSTANT = 4096  # elements: a smaller non-trainable constant is a `constant` op, not a
# persistable var (which a transpiled plan would serve from a parameter server, pulled every step)

# ONNX renamed some slots between opsets; our ops use the newest names (BatchNormalization-9 -> 15).
SLOT_ALIASES = {"BatchNormalization": {"mean": "input_mean", "var": "input_var"}}
OUT_SLOT_ALIASES = {"BatchNormalization": {"mean": "running_mean", "var": "running_var"}}
# ONNX defaults of optional tensor inputs that differ from our ops' attribute defaults.
ABSENT_INPUT_DEFAULTS = {"Dropout": {"training_mode": 0}}


class UnsupportedOnnxOpsError(OnnxImportError):
    """The graph uses op types hetps does not implement; `unsupported` maps each to its nodes."""

    def __init__(self, unsupported: dict[str, list[str]]) -> None:
        self.unsupported = unsupported
        lines = [f"  {t}: {', '.join(nodes)}" for t, nodes in sorted(unsupported.items())]
        super().__init__(
            f"{len(unsupported)} unsupported ONNX op type(s) (nodes listed):\n"
            + "\n".join(lines)
            + "\nsupported: "
            + ", ".join(supported_onnx_ops())
        )


def supported_onnx_ops() -> list[str]:
    """The ONNX op types (default domain) that from_onnx maps."""
    types = {get_op(n).onnx for n in list_ops() if get_op(n).onnx}
    return sorted(types | {"Constant"})


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    a = node.attribute[0]
    if a.name == "value":
        return numpy_helper.to_array(a.t)
    plain = {
        "value_float": np.float32,
        "value_floats": np.float32,
        "value_int": np.int64,
        "value_ints": np.int64,
    }
    if a.name not in plain:
        raise OnnxImportError(
            f"Constant node {node.name!r}: {a.name} (strings / sparse tensors) is not supported"
        )
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


class GraphImporter:
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
            if (
                self.consts[name].ndim == 2
                and uses
                and name not in self.outputs
                and all(
                    k == 0
                    and (
                        node.op_type == "Gather"
                        and self._axis(node) == 0
                        or node.domain == HETPS_DOMAIN
                        and node.op_type == "embedding_bag"
                    )
                    for node, k in uses
                )
            ):
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
        pending = [
            self._convert(i, node)
            for i, node in enumerate(self.graph.node)
            if node.op_type != "Constant" and node.output[0] not in self.alias
        ]
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
            return (
                "embedding",
                {"W": [inputs[0]], "Ids": [inputs[1]]},
                {"Out": [node.output[0]]},
                {"is_sparse": 1},
            )
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
                raise OnnxImportError(
                    f"{node.op_type} node {_node_desc(node, i)}: input {formal.name!r} "
                    f"has no slot in hetps op {opdef.name!r} ({opdef.in_slots})"
                )
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
        if (
            node.op_type == "Split"
            and "split" not in ins
            and attrs.get("split") is None
            and not attrs.get("num_outputs")
        ):
            attrs["num_outputs"] = len(node.output)
        return opdef.name, ins, self._outputs(i, node, schema, opdef), attrs

    @staticmethod
    def _outputs(i: int, node: onnx.NodeProto, schema: Any, opdef: Any) -> dict[str, list[str]]:
        """The op's output slots: the node's outputs by the schema's names, plus the outputs a
        gradient rule reads that ONNX lets a node omit (mask, log_prob)."""
        outs: dict[str, list[str]] = {}
        out_aliases = OUT_SLOT_ALIASES.get(node.op_type, {})
        for k, name in enumerate(node.output):
            formal = schema.outputs[min(k, len(schema.outputs) - 1)]
            slot = out_aliases.get(formal.name, formal.name)
            if name and slot not in opdef.out_slots:
                raise OnnxImportError(
                    f"{node.op_type} node {_node_desc(node, i)}: output {formal.name!r} "
                    f"is not produced by hetps op {opdef.name!r} ({opdef.out_slots})"
                )
            if name:
                outs.setdefault(slot, []).append(name)
        if opdef.differentiable:
            base = next((n for n in node.output if n), f"{node.op_type}_{i}")  # (a GRU may omit Y)
            for slot in opdef.out_slots:
                if slot not in outs and not opdef.is_variadic(slot):
                    outs[slot] = [f"{base}.{slot}"]
        return outs

    def _convert_hetps(self, node: onnx.NodeProto) -> tuple[str, dict, dict, dict]:
        """A node of domain ai.hetps: a hetps op, its slot layout in hetps_inputs / hetps_outputs
        ("slot:count,..."), its other attributes plain."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        slots = []
        for names, layout in (
            (node.input, attrs.pop("hetps_inputs", "")),
            (node.output, attrs.pop("hetps_outputs", "")),
        ):
            out, k = {}, 0
            for part in filter(None, layout.split(",")):
                slot, count = part.split(":")
                out[slot] = [self.resolve(n) for n in names[k : k + int(count)]]
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
            dtype, shape = tensor_type(vi, "graph input")
            block.create_var(vi.name, shape=shape, dtype=dtype or "float32", stop_gradient=True)
            program.append_op(
                "data",
                {},
                {"Out": [vi.name]},
                {"shape": list(shape) if shape is not None else None, "dtype": dtype},
            )
        for name, arr in self.consts.items():
            if name not in self.used and name not in self.outputs:
                continue  # folded into attributes, or unused
            w = name in self.weights
            if not w and arr.size <= MAX_PROGRAM_CONSTANT and name not in self.outputs:
                block.create_var(
                    name, shape=arr.shape, dtype=arr.dtype.name, trainable=False, stop_gradient=True
                )
                program.append_op(
                    "constant", {}, {"output": [name]}, {"value": arr.tolist(), "dtype": arr.dtype.name}
                )
                continue
            block.create_var(
                name,
                shape=arr.shape,
                dtype=arr.dtype.name,
                persistable=True,
                is_parameter=w,
                trainable=w,
                stop_gradient=not w,
                is_sparse=name in self.tables,
            )
            program.params[name] = np.array(arr)  # owned and writable: optimizers update in place
        for _, _, outs, _ in pending:
            for names in outs.values():
                for n in names:
                    dtype, shape = self.types.get(n, (None, None))
                    block.create_var(n, shape=shape, dtype=dtype or "float32")
