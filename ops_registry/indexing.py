"""Index, scatter, sort and sequence ops with ONNX semantics (what exporters emit for recommendation
models: GatherND for index ops, ScatterND / ScatterElements, TopK, ArgMax, OneHot, Range, CumSum, ...).
"""

from __future__ import annotations

from ops_registry.base import OpDef, register, scatter_add, static_arg
from ops_registry.tensor import element_index


def _scalar(v) -> int:
    """An int from a static argument given as a scalar or a one-element list (K, k, depth)."""
    return int(v[0] if isinstance(v, list) else v)


def _wrap(xp, idx, size):
    """Negative indices count from the end (ONNX index semantics)."""
    return xp.where(idx < 0, idx + size, idx)


# -- GatherND / ScatterND ----------------------------------------------------------------------
def _nd_index(xp, data_shape, indices, batch_dims: int):
    """The advanced-index tuple that ONNX GatherND / ScatterND's `indices` (last dim k: a k-tuple into
    data's dims after `batch_dims`) selects; its result has shape indices.shape[:-1] + the rest."""
    b, k = batch_dims, indices.shape[-1]
    lead = indices.shape[:-1]
    grid = xp.indices(lead, sparse=True)[:b] if b else []  # batch positions, broadcast over lead
    cols = tuple(_wrap(xp, indices[..., j], data_shape[b + j]) for j in range(k))
    return tuple(grid) + cols


def _gather_nd(xp, ins, attrs):
    """output = the slices of data that the last dim of `indices` addresses (ONNX GatherND: the
    first `batch_dims` dims of data and indices are batch dims, walked together)."""
    x, idx = ins["data"], ins["indices"]
    return {"output": x[_nd_index(xp, x.shape, idx, attrs["batch_dims"])]}


def _gather_nd_vjp(xp, ins, outs, douts, attrs):
    x, g = ins["data"], douts["output"]
    out = xp.zeros(x.shape, dtype=g.dtype)
    scatter_add(xp, out, _nd_index(xp, x.shape, ins["indices"], attrs["batch_dims"]), g)
    return {"data": out}


def _gather_nd_shape(s, attrs):
    data, idx, b = s["data"], s["indices"], attrs.get("batch_dims", 0)
    if idx[-1] == -1:
        return {}
    return {"output": tuple(idx[:-1]) + tuple(data[b + idx[-1] :])}


register(
    OpDef(
        "gather_nd",
        "light",
        ("data", "indices"),
        ("output",),
        _gather_nd,
        _gather_nd_vjp,
        no_grad=("indices",),
        onnx="GatherND",
        attrs={"batch_dims": 0},
        infer_shape=_gather_nd_shape,
    )
)


def _scatter(xp, out, index, updates, reduction: str) -> None:
    """out[index] (op)= updates in place; repeated indices apply one after another, as ONNX's
    reference does (for "none" the last write wins)."""
    if reduction == "none":
        out[index] = updates
    elif reduction == "add":
        scatter_add(xp, out, index, updates)
    else:
        ufunc = {"mul": xp.multiply, "max": xp.maximum, "min": xp.minimum}.get(reduction)
        if ufunc is None:
            raise ValueError(f"reduction {reduction!r} is not one of none, add, mul, max, min")
        ufunc.at(out, index, updates)


def _scatter_vjp(xp, ins, douts, index, reduction: str, op: str) -> dict:
    """For none: data's gradient is the output's with the overwritten positions zeroed, updates'
    the output's gradient at them; for add: both pass the output's gradient through."""
    g = douts["output"]
    if reduction not in ("none", "add"):
        raise NotImplementedError(f"{op}: no gradient for reduction={reduction!r} (only none and add)")
    gx = g.copy()
    if reduction == "none":
        gx[index] = 0
    return {"data": gx, "updates": g[index]}


def _scatter_nd(xp, ins, attrs):
    """output = data with the slices that `indices` addresses set to (or combined by `reduction`
    with) `updates` (ONNX ScatterND)."""
    x = ins["data"]
    out = x.copy()
    _scatter(xp, out, _nd_index(xp, x.shape, ins["indices"], 0), ins["updates"], attrs["reduction"])
    return {"output": out}


register(
    OpDef(
        "scatter_nd",
        "light",
        ("data", "indices", "updates"),
        ("output",),
        _scatter_nd,
        lambda xp, i, o, d, a: _scatter_vjp(
            xp, i, d, _nd_index(xp, i["data"].shape, i["indices"], 0), a["reduction"], "scatter_nd"
        ),
        no_grad=("indices",),
        onnx="ScatterND",
        attrs={"reduction": "none"},
        infer_shape=lambda s, a: {"output": s["data"]},
    )
)


def _scatter_elements(xp, ins, attrs):
    """output = data with output[indices[i][j]][j] = updates[i][j] for axis 0 (and likewise per
    axis), or combined by `reduction` (ONNX ScatterElements)."""
    x = ins["data"]
    out = x.copy()
    index = element_index(xp, x, ins["indices"], attrs["axis"] % x.ndim)
    _scatter(xp, out, index, ins["updates"], attrs["reduction"])
    return {"output": out}


register(
    OpDef(
        "scatter_elements",
        "light",
        ("data", "indices", "updates"),
        ("output",),
        _scatter_elements,
        lambda xp, i, o, d, a: _scatter_vjp(
            xp,
            i,
            d,
            element_index(xp, i["data"], i["indices"], a["axis"] % i["data"].ndim),
            a["reduction"],
            "scatter_elements",
        ),
        no_grad=("indices",),
        onnx="ScatterElements",
        attrs={"axis": 0, "reduction": "none"},
        infer_shape=lambda s, a: {"output": s["data"]},
    )
)


# -- sequences ---------------------------------------------------------------------------------
def _range(xp, ins, attrs):
    """output = start, start + delta, ... while before limit; max(ceil((limit - start) / delta), 0)
    elements of start's dtype (ONNX Range)."""
    import math

    start, limit, delta = ins["start"], ins["limit"], ins["delta"]
    n = max(math.ceil((float(limit) - float(start)) / float(delta)), 0)
    return {"output": (start + xp.arange(n, dtype=delta.dtype) * delta).astype(start.dtype)}


register(OpDef("range", "light", ("start", "limit", "delta"), ("output",), _range, onnx="Range"))


def _cumsum_axis(ins, attrs, ndim: int) -> int:
    return int(static_arg(ins, attrs, "axis")) % ndim


def _cumsum(xp, ins, attrs, x=None):
    """y = the running sum of x along `axis`; `exclusive` leaves out the element itself, `reverse`
    sums from the end (ONNX CumSum)."""
    x = ins["x"] if x is None else x
    axis = _cumsum_axis(ins, attrs, x.ndim)
    if attrs["reverse"]:
        x = xp.flip(x, axis)
    y = xp.cumsum(x, axis=axis, dtype=x.dtype)
    if attrs["exclusive"]:
        y = xp.concatenate(
            [xp.zeros_like(xp.take(y, [0], axis=axis)), xp.take(y, range(y.shape[axis] - 1), axis=axis)],
            axis=axis,
        )
    return {"y": xp.flip(y, axis) if attrs["reverse"] else y}


def _cumsum_vjp(xp, ins, outs, douts, attrs):
    """The adjoint of a running sum is the running sum the other way (same exclusiveness)."""
    flipped = {**attrs, "reverse": 1 - int(attrs["reverse"])}
    return {"x": _cumsum(xp, ins, flipped, douts["y"])["y"]}


register(
    OpDef(
        "cumsum",
        "light",
        ("x", "axis?"),
        ("y",),
        _cumsum,
        _cumsum_vjp,
        no_grad=("axis",),
        onnx="CumSum",
        attrs={"axis": None, "exclusive": 0, "reverse": 0},
        infer_shape=lambda s, a: {"y": s["x"]},
    )
)


def _size(xp, ins, attrs):
    """size = the number of elements of data, an int64 scalar."""
    import numpy as np

    return {"size": xp.asarray(np.int64(ins["data"].size))}


register(
    OpDef("size", "light", ("data",), ("size",), _size, onnx="Size", infer_shape=lambda s, a: {"size": ()})
)


def _nonzero(xp, ins, attrs):
    """Y = the indices of X's non-zero elements, [rank, count] int64 in row-major order."""
    x = ins["X"]
    return {"Y": xp.stack(xp.nonzero(x.reshape(1) if x.ndim == 0 else x)).astype("int64").reshape(x.ndim, -1)}


register(OpDef("nonzero", "light", ("X",), ("Y",), _nonzero, onnx="NonZero"))


# -- arg-reductions and sorting ----------------------------------------------------------------
def _arg(find):
    def kernel(xp, ins, attrs):
        x = ins["data"]
        axis = attrs["axis"] % x.ndim
        if attrs["select_last_index"]:
            i = x.shape[axis] - 1 - find(xp.flip(x, axis), axis=axis)
        else:
            i = find(x, axis=axis)
        i = i.astype("int64")
        return {"reduced": xp.expand_dims(i, axis) if attrs["keepdims"] else i}

    kernel.__doc__ = (
        "reduced = int64 index of the extremum along `axis` (the first, or the last "
        "when select_last_index), keeping the axis when keepdims."
    )
    return kernel


def _arg_shape(s, attrs):
    x = s["data"]
    axis = attrs.get("axis", 0) % len(x)
    keep = attrs.get("keepdims", 1)
    return {"reduced": tuple(1 if i == axis else d for i, d in enumerate(x) if keep or i != axis)}


for _name, _onnx, _find in (
    ("argmax", "ArgMax", lambda x, axis: x.argmax(axis=axis)),
    ("argmin", "ArgMin", lambda x, axis: x.argmin(axis=axis)),
):
    register(
        OpDef(
            _name,
            "light",
            ("data",),
            ("reduced",),
            _arg(_find),
            onnx=_onnx,
            attrs={"axis": 0, "keepdims": 1, "select_last_index": 0},
            infer_shape=_arg_shape,
        )
    )


def _topk_order(xp, x, axis: int, largest: bool):
    """Positions sorting x along `axis`, largest (or smallest) first, ties by lower index first."""
    if not largest:
        return xp.argsort(x, axis=axis, kind="stable")
    n = x.shape[axis]  # descending and stable: sort the reversed array ascending, then reverse
    return xp.flip(n - 1 - xp.argsort(xp.flip(x, axis), axis=axis, kind="stable"), axis)


def _topk(xp, ins, attrs):
    """Values, Indices = the K largest (or smallest) elements along `axis`, sorted, ties by lower
    index (ONNX TopK)."""
    x = ins["X"]
    axis = attrs["axis"] % x.ndim
    k = _scalar(static_arg(ins, attrs, "K"))
    order = xp.take(_topk_order(xp, x, axis, bool(attrs["largest"])), range(k), axis=axis)
    return {"Values": xp.take_along_axis(x, order, axis=axis), "Indices": order.astype("int64")}


def _topk_vjp(xp, ins, outs, douts, attrs):
    x, g = ins["X"], douts["Values"]
    out = xp.zeros(x.shape, dtype=g.dtype)
    xp.put_along_axis(out, outs["Indices"], g, axis=attrs["axis"] % x.ndim)
    return {"X": out}


register(
    OpDef(
        "topk",
        "light",
        ("X", "K?"),
        ("Values", "Indices"),
        _topk,
        _topk_vjp,
        no_grad=("K",),
        onnx="TopK",
        attrs={"K": None, "axis": -1, "largest": 1, "sorted": 1},
    )
)


# -- masks and encodings -----------------------------------------------------------------------
def _trilu_keep(xp, shape, k: int, upper: bool):
    rows = xp.arange(shape[-2]).reshape(-1, 1)
    cols = xp.arange(shape[-1]).reshape(1, -1)
    return cols - rows >= k if upper else cols - rows <= k


def _trilu(xp, ins, attrs):
    """output = input's upper (or lower) triangle of its last two dims from diagonal `k` on, zeros
    elsewhere (ONNX Trilu)."""
    x = ins["input"]
    keep = _trilu_keep(xp, x.shape, _scalar(static_arg(ins, attrs, "k")), bool(attrs["upper"]))
    return {"output": xp.where(keep, x, xp.zeros((), dtype=x.dtype))}


def _trilu_vjp(xp, ins, outs, douts, attrs):
    g = douts["output"]
    keep = _trilu_keep(xp, g.shape, _scalar(static_arg(ins, attrs, "k")), bool(attrs["upper"]))
    return {"input": xp.where(keep, g, xp.zeros((), dtype=g.dtype))}


register(
    OpDef(
        "trilu",
        "light",
        ("input", "k?"),
        ("output",),
        _trilu,
        _trilu_vjp,
        no_grad=("k",),
        onnx="Trilu",
        attrs={"k": 0, "upper": 1},
        infer_shape=lambda s, a: {"output": s["input"]},
    )
)


def _one_hot(xp, ins, attrs):
    """output = `values`[1] where the new `axis` equals the index, `values`[0] elsewhere; indices in
    [-depth, depth) (negative ones count from the end), others give an all-off row (ONNX OneHot)."""
    idx = ins["indices"]
    depth = _scalar(static_arg(ins, attrs, "depth"))
    values = ins["values"]
    idx = idx.astype("int64") if idx.dtype.kind == "f" else idx
    idx = _wrap(xp, idx, depth)
    axis = attrs["axis"] % (idx.ndim + 1)
    shape = [1] * (idx.ndim + 1)
    shape[axis] = depth
    hot = xp.expand_dims(idx, axis) == xp.arange(depth).reshape(shape)
    return {"output": xp.where(hot, values[1], values[0])}


register(
    OpDef(
        "one_hot",
        "light",
        ("indices", "depth?", "values"),
        ("output",),
        _one_hot,
        onnx="OneHot",
        attrs={"depth": None, "axis": -1},
    )
)
