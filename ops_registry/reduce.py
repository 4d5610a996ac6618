"""Reductions (ReduceSum, ReduceMean, ReduceMax, ...) with ONNX semantics: axes as an attribute or
an input, `keepdims`, `noop_with_empty_axes`."""

from __future__ import annotations

from ops_registry.base import OpDef, register, static_arg
from ops_registry.shapes import reduce


def _axes(attrs, ins=None):
    """The reduced axes: None for all; () for none (empty axes with noop_with_empty_axes)."""
    axes = static_arg(ins or {}, attrs, "axes")
    if axes is None or len(axes) == 0:
        return () if attrs.get("noop_with_empty_axes") else None
    return tuple(axes)


def _reduce_sum(xp, ins, attrs):
    """reduced = sum of data over `axes` (all when absent), keeping them when keepdims."""
    x = ins["data"]
    return {"reduced": x.sum(axis=_axes(attrs, ins), keepdims=bool(attrs["keepdims"])).astype(x.dtype)}


def _reduce_mean(xp, ins, attrs):
    """reduced = mean of data over `axes` (all when absent), keeping them when keepdims."""
    x = ins["data"]
    return {"reduced": x.mean(axis=_axes(attrs, ins), keepdims=bool(attrs["keepdims"])).astype(x.dtype)}


def _reduce_max(xp, ins, attrs):
    """reduced = max of data over `axes` (all when absent); an empty reduction gives the dtype's
    lowest value (-inf for floats), as ONNX specifies."""
    x = ins["data"]
    low = False if x.dtype == bool else (-xp.inf if x.dtype.kind == "f" else xp.iinfo(x.dtype).min)
    return {"reduced": x.max(axis=_axes(attrs, ins), keepdims=bool(attrs["keepdims"]), initial=low)}


def _expand_back(xp, g, x, attrs, ins):
    axes = _axes(attrs, ins)
    if not attrs["keepdims"]:
        ax = range(x.ndim) if axes is None else [a % x.ndim for a in axes]
        g = g.reshape([1 if i in ax else d for i, d in enumerate(x.shape)])
    return xp.broadcast_to(g, x.shape)


def _reduce_count(x, attrs, ins):
    axes = _axes(attrs, ins)
    ax = range(x.ndim) if axes is None else [a % x.ndim for a in axes]
    n = 1
    for a in ax:
        n *= x.shape[a]
    return n


def _reduce_extremum_vjp(xp, ins, outs, douts, attrs):
    """ReduceMax / ReduceMin: the gradient goes to the elements equal to the result, shared equally
    between ties."""
    x = ins["data"]
    hit = x == _expand_back(xp, outs["reduced"], x, attrs, ins)
    axes = _axes(attrs, ins)
    ties = hit.sum(axis=axes, keepdims=True)
    return {"data": (_expand_back(xp, douts["reduced"], x, attrs, ins) * hit / ties).astype(x.dtype)}


def _reduce_min(xp, ins, attrs):
    """reduced = min of data over `axes` (all when absent); an empty reduction gives the dtype's
    highest value (+inf for floats, True for bools), as ONNX specifies."""
    x = ins["data"]
    high = True if x.dtype == bool else (xp.inf if x.dtype.kind == "f" else xp.iinfo(x.dtype).max)
    return {"reduced": x.min(axis=_axes(attrs, ins), keepdims=bool(attrs["keepdims"]), initial=high)}


def _reduce_prod(xp, ins, attrs):
    """reduced = product of data over `axes` (all when absent; 1 for an empty reduction)."""
    x = ins["data"]
    return {"reduced": x.prod(axis=_axes(attrs, ins), keepdims=bool(attrs["keepdims"])).astype(x.dtype)}


def _reduce_prod_vjp(xp, ins, outs, douts, attrs):
    """d prod / d x_i = the product of the others: exclusive prefix times exclusive suffix products
    over the reduced elements (exact where some x are 0, unlike prod / x)."""
    x = ins["data"]
    axes = _axes(attrs, ins)
    ax = list(range(x.ndim)) if axes is None else sorted({a % x.ndim for a in axes})
    rest = [i for i in range(x.ndim) if i not in ax]
    moved = xp.transpose(x, rest + ax)
    flat = moved.reshape(*moved.shape[: len(rest)], -1)
    ones = xp.ones((*flat.shape[:-1], 1), dtype=x.dtype)
    before = xp.concatenate([ones, xp.cumprod(flat, axis=-1)[..., :-1]], axis=-1)
    after = xp.flip(xp.concatenate([ones, xp.cumprod(xp.flip(flat, -1), axis=-1)[..., :-1]], axis=-1), -1)
    others = xp.transpose((before * after).reshape(moved.shape), _inverse(rest + ax))
    return {"data": (_expand_back(xp, douts["reduced"], x, attrs, ins) * others).astype(x.dtype)}


def _inverse(perm: list[int]) -> list[int]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return out


def _reduce_l2(xp, ins, attrs):
    """reduced = sqrt of the sum of squares of data over `axes` (all when absent)."""
    x = ins["data"]
    return {
        "reduced": xp.sqrt((x * x).sum(axis=_axes(attrs, ins), keepdims=bool(attrs["keepdims"]))).astype(
            x.dtype
        )
    }


def _reduce_l2_vjp(xp, ins, outs, douts, attrs):
    """d ||x|| / dx = x / ||x|| (0 where the norm is 0: the subgradient of least norm)."""
    x = ins["data"]
    y = _expand_back(xp, outs["reduced"], x, attrs, ins)
    g = _expand_back(xp, douts["reduced"], x, attrs, ins)
    return {"data": xp.where(y > 0, g * x / xp.where(y > 0, y, 1), 0).astype(x.dtype)}


def _reduce_sum_square(xp, ins, attrs):
    """reduced = sum of squares of data over `axes` (all when absent)."""
    x = ins["data"]
    return {"reduced": (x * x).sum(axis=_axes(attrs, ins), keepdims=bool(attrs["keepdims"])).astype(x.dtype)}


def _reduce_log_sum_exp(xp, ins, attrs):
    """reduced = log(sum(exp(data))) over `axes` (all when absent), shifted by the max so exp never
    overflows; -inf for an empty reduction."""
    x = ins["data"]
    axes = _axes(attrs, ins)
    m = x.max(axis=axes, keepdims=True, initial=-xp.inf)
    m = xp.where(xp.isfinite(m), m, 0)
    y = xp.log(xp.exp(x - m).sum(axis=axes, keepdims=True)) + m
    if not attrs["keepdims"]:
        y = y.reshape(reduce(x.shape, axes, False))
    return {"reduced": y.astype(x.dtype)}


def _vjp_from(local):
    """A reduction's vjp from its local derivative `local(xp, x, y) = d y / d x` (y broadcast back)."""

    def vjp(xp, ins, outs, douts, attrs):
        x = ins["data"]
        y = _expand_back(xp, outs["reduced"], x, attrs, ins)
        return {"data": (_expand_back(xp, douts["reduced"], x, attrs, ins) * local(xp, x, y)).astype(x.dtype)}

    return vjp


def _reduce_sum_vjp(xp, ins, outs, douts, attrs):
    x = ins["data"]
    return {"data": _expand_back(xp, douts["reduced"], x, attrs, ins).astype(x.dtype)}


def _reduce_mean_vjp(xp, ins, outs, douts, attrs):
    x = ins["data"]
    g = _expand_back(xp, douts["reduced"], x, attrs, ins)
    return {"data": (g / _reduce_count(x, attrs, ins)).astype(x.dtype)}


for _name, _onnx, _k, _v in (
    ("reduce_sum", "ReduceSum", _reduce_sum, _reduce_sum_vjp),
    ("reduce_mean", "ReduceMean", _reduce_mean, _reduce_mean_vjp),
    ("reduce_max", "ReduceMax", _reduce_max, _reduce_extremum_vjp),
    ("reduce_min", "ReduceMin", _reduce_min, _reduce_extremum_vjp),
    ("reduce_prod", "ReduceProd", _reduce_prod, _reduce_prod_vjp),
    ("reduce_l2", "ReduceL2", _reduce_l2, _reduce_l2_vjp),
    ("reduce_sum_square", "ReduceSumSquare", _reduce_sum_square, _vjp_from(lambda xp, x, y: 2 * x)),
    ("reduce_log_sum_exp", "ReduceLogSumExp", _reduce_log_sum_exp, _vjp_from(lambda xp, x, y: xp.exp(x - y))),
):
    register(
        OpDef(
            _name,
            "light",
            ("data", "axes?"),
            ("reduced",),
            _k,
            _v,
            no_grad=("axes",),
            onnx=_onnx,
            attrs={"axes": None, "keepdims": 1, "noop_with_empty_axes": 0},
            infer_shape=lambda s, a: {"reduced": reduce(s["data"], _axes(a), a.get("keepdims", 1))},
        )
    )
