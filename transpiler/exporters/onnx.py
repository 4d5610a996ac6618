"""to_onnx: any hetps Program -> an ONNX ModelProto that onnx.checker accepts (and Netron shows).

An op with an ONNX counterpart (`OpDef.onnx`, `embedding` as Gather, `constant` as Constant) becomes
a standard node at the target opset: attributes that ONNX takes as tensor inputs there become
initializers again, and hetps' own attrs (op_role, op_device, fwd_id, ...) go to the node's
`metadata_props`. Every other op
(losses without an ONNX op, gradient, optimizer, communication and parameter-server ops) becomes a
node of the custom domain `ai.hetps` carrying all its attrs and its slot layout.

ONNX wants single assignment; an op that writes a variable already defined (an optimizer's
ParamOut = Param) writes `name@v1`, `name@v2`, ... and later readers read that.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, defs, helper, numpy_helper, shape_inference

from ops_registry import get_op, has_op
from transpiler.frontends.onnx.graph import OUT_SLOT_ALIASES, SLOT_ALIASES
from transpiler.frontends.onnx.static import HETPS_DOMAIN as DOMAIN
from transpiler.ir import Op, Program, Var

DEFAULT_OPSET = 18
_ONNX_SCALAR_TYPES = {
    "float": "float32",
    "double": "float64",
    "int64": "int64",
    "int32": "int32",
    "bool": "bool",
}


def to_onnx(
    program: Program,
    outputs: list[str] | None = None,
    params: dict[str, Any] | None = None,
    opset: int | None = None,
    name: str = "hetps",
) -> onnx.ModelProto:
    """Export `program` (block 0) as an ONNX model.

    `params` gives parameter values (default `program.params`; pass an executor's scope to export
    trained values); a persistable var without a value becomes a graph input. `outputs` defaults to
    the program's fetch names (plus its loss), else to every value no op reads. `opset` defaults to
    the opset the program was imported from, else 18.
    """
    opset = opset or program.attrs.get("onnx_opset") or DEFAULT_OPSET
    ex = _Exporter(program, program.params if params is None else params, opset)
    for op in program.ops:
        ex.export_op(op)
    if outputs is None:
        outputs = list(program.attrs.get("fetch_names") or [])
        loss = program.attrs.get("loss_name")
        if loss and loss not in outputs:
            outputs.append(loss)
        outputs = outputs or ex.sinks()
    for n in outputs:
        if n not in ex.version:  # a parameter or input no op reads: declare it
            if n not in ex.params and n not in program.vars:
                raise ValueError(f"output {n!r} is not a variable of the program")
            ex.read(n)
    return ex.model(outputs, name)


def _value_info(name: str, var: Var | None, what: str) -> onnx.ValueInfoProto:
    if var is None or var.shape is None:
        raise ValueError(
            f"cannot declare {what} {name!r}: its shape is unknown (Var.shape is None); "
            "ONNX needs the rank of graph inputs and outputs"
        )
    dims = ["N" if d == -1 else d for d in var.shape]
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(var.dtype)), dims)


def _json_attr(key: str, value: Any) -> AttributeProto:
    """A custom-domain attribute: ints, floats, strings and their lists as such; anything else as
    a JSON string."""
    if isinstance(value, bool):
        value = int(value)
    plain = isinstance(value, (int, float, str)) or (
        isinstance(value, list)
        and value
        and all(type(v) is type(value[0]) for v in value)
        and isinstance(value[0], (int, float, str))
        and not isinstance(value[0], bool)
    )
    return helper.make_attribute(key, value if plain else json.dumps(value))


class _Exporter:
    def __init__(self, program: Program, params: dict[str, Any], opset: int) -> None:
        self.block = program.global_block()
        self.params = params
        self.opset = opset
        self.version: dict[str, str] = {}  # var name -> the ONNX name of its current value
        self.onnx_vars: dict[str, str] = {}  # ONNX name -> var name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.read_names: set[str] = set()
        self.custom = False

    # -- values --------------------------------------------------------------------------
    def read(self, name: str) -> str:
        """The ONNX name of `name`'s current value; a first read of an undefined var declares it
        (an initializer when a value is known, else a graph input)."""
        if not name:
            return ""
        if name not in self.version:
            if name in self.params:
                self.inits.append(numpy_helper.from_array(np.asarray(self.params[name]), name))
            else:
                self.inputs.append(_value_info(name, self.block.vars.get(name), "graph input"))
            self._define(name, name)
        self.read_names.add(self.version[name])
        return self.version[name]

    def write(self, name: str) -> str:
        if not name:
            return ""
        onnx_name, k = name, 0
        while onnx_name in self.onnx_vars:
            k += 1
            onnx_name = f"{name}@v{k}"
        self._define(name, onnx_name)
        return onnx_name

    def _define(self, name: str, onnx_name: str) -> None:
        self.version[name] = onnx_name
        self.onnx_vars[onnx_name] = name

    def const(self, op: Op, slot: str, value: Any, dtype: str) -> str:
        name = f"{op.type}_{op.id}.{slot}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def declared(self) -> set[str]:
        return {i.name for i in self.inputs} | {t.name for t in self.inits}

    def sinks(self) -> list[str]:
        """Vars whose final value no op reads and that ops computed, in definition order."""
        declared = self.declared()
        return [
            v
            for o, v in self.onnx_vars.items()
            if o not in self.read_names and o == self.version[v] and o not in declared
        ]

    # -- ops -----------------------------------------------------------------------------
    def export_op(self, op: Op) -> None:
        if op.type == "data":
            out = op.outputs["Out"][0]
            self.inputs.append(_value_info(out, self.block.vars.get(out), "graph input"))
            self._define(out, out)
            return
        if op.type == "embedding":
            node = helper.make_node(
                "Gather",
                [self.read(op.inputs["W"][0]), self.read(op.inputs["Ids"][0])],
                [],
                name=f"embedding_{op.id}",
                axis=0,
            )
            self._finish(node, op, {"Out": "output"}, set())
            return
        if op.type == "constant":
            value = np.array(op.attrs["value"], dtype=op.attrs["dtype"])
            node = helper.make_node(
                "Constant", [], [], name=f"constant_{op.id}", value=numpy_helper.from_array(value)
            )
            self._finish(node, op, {"output": "output"}, {"value", "dtype"})
            return
        onnx_type = get_op(op.type).onnx if has_op(op.type) else None
        schema = None
        if onnx_type:
            try:
                schema = defs.get_schema(onnx_type, self.opset)
            except defs.SchemaError:
                schema = None
        if schema is None or not self._standard(op, schema):
            self._custom(op)

    def _standard(self, op: Op, schema) -> bool:
        """Emit `op` as the ONNX node of `schema`; False (nothing emitted) when it does not fit."""
        opdef = get_op(op.type)
        attrs = {**opdef.attrs, **op.attrs}
        in_alias = SLOT_ALIASES.get(schema.name, {})
        out_alias = OUT_SLOT_ALIASES.get(schema.name, {})
        placed = {in_alias.get(f.name, f.name) for f in schema.inputs}
        produced = {out_alias.get(f.name, f.name) for f in schema.outputs}
        if set(op.inputs) - placed or set(op.outputs) - produced:
            return False
        first = next((names[0] for names in op.inputs.values() if names), "")
        first_dtype = self.block.vars[first].dtype if first in self.block.vars else "float32"
        ins: list[str] = []
        consumed = set()
        for f in schema.inputs:
            slot = in_alias.get(f.name, f.name)
            if slot in op.inputs:
                ins += [self.read(n) for n in op.inputs[slot]]
            elif attrs.get(slot) is not None:  # folded at import: a tensor input again
                ins.append(self.const(op, slot, attrs[slot], self._input_dtype(schema, f, first_dtype)))
                consumed.add(slot)
            else:
                ins.append("")
        while ins and not ins[-1]:
            ins.pop()
        node = helper.make_node(schema.name, ins, [], name=f"{op.type}_{op.id}")
        for aname, adef in schema.attributes.items():
            if attrs.get(aname) is not None:
                node.attribute.append(self._schema_attr(schema.name, aname, adef.type, attrs))
                consumed.add(aname)
        consumed |= {"dtype"} if schema.name == "ConstantOfShape" else set()
        self._finish(
            node,
            op,
            {out_alias.get(f.name, f.name): f.name for f in schema.outputs},
            consumed | placed,
            schema,
        )
        return True

    @staticmethod
    def _input_dtype(schema, formal, first_dtype: str) -> str:
        """dtype of a constant for a schema input: its fixed type, the first input's type when it
        shares its type variable, else int64 / float32 / bool as the constraint allows."""
        ts = formal.type_str
        if ts.startswith("tensor("):
            return _ONNX_SCALAR_TYPES[ts[7:-1]]
        if ts == schema.inputs[0].type_str:
            return first_dtype
        allowed = next(c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == ts)
        return next(
            _ONNX_SCALAR_TYPES[t[7:-1]]
            for t in ("tensor(int64)", "tensor(float)", "tensor(bool)")
            if t in allowed
        )

    @staticmethod
    def _schema_attr(onnx_type: str, name: str, atype: int, attrs: dict) -> AttributeProto:
        v = attrs[name]
        if onnx_type == "Cast" and name == "to":
            v = helper.np_dtype_to_tensor_dtype(np.dtype(v))
        elif atype == AttributeProto.TENSOR:  # ConstantOfShape's value: scalar + dtype
            v = numpy_helper.from_array(np.array([v], dtype=attrs.get("dtype", "float32")))
        elif atype == AttributeProto.FLOAT:
            v = float(v)
        elif atype == AttributeProto.INT:
            v = int(v)
        elif atype == AttributeProto.INTS:
            v = [int(x) for x in v]
        elif atype == AttributeProto.FLOATS:
            v = [float(x) for x in v]
        return helper.make_attribute(name, v, attr_type=atype)

    def _custom(self, op: Op) -> None:
        """A node of domain ai.hetps: inputs / outputs in slot order, layout in hetps_inputs /
        hetps_outputs ("slot:count,..."), every attr kept."""
        self.custom = True
        ins = [self.read(n) for names in op.inputs.values() for n in names]
        node = helper.make_node(op.type, ins, [], name=f"{op.type}_{op.id}", domain=DOMAIN)
        node.attribute.append(
            helper.make_attribute("hetps_inputs", ",".join(f"{s}:{len(v)}" for s, v in op.inputs.items()))
        )
        node.attribute.append(
            helper.make_attribute("hetps_outputs", ",".join(f"{s}:{len(v)}" for s, v in op.outputs.items()))
        )
        node.attribute.extend(
            _json_attr(k, v) for k, v in sorted({"op_role": op.role, **op.attrs}.items()) if v is not None
        )
        node.output.extend(self.write(n) for names in op.outputs.values() for n in names)
        self.nodes.append(node)

    def _finish(
        self, node: onnx.NodeProto, op: Op, out_slots: dict[str, str], consumed: set[str], schema=None
    ) -> None:
        """Outputs in the schema's order; hetps-only attrs as metadata_props."""
        order = [f.name for f in schema.outputs] if schema is not None else list(out_slots.values())
        outs = {onnx_name: op.outputs.get(slot, []) for slot, onnx_name in out_slots.items()}
        if op.type == "batch_norm" and not op.attrs.get("training_mode"):  # ONNX: Y only; the
            for slot in ("running_mean", "running_var"):  # running stats are the inputs then
                for name in op.outputs.get(slot, []):
                    self.version[name] = self.read(op.inputs[slot.replace("running", "input")][0])
                outs.pop(out_slots[slot], None)
        names: list[str] = []
        for onnx_name in order:
            names += [self.write(n) for n in outs.get(onnx_name, [])] or [""]
        while names and not names[-1]:
            names.pop()
        node.output.extend(names)
        for k, v in sorted({"op_role": op.role, **op.attrs}.items()):  # op_device, fwd_id, ...
            if k not in consumed:
                node.metadata_props.add(key=k, value=json.dumps(v))
        node.metadata_props.add(key="hetps_op", value=op.type)
        self.nodes.append(node)

    # -- model ---------------------------------------------------------------------------
    def model(self, outputs: list[str], name: str) -> onnx.ModelProto:
        outs = [_value_info(self.version[n], self.block.vars.get(n), "graph output") for n in outputs]
        graph = helper.make_graph(self.nodes, name, self.inputs, outs, self.inits)
        opsets = [helper.make_opsetid("", self.opset)]
        if self.custom:
            opsets.append(helper.make_opsetid(DOMAIN, 1))
        model = helper.make_model(
            graph,
            opset_imports=opsets,
            producer_name="hetps",
            ir_version=helper.find_min_ir_version_for(opsets[:1]),
        )
        known = {vi.name for vi in shape_inference.infer_shapes(model).graph.value_info}
        known |= self.declared() | {o.name for o in outs}
        for onnx_name, var_name in self.onnx_vars.items():  # shapes ONNX cannot infer (custom ops)
            var = self.block.vars.get(var_name)
            if onnx_name not in known and var is not None and var.shape is not None:
                model.graph.value_info.append(_value_info(onnx_name, var, "value"))
        onnx.checker.check_model(model)
        return model
