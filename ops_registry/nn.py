"""Activations and normalisation layers."""

from __future__ import annotations

from .base import OpDef, register
from .shapes import same_as


def _unary(name, onnx, fwd, vjp, doc, category="elementwise", attrs=None):
    """Register a one-input one-output op X -> Y; `vjp(xp, x, y, g, attrs)` gives dX."""

    def kernel(xp, ins, a):
        return {"Y": fwd(xp, ins["X"], a)}

    kernel.__doc__ = doc
    register(OpDef(name, category, ("X",), ("Y",), kernel,
                   lambda xp, i, o, d, a: {"X": vjp(xp, i["X"], o["Y"], d["Y"], a)},
                   infer_shape=same_as("X", "Y"), onnx=onnx, attrs=attrs or {}))


_unary("relu", "Relu", lambda xp, x, a: xp.maximum(x, 0).astype(x.dtype, copy=False),
       lambda xp, x, y, g, a: g * (x > 0), "Y = max(X, 0).")
_unary("sigmoid", "Sigmoid", lambda xp, x, a: _sigmoid(xp, x),
       lambda xp, x, y, g, a: g * y * (1 - y), "Y = 1 / (1 + exp(-X)), computed without overflow.")
_unary("tanh", "Tanh", lambda xp, x, a: xp.tanh(x), lambda xp, x, y, g, a: g * (1 - y * y),
       "Y = tanh(X).")


def _sigmoid(xp, x):
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


def _dropout(xp, ins, attrs):
    """output = data * mask / (1 - ratio) in training mode, data otherwise (upscale_in_train).

    The mask is drawn from (seed, _rng_step) so every run and every trainer draws the same one.
    """
    x = ins["data"]
    ratio = float(attrs["ratio"])
    if not attrs["training_mode"] or ratio == 0.0:
        return {"output": x, "mask": xp.ones(x.shape, dtype=bool)}
    import numpy as np

    rng = np.random.default_rng((int(attrs["seed"]), int(attrs.get("_rng_step", 0))))
    mask = xp.asarray(rng.random(x.shape) >= ratio)
    return {"output": (x * mask / (1.0 - ratio)).astype(x.dtype, copy=False), "mask": mask}


def _dropout_vjp(xp, ins, outs, douts, attrs):
    ratio = float(attrs["ratio"])
    if not attrs["training_mode"] or ratio == 0.0:
        return {"data": douts["output"]}
    return {"data": douts["output"] * outs["mask"] / (1.0 - ratio)}


register(OpDef("dropout", "elementwise", ("data",), ("output", "mask"), _dropout, _dropout_vjp,
               infer_shape=lambda s, a: {"output": s["data"], "mask": s["data"]},
               onnx="Dropout", needs_rng=True,
               attrs={"ratio": 0.5, "training_mode": 1, "seed": 0}))


def _layer_norm(xp, ins, attrs):
    """Y = (X - mean) / sqrt(var + epsilon) * Scale + B over axes [axis, ndim) (ONNX
    LayerNormalization); also outputs Mean and InvStdDev with the reduced axes kept."""
    x = ins["X"]
    axes = tuple(range(attrs["axis"] % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    xc = x - mean
    inv = 1.0 / xp.sqrt((xc * xc).mean(axis=axes, keepdims=True) + attrs["epsilon"])
    y = xc * inv * ins["Scale"]
    if "B" in ins:
        y = y + ins["B"]
    return {"Y": y.astype(x.dtype, copy=False), "Mean": mean, "InvStdDev": inv}


def _layer_norm_vjp(xp, ins, outs, douts, attrs):
    x, scale, g = ins["X"], ins["Scale"], douts["Y"]
    axes = tuple(range(attrs["axis"] % x.ndim, x.ndim))
    lead = tuple(range(attrs["axis"] % x.ndim))
    inv = outs["InvStdDev"]
    xhat = (x - outs["Mean"]) * inv
    gxhat = g * scale
    n = 1
    for a in axes:
        n *= x.shape[a]
    gx = inv * (gxhat - gxhat.sum(axis=axes, keepdims=True) / n
                - xhat * (gxhat * xhat).sum(axis=axes, keepdims=True) / n)
    out = {"X": gx, "Scale": (g * xhat).sum(axis=lead).reshape(scale.shape)}
    if "B" in ins:
        out["B"] = g.sum(axis=lead).reshape(ins["B"].shape)
    return out


def _layer_norm_shape(s, attrs):
    x = s["X"]
    axis = attrs.get("axis", -1) % len(x)
    stat = x[:axis] + (1,) * (len(x) - axis)
    return {"Y": x, "Mean": stat, "InvStdDev": stat}


register(OpDef("layer_norm", "dense", ("X", "Scale", "B?"), ("Y", "Mean", "InvStdDev"),
               _layer_norm, _layer_norm_vjp, infer_shape=_layer_norm_shape,
               onnx="LayerNormalization", attrs={"axis": -1, "epsilon": 1e-5}))
