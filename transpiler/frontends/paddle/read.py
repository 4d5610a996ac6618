"""A Paddle static program reduced to what `from_paddle` needs (`PaddleRead`, the same shape for both
IRs), and the reader of a legacy ProgramDesc (`read_legacy`); PIR programs: `paddle_pir`."""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transpiler.frontends.builder import OPTIMIZERS
from transpiler.frontends.paddle.ops import PaddleOp
from transpiler.ir import Var

_ROLE_BACKWARD, _ROLE_OPTIMIZE, _ROLE_LRSCHED, _ROLE_LOSS = 0x1, 0x2, 0x10, 0x100

SKIP_ATTRS = {
    "op_callstack",
    "op_role",
    "op_role_var",
    "op_namescope",
    "op_device",
    "with_quant_attr",
    "stop_gradient",
    "struct_name",
    "place",
    "use_mkldnn",
    "use_onednn",
    "mkldnn_data_type",
    "use_quantizer",
}

_DTYPE_ATTRS = {"dtype", "out_dtype", "in_dtype"}

_EXTRA_ATTRS = ("is_sparse",)  # "extra" attrs that op.attr_names does not list


@dataclass
class PaddleRead:
    """A Paddle program reduced to what the import needs, the same shape for both IRs."""

    ir: str
    ops: list[PaddleOp] = field(default_factory=list)  # forward ops, in Paddle's order
    vars: dict[str, Var] = field(default_factory=dict)  # facts about every named value
    feeds: list[str] = field(default_factory=list)  # data vars, declaration order
    lazy: dict[str, PaddleOp] = field(default_factory=dict)  # PIR constants, emitted when read
    optimize: list[PaddleOp] = field(default_factory=list)  # optimizer update ops
    selected_rows: set[str] = field(default_factory=set)  # legacy SelectedRows vars (sparse grads)
    l2: dict[str, float] = field(default_factory=dict)  # param -> its L2Decay coefficient
    clip: dict[str, float] = field(default_factory=dict)  # param -> ClipGradByGlobalNorm's clip_norm
    loss: str | None = None
    name_of: Callable[[Any], str] = str  # Variable / Value / str -> name


def read_legacy(main: Any, paddle_dir: str) -> PaddleRead:
    from paddle.base import core
    from paddle.base.data_feeder import convert_dtype
    from paddle.base.framework import Parameter

    block = main.global_block()
    read = PaddleRead("legacy", name_of=lambda v: v if isinstance(v, str) else v.name)
    for name, v in block.vars.items():
        if v.type == core.VarDesc.VarType.SELECTED_ROWS:
            read.selected_rows.add(name)
        if v.type != core.VarDesc.VarType.DENSE_TENSOR:
            continue
        read.vars[name] = Var(
            name,
            shape=tuple(v.shape),
            dtype=convert_dtype(v.dtype),
            persistable=bool(v.persistable),
            is_parameter=isinstance(v, Parameter),
            trainable=bool(getattr(v, "trainable", True)),
            stop_gradient=bool(v.stop_gradient),
        )
        if getattr(v, "is_data", False):
            read.feeds.append(name)

    def dtype(v: Any) -> str | None:
        return None if v is None or int(v) < 0 else convert_dtype(core.VarDesc.VarType(int(v)))

    for i, op in enumerate(block.ops):
        role = int(op.attr("op_role")) if op.has_attr("op_role") else 0
        if op.type in ("feed", "fetch"):
            continue
        if role == _ROLE_BACKWARD | _ROLE_LOSS:  # fill_constant(1) into loss@GRAD
            read.loss = op.output("Out")[0].removesuffix("@GRAD")
        if role & _ROLE_BACKWARD:
            continue
        attrs = {
            k: (dtype(op.attr(k)) if k in _DTYPE_ATTRS else op.attr(k))
            for k in op.attr_names
            if k not in SKIP_ATTRS
        }
        attrs.update({k: op.attr(k) for k in _EXTRA_ATTRS if k not in attrs and op.has_attr(k)})
        device = op.attr("op_device") if op.has_attr("op_device") else ""
        node = PaddleOp(
            op.type,
            {s: list(op.input(s)) for s in op.input_names if op.input(s)},
            {s: list(op.output(s)) for s in op.output_names if op.output(s)},
            attrs,
            i,
            call_site(op.attr("op_callstack") if op.has_attr("op_callstack") else [], paddle_dir),
            device.split(":")[0],
        )
        (read.optimize if role & (_ROLE_OPTIMIZE | _ROLE_LRSCHED) else read.ops).append(node)
    _strip_legacy_l2(read)
    return read


def _strip_legacy_l2(read: PaddleRead) -> None:
    """Paddle's legacy L2Decay is `scale(X=param, scale=c, bias=0) -> d` and `sum(X=[g, d]) -> g'`
    (optimize role) feeding the update op's Grad: record c for the parameter, point the update at
    g and drop the two ops."""
    scaled = {
        op.outputs["Out"][0]: op
        for op in read.optimize
        if op.type == "scale"
        and not op.inputs.get("ScaleTensor")
        and not op.attrs.get("bias")
        and read.vars.get(op.inputs["X"][0], Var("")).is_parameter
    }
    sums = {
        op.outputs["Out"][0]: op
        for op in read.optimize
        if op.type == "sum" and len(op.inputs["X"]) == 2 and op.inputs["X"][1] in scaled
    }
    drop = set()
    for op in read.optimize:
        s = sums.get(op.inputs.get("Grad", [""])[0])
        if op.type not in OPTIMIZERS or s is None:
            continue
        sc = scaled[s.inputs["X"][1]]
        if sc.inputs["X"] != op.inputs["Param"]:
            continue
        read.l2[op.one("Param")] = float(sc.attrs["scale"])
        op.inputs = {**op.inputs, "Grad": [s.inputs["X"][0]]}
        drop |= {id(s), id(sc)}
    read.optimize = [op for op in read.optimize if id(op) not in drop]


def call_site(callstack: list[str], paddle_dir: str) -> str:
    """The innermost frame of the user's code ("file:line: code") in a Paddle op's callstack."""
    stdlib = sysconfig.get_paths()["stdlib"]
    site = ""
    for k, line in enumerate(callstack):
        m = re.match(r'\s*File "(.+)", line (\d+), in ', line)
        if m and not m.group(1).startswith((paddle_dir, stdlib)):
            code = callstack[k + 1].strip() if k + 1 < len(callstack) else ""
            site = f"{m.group(1)}:{m.group(2)}" + (f": {code}" if code else "")
    return site
