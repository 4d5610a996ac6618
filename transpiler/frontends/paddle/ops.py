"""Paddle forward ops -> hetps ops: one small converter per Paddle op type.

Converters see a `PaddleOp` in the legacy ProgramDesc vocabulary (`mul`, `elementwise_add`, slots
`X`/`Y`/`Out`, attrs `dim`/`keep_dim`); the PIR reader renames `pd_op.*` ops to it and folds their
constant operands (a reshape's shape, a concat's axis) into attrs, so one table serves both IRs.
A converter emits hetps ops through an importer (`ctx`), reusing a registry op whenever the
semantics match (`mul` -> `matmul`, `square` -> `mul(X, X)`) rather than adding Paddle twins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ops_registry import get_op
from transpiler.errors import ModelImportError


class PaddleImportError(ModelImportError):
    """A Paddle program that hetps cannot import; the message names the Paddle op and its call site."""


@dataclass
class PaddleOp:
    """One Paddle op: type, {slot: [var names]}, attrs, index in its block and the user's call site."""

    type: str
    inputs: dict[str, list[str]] = field(default_factory=dict)
    outputs: dict[str, list[str]] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    index: int = -1
    site: str = ""
    device: str = ""

    def where(self) -> str:
        at = f", called at {self.site}" if self.site else ""
        return f"Paddle op #{self.index} {self.type!r}{at}"

    def one(self, slot: str) -> str:
        names = self.inputs.get(slot) or self.outputs.get(slot)
        if not names or len(names) != 1:
            raise PaddleImportError(f"{self.where()}: expected one variable in slot {slot!r}, got {names}")
        return names[0]

    def fail(self, msg: str) -> PaddleImportError:
        return PaddleImportError(f"{self.where()}: {msg}")


class Ctx(Protocol):
    """What a converter may call; implemented by `paddle_import._Importer`."""

    def emit(
        self, op: PaddleOp, type: str, inputs: dict, outputs: dict, attrs: dict | None = None
    ) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def mark_sparse(self, name: str, sparse: bool) -> None: ...


Converter = Callable[[Ctx, PaddleOp], None]
CONVERTERS: dict[str, Converter] = {}


def converts(*types: str) -> Callable[[Converter], Converter]:
    def deco(fn: Converter) -> Converter:
        for t in types:
            CONVERTERS[t] = fn
        return fn

    return deco


def _no_tensor_inputs(op: PaddleOp, *slots: str) -> None:
    """Paddle lets some attributes arrive as tensors computed at run time; hetps needs them static."""
    for s in slots:
        if op.inputs.get(s):
            raise op.fail(
                f"input {s!r} (an attribute computed at run time) is not supported; "
                "pass it as a Python constant"
            )


def _reshape(ctx: Ctx, op: PaddleOp, name: str, shape: list[int]) -> str:
    return ctx.emit(op, "reshape", {"data": [name]}, {"reshaped": None}, {"shape": shape})[0]


@converts("lookup_table_v2", "lookup_table")
def _lookup(ctx: Ctx, op: PaddleOp) -> None:
    """A lookup; with `padding_idx` p the rows of ids == p are zeros and get a zero gradient (Paddle's
    semantics), as the lookup times a mask (ids != p) made from the ids: the mask rides along the
    ids, so it holds on parameter-server tables too, where the lookup gathers local rows."""
    w, ids = op.one("W"), op.one("Ids")
    sparse = bool(op.attrs.get("is_sparse", False))
    ctx.mark_sparse(w, sparse)
    if op.type == "lookup_table":  # v1: ids end in a [.., 1] dim that the output drops
        ids = _reshape(ctx, op, ids, [0] * (len(ctx.shape(ids)) - 1))
    pad = op.attrs.get("padding_idx", -1)
    pad = -1 if pad is None else int(pad)
    if pad < 0:  # Paddle stores padding_idx as a non-negative index, or -1 for none
        ctx.emit(
            op, "embedding", {"W": [w], "Ids": [ids]}, {"Out": op.outputs["Out"]}, {"is_sparse": int(sparse)}
        )
        return
    rows = ctx.emit(op, "embedding", {"W": [w], "Ids": [ids]}, {"Out": None}, {"is_sparse": int(sparse)})[0]
    value = ctx.emit(
        op, "fill_constant", {"Like": [ids]}, {"Out": None}, {"value": float(pad), "dtype": "int64"}
    )
    hit = ctx.emit(op, "equal", {"A": [ids], "B": value}, {"C": None})
    keep = ctx.emit(op, "cast", {"input": hit}, {"output": None}, {"to": "float32"})
    keep = ctx.emit(op, "scale", {"X": keep}, {"Out": None}, {"scale": -1.0, "bias": 1.0})
    keep = _reshape(ctx, op, keep[0], [0] * len(ctx.shape(ids)) + [1])
    ctx.emit(op, "mul", {"A": [rows], "B": [keep]}, {"C": op.outputs["Out"]})


@converts("reshape2")
def _reshape2(ctx: Ctx, op: PaddleOp) -> None:
    _no_tensor_inputs(op, "Shape", "ShapeTensor")
    ctx.emit(
        op,
        "reshape",
        {"data": op.inputs["X"]},
        {"reshaped": op.outputs["Out"]},
        {"shape": list(op.attrs["shape"])},
    )


@converts("concat")
def _concat(ctx: Ctx, op: PaddleOp) -> None:
    _no_tensor_inputs(op, "AxisTensor")
    ctx.emit(
        op,
        "concat",
        {"inputs": op.inputs["X"]},
        {"concat_result": op.outputs["Out"]},
        {"axis": int(op.attrs["axis"])},
    )


@converts("sum")
def _sum(ctx: Ctx, op: PaddleOp) -> None:
    ctx.emit(op, "sum", {"data_0": op.inputs["X"]}, {"sum": op.outputs["Out"]})


_BINARY = {
    "elementwise_add": "add",
    "elementwise_sub": "sub",
    "elementwise_mul": "mul",
    "elementwise_div": "div",
}


@converts(*_BINARY)
def _elementwise(ctx: Ctx, op: PaddleOp) -> None:
    """Paddle aligns the lower-rank operand at `axis`; numpy aligns trailing dims. Appending ones to
    the lower-rank operand (a reshape) turns the first into the second."""
    x, y = op.one("X"), op.one("Y")
    axis = int(op.attrs.get("axis", -1))
    if axis != -1:
        rx, ry = len(ctx.shape(x)), len(ctx.shape(y))
        if ry < rx:
            y = _align(ctx, op, y, ry, rx - axis - ry)
        elif rx < ry:
            x = _align(ctx, op, x, rx, ry - axis - rx)
    ctx.emit(op, _BINARY[op.type], {"A": [x], "B": [y]}, {"C": op.outputs["Out"]})


def _align(ctx: Ctx, op: PaddleOp, name: str, rank: int, ones: int) -> str:
    if ones < 0:
        raise op.fail(
            f"axis {op.attrs['axis']} does not align {name!r} {ctx.shape(name)} inside the other operand"
        )
    return _reshape(ctx, op, name, [0] * rank + [1] * ones) if ones else name


@converts("mul")
def _mul(ctx: Ctx, op: PaddleOp) -> None:
    """Paddle's fc matmul: X flattened to 2-D after `x_num_col_dims` dims (when that is not simply
    a batched matmul over X's leading dims)."""
    x, y = op.one("X"), op.one("Y")
    k, rank = int(op.attrs.get("x_num_col_dims", 1)), len(ctx.shape(x))
    if int(op.attrs.get("y_num_col_dims", 1)) != 1 or len(ctx.shape(y)) != 2:
        raise op.fail("only a 2-D Y with y_num_col_dims=1 is supported")
    if k != rank - 1:
        if k != 1:
            raise op.fail(f"x_num_col_dims={k} on a rank-{rank} X is not supported (1 or rank-1)")
        x = _reshape(ctx, op, x, [0, -1])
    ctx.emit(op, "matmul", {"A": [x], "B": [y]}, {"Y": op.outputs["Out"]})


@converts("matmul_v2")
def _matmul_v2(ctx: Ctx, op: PaddleOp) -> None:
    x, y = op.one("X"), op.one("Y")
    tx, ty = int(bool(op.attrs.get("trans_x"))), int(bool(op.attrs.get("trans_y")))
    if not (tx or ty):
        ctx.emit(op, "matmul", {"A": [x], "B": [y]}, {"Y": op.outputs["Out"]})
    elif len(ctx.shape(x)) == 2 and len(ctx.shape(y)) == 2:
        ctx.emit(op, "gemm", {"A": [x], "B": [y]}, {"Y": op.outputs["Out"]}, {"transA": tx, "transB": ty})
    else:
        raise op.fail("transposed operands are supported for 2-D inputs only")


@converts("relu", "sigmoid", "tanh")
def _unary(ctx: Ctx, op: PaddleOp) -> None:
    opdef = get_op(op.type)  # ONNX's slot names: X -> Y for Relu, input -> output for Tanh
    ctx.emit(op, op.type, {opdef.in_slots[0]: op.inputs["X"]}, {opdef.out_slots[0]: op.outputs["Out"]})


@converts("square")
def _square(ctx: Ctx, op: PaddleOp) -> None:
    x = op.one("X")
    ctx.emit(op, "mul", {"A": [x], "B": [x]}, {"C": op.outputs["Out"]})


@converts("scale")
def _scale(ctx: Ctx, op: PaddleOp) -> None:
    _no_tensor_inputs(op, "ScaleTensor")
    scale, bias = float(op.attrs.get("scale", 1.0)), float(op.attrs.get("bias", 0.0))
    if not op.attrs.get("bias_after_scale", True):  # scale * (x + bias)
        bias *= scale
    ctx.emit(op, "scale", {"X": op.inputs["X"]}, {"Out": op.outputs["Out"]}, {"scale": scale, "bias": bias})


@converts("fill_constant")
def _fill_constant(ctx: Ctx, op: PaddleOp) -> None:
    _no_tensor_inputs(op, "ShapeTensor", "ShapeTensorList", "ValueTensor")
    text = op.attrs.get("str_value") or ""
    value = float(text) if text else float(op.attrs.get("value", 0.0))
    ctx.emit(
        op,
        "fill_constant",
        {},
        {"Out": op.outputs["Out"]},
        {
            "value": value,
            "shape": list(op.attrs.get("shape", [])),
            "dtype": op.attrs.get("dtype") or "float32",
        },
    )


@converts("cast")
def _cast(ctx: Ctx, op: PaddleOp) -> None:
    ctx.emit(
        op, "cast", {"input": op.inputs["X"]}, {"output": op.outputs["Out"]}, {"to": op.attrs["out_dtype"]}
    )


def _default_ignore_index(op: PaddleOp) -> None:
    """hetps does not mask ignored labels; Paddle's default (-100) is never a valid label."""
    if int(op.attrs.get("ignore_index", -100)) != -100:
        raise op.fail(f"ignore_index={op.attrs['ignore_index']} is not supported (only -100)")


@converts("sigmoid_cross_entropy_with_logits")
def _sce(ctx: Ctx, op: PaddleOp) -> None:
    _no_tensor_inputs(op, "pos_weight")
    _default_ignore_index(op)
    if op.attrs.get("normalize"):
        raise op.fail("normalize=True is not supported")
    ctx.emit(
        op,
        "sigmoid_cross_entropy_with_logits",
        {"X": op.inputs["X"], "Label": op.inputs["Label"]},
        {"Out": op.outputs["Out"]},
    )


@converts("softmax_with_cross_entropy")
def _softmax_ce(ctx: Ctx, op: PaddleOp) -> None:
    _default_ignore_index(op)
    if not op.attrs.get("use_softmax", True):
        raise op.fail("use_softmax=False is not supported")
    outs = {"Loss": op.outputs["Loss"]}
    if op.outputs.get("Softmax"):
        outs["Softmax"] = op.outputs["Softmax"]
    ctx.emit(
        op,
        "softmax_cross_entropy",
        {"Logits": op.inputs["Logits"], "Label": op.inputs["Label"]},
        outs,
        {"soft_label": int(bool(op.attrs.get("soft_label"))), "axis": int(op.attrs.get("axis", -1))},
    )


@converts("log_loss")
def _log_loss(ctx: Ctx, op: PaddleOp) -> None:
    ctx.emit(
        op,
        "log_loss",
        {"Predicted": op.inputs["Predicted"], "Labels": op.inputs["Labels"]},
        {"Loss": op.outputs["Loss"]},
        {"epsilon": float(op.attrs.get("epsilon", 1e-4))},
    )


@converts("reduce_sum", "reduce_mean", "mean")
def _reduce(ctx: Ctx, op: PaddleOp) -> None:
    if op.attrs.get("out_dtype"):
        raise op.fail(f"a reduction with out_dtype={op.attrs['out_dtype']} is not supported")
    dims = op.attrs.get("dim")
    whole = op.type == "mean" or op.attrs.get("reduce_all") or not dims
    ctx.emit(
        op,
        "reduce_sum" if op.type == "reduce_sum" else "reduce_mean",
        {"data": op.inputs["X"]},
        {"reduced": op.outputs["Out"]},
        {
            "axes": None if whole else [int(d) for d in dims],
            "keepdims": int(bool(op.attrs.get("keep_dim", False))),
        },
    )


@converts("unsqueeze2")
def _unsqueeze2(ctx: Ctx, op: PaddleOp) -> None:
    _no_tensor_inputs(op, "AxesTensor", "AxesTensorList")
    axes = op.attrs["axes"]
    axes = [int(a) for a in (axes if isinstance(axes, (list, tuple)) else [axes])]
    ctx.emit(op, "unsqueeze", {"data": op.inputs["X"]}, {"expanded": op.outputs["Out"]}, {"axes": axes})


@converts("transpose2")
def _transpose2(ctx: Ctx, op: PaddleOp) -> None:
    ctx.emit(
        op,
        "transpose",
        {"data": op.inputs["X"]},
        {"transposed": op.outputs["Out"]},
        {"perm": [int(a) for a in op.attrs["axis"]]},
    )


@converts("slice")
def _slice(ctx: Ctx, op: PaddleOp) -> None:
    """Paddle's slice (PaddleRec takes a softmax's positive column with it); `decrease_axis`
    drops the sliced axes afterwards, as Paddle does."""
    _no_tensor_inputs(op, "StartsTensor", "EndsTensor", "StartsTensorList", "EndsTensorList")
    attrs = {k: [int(v) for v in op.attrs[k]] for k in ("starts", "ends", "axes")}
    drop = [int(a) for a in op.attrs.get("decrease_axis") or []]
    out = op.outputs["Out"]
    if not drop:
        ctx.emit(op, "slice", {"data": op.inputs["Input"]}, {"output": out}, attrs)
        return
    part = ctx.emit(op, "slice", {"data": op.inputs["Input"]}, {"output": None}, attrs)[0]
    ctx.emit(op, "squeeze", {"data": [part]}, {"squeezed": out}, {"axes": drop})


@converts("softmax")
def _softmax(ctx: Ctx, op: PaddleOp) -> None:
    ctx.emit(
        op,
        "softmax",
        {"input": op.inputs["X"]},
        {"output": op.outputs["Out"]},
        {"axis": int(op.attrs.get("axis", -1))},
    )


@converts("conv2d")
def _conv2d(ctx: Ctx, op: PaddleOp) -> None:
    """A 1x1 NCHW convolution (stride 1, no padding, one group), as in xDeepFM's CIN: the filter
    reshaped to [O, C] times the input as [N, C, H*W] (a batched matmul) -> [N, O, H, W]. Other
    convolutions are refused."""
    x, f = op.one("Input"), op.one("Filter")
    out = op.outputs.get("Output") or op.outputs["Out"]
    (o, c, kh, kw), (_, c_in, h, w) = ctx.shape(f), ctx.shape(x)
    a = op.attrs
    plain = (
        (kh, kw) == (1, 1)
        and c == c_in
        and int(a.get("groups", 1)) == 1
        and a.get("data_format", "NCHW") in ("NCHW", "AnyLayout")
        and all(int(v) == 1 for v in a.get("strides", [1, 1]))
        and all(int(v) == 0 for v in a.get("paddings", [0, 0]))
        and all(int(v) == 1 for v in a.get("dilations", [1, 1]))
        and a.get("padding_algorithm", "EXPLICIT") in ("EXPLICIT", "VALID")
    )
    if not plain or h < 1 or w < 1:
        raise op.fail(
            f"only 1x1 NCHW convolutions with stride 1, no padding and one group are "
            f"supported (filter {[o, c, kh, kw]}, input {[c_in, h, w]}, attrs {a})"
        )
    f2 = _reshape(ctx, op, f, [o, c])
    x3 = _reshape(ctx, op, x, [-1, c, h * w])
    y = ctx.emit(op, "matmul", {"A": [f2], "B": [x3]}, {"Y": None})[0]
    ctx.emit(op, "reshape", {"data": [y]}, {"reshaped": out}, {"shape": [-1, o, h, w]})
