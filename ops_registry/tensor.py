"""Shape and layout ops, reductions, data feeding and constants."""

from __future__ import annotations

from .base import OpDef, register
from .shapes import reduce, same_as


def _concat(xp, ins, attrs):
    """concat_result = the inputs joined along `axis`."""
    return {"concat_result": xp.concatenate(ins["inputs"], axis=attrs["axis"])}


def _concat_vjp(xp, ins, outs, douts, attrs):
    xs, g = ins["inputs"], douts["concat_result"]
    axis = attrs["axis"] % g.ndim
    bounds, acc = [], 0
    for x in xs[:-1]:
        acc += x.shape[axis]
        bounds.append(acc)
    return {"inputs": xp.split(g, bounds, axis=axis)}


def _concat_shape(s, attrs):
    xs = s["inputs"]
    axis = attrs["axis"] % len(xs[0])
    for i, x in enumerate(xs[1:], 1):
        if len(x) != len(xs[0]) or any(a != b and -1 not in (a, b)
                                       for j, (a, b) in enumerate(zip(x, xs[0], strict=True)) if j != axis):
            raise ValueError(f"input {i} has shape {list(x)}, expected {list(xs[0])} except on axis {axis}")
    sizes = [x[axis] for x in xs]
    total = -1 if -1 in sizes else sum(sizes)
    return {"concat_result": tuple(total if i == axis else d for i, d in enumerate(xs[0]))}


register(OpDef("concat", "elementwise", ("inputs*",), ("concat_result",), _concat, _concat_vjp,
               infer_shape=_concat_shape, onnx="Concat", attrs={"axis": 0}))


def _target_shape(in_shape, shape, allowzero=0):
    """ONNX Reshape's target: 0 copies the input dim (unless allowzero), -1 is inferred."""
    return tuple(in_shape[i] if (d == 0 and not allowzero) else d for i, d in enumerate(shape))


def _reshape(xp, ins, attrs):
    """reshaped = data with `shape` (ONNX Reshape: 0 copies a dim, -1 is inferred)."""
    x = ins["data"]
    return {"reshaped": x.reshape(_target_shape(x.shape, attrs["shape"], attrs["allowzero"]))}


def _reshape_shape(s, attrs):
    t = _target_shape(s["data"], attrs["shape"], attrs.get("allowzero", 0))
    known = [d for d in s["data"]]
    if -1 in known or t.count(-1) != 1:
        return {"reshaped": t}
    total = 1
    for d in known:
        total *= d
    rest = 1
    for d in t:
        rest *= d if d != -1 else 1
    return {"reshaped": tuple(total // rest if d == -1 else d for d in t)}


register(OpDef("reshape", "elementwise", ("data",), ("reshaped",), _reshape,
               lambda xp, i, o, d, a: {"data": d["reshaped"].reshape(i["data"].shape)},
               infer_shape=_reshape_shape, onnx="Reshape", attrs={"allowzero": 0}))


def _axes(attrs):
    axes = attrs.get("axes")
    return None if axes is None or len(axes) == 0 else tuple(axes)


def _reduce_sum(xp, ins, attrs):
    """reduced = sum of data over `axes` (all when absent), keeping them when keepdims."""
    x = ins["data"]
    return {"reduced": x.sum(axis=_axes(attrs), keepdims=bool(attrs["keepdims"])).astype(x.dtype)}


def _reduce_mean(xp, ins, attrs):
    """reduced = mean of data over `axes` (all when absent), keeping them when keepdims."""
    x = ins["data"]
    return {"reduced": x.mean(axis=_axes(attrs), keepdims=bool(attrs["keepdims"])).astype(x.dtype)}


def _expand_back(xp, g, x, attrs):
    axes = _axes(attrs)
    if not attrs["keepdims"]:
        ax = range(x.ndim) if axes is None else [a % x.ndim for a in axes]
        g = g.reshape([1 if i in ax else d for i, d in enumerate(x.shape)])
    return xp.broadcast_to(g, x.shape)


def _reduce_count(x, attrs):
    axes = _axes(attrs)
    ax = range(x.ndim) if axes is None else [a % x.ndim for a in axes]
    n = 1
    for a in ax:
        n *= x.shape[a]
    return n


for _name, _onnx, _k, _scale in (
    ("reduce_sum", "ReduceSum", _reduce_sum, False),
    ("reduce_mean", "ReduceMean", _reduce_mean, True),
):
    def _vjp(xp, ins, outs, douts, attrs, _scale=_scale):
        x = ins["data"]
        g = _expand_back(xp, douts["reduced"], x, attrs)
        return {"data": (g / _reduce_count(x, attrs) if _scale else g).astype(x.dtype)}

    register(OpDef(_name, "elementwise", ("data",), ("reduced",), _k, _vjp, onnx=_onnx,
                   infer_shape=lambda s, a: {"reduced": reduce(s["data"], _axes(a), a.get("keepdims", 1))},
                   attrs={"axes": None, "keepdims": 1}))


def _cast(xp, ins, attrs):
    """output = input converted to dtype `to`, a numpy dtype name such as "float32" (ONNX Cast;
    an importer maps ONNX's TensorProto enum to the name)."""
    return {"output": ins["input"].astype(attrs["to"], copy=False)}


register(OpDef("cast", "elementwise", ("input",), ("output",), _cast,
               lambda xp, i, o, d, a: {"input": d["output"].astype(i["input"].dtype, copy=False)},
               infer_shape=same_as("input", "output"), onnx="Cast", attrs={"to": "float32"}))


def _data(xp, ins, attrs):
    """Out = the fed value (the executor places feeds; this op marks where data enters)."""
    raise RuntimeError("data ops are executed by the executor's feed handling")


register(OpDef("data", "io", (), ("Out",), _data,
               infer_shape=lambda s, a: {"Out": tuple(a["shape"])}))


def _fill_constant(xp, ins, attrs):
    """Out = a tensor of `shape` filled with `value` (shape of input `Like` when given)."""
    import numpy as np

    shape = ins["Like"].shape if "Like" in ins else tuple(attrs["shape"])
    dtype = ins["Like"].dtype if "Like" in ins else np.dtype(attrs["dtype"])
    return {"Out": xp.full(shape, attrs["value"], dtype=dtype)}


register(OpDef("fill_constant", "elementwise", ("Like?",), ("Out",), _fill_constant,
               attrs={"value": 0.0, "shape": (), "dtype": "float32"}))


def _init(xp, ins, attrs):
    """Out = a parameter initialised from `initializer` (deterministic per row; see initializers)."""
    from .initializers import init_rows

    return {"Out": xp.asarray(init_rows(attrs["initializer"], attrs["shape"], attrs["dtype"]))}


register(OpDef("init", "init", (), ("Out",), _init,
               infer_shape=lambda s, a: {"Out": tuple(a["shape"])}))
