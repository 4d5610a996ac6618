"""Activations and normalisation layers."""

from __future__ import annotations

from ops_registry.base import OpDef, register, static_arg, unbroadcast
from ops_registry.shapes import same_as


def _unary(name, onnx, fwd, vjp, doc, category="light", attrs=None, slots=("X", "Y")):
    """Register a one-input one-output op (slots as in ONNX's schema: X -> Y or input -> output);
    `vjp(xp, x, y, g, attrs)` gives the input's gradient, None for a non-differentiable op."""
    x_, y_ = slots

    def kernel(xp, ins, a):
        return {y_: fwd(xp, ins[x_], a)}

    kernel.__doc__ = doc
    grad = None if vjp is None else lambda xp, i, o, d, a: {x_: vjp(xp, i[x_], o[y_], d[y_], a)}
    register(
        OpDef(
            name,
            category,
            (x_,),
            (y_,),
            kernel,
            grad,
            infer_shape=same_as(x_, y_),
            onnx=onnx,
            attrs=attrs or {},
        )
    )


_unary(
    "relu",
    "Relu",
    lambda xp, x, a: xp.maximum(x, 0).astype(x.dtype, copy=False),
    lambda xp, x, y, g, a: g * (x > 0),
    "Y = max(X, 0).",
)
_unary(
    "leaky_relu",
    "LeakyRelu",
    lambda xp, x, a: xp.where(x >= 0, x, x * a["alpha"]).astype(x.dtype, copy=False),
    lambda xp, x, y, g, a: xp.where(x >= 0, g, g * a["alpha"]),
    "Y = X if X >= 0 else alpha * X.",
    attrs={"alpha": 0.01},
)
_unary(
    "sigmoid",
    "Sigmoid",
    lambda xp, x, a: _sigmoid(xp, x),
    lambda xp, x, y, g, a: g * y * (1 - y),
    "Y = 1 / (1 + exp(-X)), computed without overflow.",
)
_unary(
    "tanh",
    "Tanh",
    lambda xp, x, a: xp.tanh(x),
    lambda xp, x, y, g, a: g * (1 - y * y),
    "output = tanh(input).",
    slots=("input", "output"),
)


def log_softmax(xp, x, axis: int):
    """log(softmax(x)) along `axis`, shifted by the max so exp never overflows."""
    z = x - x.max(axis=axis, keepdims=True)
    return z - xp.log(xp.exp(z).sum(axis=axis, keepdims=True))


def softmax(xp, x, axis: int):
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


_unary(
    "softmax",
    "Softmax",
    lambda xp, x, a: softmax(xp, x, a["axis"]).astype(x.dtype, copy=False),
    lambda xp, x, y, g, a: y * (g - (g * y).sum(axis=a["axis"], keepdims=True)),
    "output = exp(input) / sum(exp(input)) along `axis`.",
    attrs={"axis": -1},
    slots=("input", "output"),
)
_unary(
    "log_softmax",
    "LogSoftmax",
    lambda xp, x, a: log_softmax(xp, x, a["axis"]).astype(x.dtype, copy=False),
    lambda xp, x, y, g, a: g - xp.exp(y) * g.sum(axis=a["axis"], keepdims=True),
    "output = log(softmax(input)) along `axis`.",
    attrs={"axis": -1},
    slots=("input", "output"),
)


def _sigmoid(xp, x):
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


def _dropout(xp, ins, attrs):
    """output = data * mask / (1 - ratio) in training mode, data otherwise (upscale_in_train).

    The mask is drawn from (seed, _rng_step) so every run and every trainer draws the same one.
    `ratio` and `training_mode` may also come as tensors (ONNX's optional inputs).
    """
    x = ins["data"]
    ratio = float(static_arg(ins, attrs, "ratio"))
    if not static_arg(ins, attrs, "training_mode") or ratio == 0.0:
        return {"output": x, "mask": xp.ones(x.shape, dtype=bool)}
    import numpy as np

    rng = np.random.default_rng((int(attrs["seed"]), int(attrs.get("_rng_step", 0))))
    mask = xp.asarray(rng.random(x.shape) >= ratio)
    return {"output": (x * mask / (1.0 - ratio)).astype(x.dtype, copy=False), "mask": mask}


def _dropout_vjp(xp, ins, outs, douts, attrs):
    ratio = float(static_arg(ins, attrs, "ratio"))
    if not static_arg(ins, attrs, "training_mode") or ratio == 0.0:
        return {"data": douts["output"]}
    return {"data": douts["output"] * outs["mask"] / (1.0 - ratio)}


register(
    OpDef(
        "dropout",
        "light",
        ("data", "ratio?", "training_mode?"),
        ("output", "mask"),
        _dropout,
        _dropout_vjp,
        no_grad=("ratio", "training_mode"),
        infer_shape=lambda s, a: {"output": s["data"], "mask": s["data"]},
        onnx="Dropout",
        needs_rng=True,
        attrs={"ratio": 0.5, "training_mode": 1, "seed": 0},
    )
)


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


def _only_y_grad(op: str, douts: dict, stats: tuple[str, ...]) -> None:
    """Statistics outputs feeding a loss would need their own gradient terms; refuse, don't drop."""
    used = [s for s in stats if douts.get(s) is not None]
    if used:
        raise NotImplementedError(f"{op}: gradient through output(s) {used} is not implemented (only Y)")


def _layer_norm_vjp(xp, ins, outs, douts, attrs):
    _only_y_grad("layer_norm", douts, ("Mean", "InvStdDev"))
    x, scale, g = ins["X"], ins["Scale"], douts["Y"]
    axes = tuple(range(attrs["axis"] % x.ndim, x.ndim))
    lead = tuple(range(attrs["axis"] % x.ndim))
    inv = outs["InvStdDev"]
    xhat = (x - outs["Mean"]) * inv
    gxhat = g * scale
    n = 1
    for a in axes:
        n *= x.shape[a]
    gx = inv * (
        gxhat
        - gxhat.sum(axis=axes, keepdims=True) / n
        - xhat * (gxhat * xhat).sum(axis=axes, keepdims=True) / n
    )
    out = {"X": gx, "Scale": (g * xhat).sum(axis=lead).reshape(scale.shape)}
    if "B" in ins:
        out["B"] = g.sum(axis=lead).reshape(ins["B"].shape)
    return out


def _layer_norm_shape(s, attrs):
    x = s["X"]
    axis = attrs.get("axis", -1) % len(x)
    stat = x[:axis] + (1,) * (len(x) - axis)
    return {"Y": x, "Mean": stat, "InvStdDev": stat}


register(
    OpDef(
        "layer_norm",
        "dense",
        ("X", "Scale", "B?"),
        ("Y", "Mean", "InvStdDev"),
        _layer_norm,
        _layer_norm_vjp,
        infer_shape=_layer_norm_shape,
        onnx="LayerNormalization",
        attrs={"axis": -1, "epsilon": 1e-5},
    )
)


def _bn_axes(x) -> tuple[int, ...]:
    return (0, *range(2, x.ndim))


def _per_channel(v, x):
    """A [C] vector shaped to broadcast against X [N, C, D1, ...]."""
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


def _batch_norm(xp, ins, attrs):
    """Y = (X - mean) / sqrt(var + epsilon) * scale + B per channel (axis 1; ONNX
    BatchNormalization). Inference mode uses input_mean / input_var; training mode uses the batch's
    statistics (biased variance) and outputs running_* = input_* * momentum + batch * (1 - momentum).
    """
    x, m = ins["X"], attrs["momentum"]
    if attrs["training_mode"]:
        mean, var = x.mean(axis=_bn_axes(x)), x.var(axis=_bn_axes(x))
        run_mean = ins["input_mean"] * m + mean * (1 - m)
        run_var = ins["input_var"] * m + var * (1 - m)
    else:
        mean, var = ins["input_mean"], ins["input_var"]
        run_mean, run_var = mean, var
    inv = 1.0 / xp.sqrt(_per_channel(var, x) + attrs["epsilon"])
    y = (x - _per_channel(mean, x)) * inv * _per_channel(ins["scale"], x) + _per_channel(ins["B"], x)
    return {
        "Y": y.astype(x.dtype, copy=False),
        "running_mean": run_mean.astype(x.dtype, copy=False),
        "running_var": run_var.astype(x.dtype, copy=False),
    }


def _batch_norm_vjp(xp, ins, outs, douts, attrs):
    _only_y_grad("batch_norm", douts, ("running_mean", "running_var"))
    x, g = ins["X"], douts["Y"]
    axes = _bn_axes(x)
    mean = x.mean(axis=axes) if attrs["training_mode"] else ins["input_mean"]
    var = x.var(axis=axes) if attrs["training_mode"] else ins["input_var"]
    inv = 1.0 / xp.sqrt(_per_channel(var, x) + attrs["epsilon"])
    xhat = (x - _per_channel(mean, x)) * inv
    gxhat = g * _per_channel(ins["scale"], x)
    if attrs["training_mode"]:  # the batch statistics depend on X too
        n = x.size // x.shape[1]
        gx = inv * (
            gxhat
            - gxhat.sum(axis=axes, keepdims=True) / n
            - xhat * (gxhat * xhat).sum(axis=axes, keepdims=True) / n
        )
    else:
        gx = gxhat * inv
    return {"X": gx, "scale": (g * xhat).sum(axis=axes), "B": g.sum(axis=axes)}


register(
    OpDef(
        "batch_norm",
        "dense",
        ("X", "scale", "B", "input_mean", "input_var"),
        ("Y", "running_mean", "running_var"),
        _batch_norm,
        _batch_norm_vjp,
        no_grad=("input_mean", "input_var"),
        onnx="BatchNormalization",
        infer_shape=lambda s, a: {
            "Y": s["X"],
            "running_mean": s["input_mean"],
            "running_var": s["input_var"],
        },
        attrs={"epsilon": 1e-5, "momentum": 0.9, "training_mode": 0},
    )
)


# -- activations exporters emit (issue 14) ------------------------------------------------------
def _cast_like(y, x):
    return y.astype(x.dtype, copy=False)


_unary(
    "softplus",
    "Softplus",
    lambda xp, x, a: _cast_like(xp.logaddexp(0, x), x),
    lambda xp, x, y, g, a: g * _sigmoid(xp, x),
    "Y = log(1 + exp(X)), computed without overflow.",
)


def _elu(xp, x, alpha):
    return _cast_like(xp.where(x > 0, x, alpha * xp.expm1(xp.minimum(x, 0))), x)


_unary(
    "elu",
    "Elu",
    lambda xp, x, a: _elu(xp, x, a["alpha"]),
    lambda xp, x, y, g, a: xp.where(x > 0, g, g * (y + a["alpha"])),
    "Y = X if X > 0 else alpha * (exp(X) - 1).",
    attrs={"alpha": 1.0},
)
_unary(
    "selu",
    "Selu",
    lambda xp, x, a: _cast_like(a["gamma"] * _elu(xp, x, a["alpha"]), x),
    lambda xp, x, y, g, a: g * xp.where(x > 0, a["gamma"], y + a["gamma"] * a["alpha"]),
    "Y = gamma * (X if X > 0 else alpha * (exp(X) - 1)).",
    attrs={"alpha": 1.6732632423543772, "gamma": 1.0507009873554805},
)
_unary(
    "hard_sigmoid",
    "HardSigmoid",
    lambda xp, x, a: _cast_like(xp.clip(a["alpha"] * x + a["beta"], 0, 1), x),
    lambda xp, x, y, g, a: g * a["alpha"] * ((y > 0) & (y < 1)),
    "Y = max(0, min(1, alpha * X + beta)).",
    attrs={"alpha": 0.2, "beta": 0.5},
)


def _hard_swish_vjp(xp, x, y, g, a):
    """d/dx x * clip(x/6 + 1/2, 0, 1) = 0 below -3, 1 above 3, x/3 + 1/2 between."""
    return g * xp.where(x <= -3, 0.0, xp.where(x >= 3, 1.0, x / 3 + 0.5)).astype(g.dtype, copy=False)


_unary(
    "hard_swish",
    "HardSwish",
    lambda xp, x, a: _cast_like(x * xp.clip(x / 6 + 0.5, 0, 1), x),
    _hard_swish_vjp,
    "Y = X * max(0, min(1, X / 6 + 1/2)).",
)


def _prelu(xp, ins, attrs):
    """Y = X if X >= 0 else slope * X (slope broadcasts to X)."""
    x, s = ins["X"], ins["slope"]
    return {"Y": _cast_like(xp.where(x >= 0, x, s * x), x)}


def _prelu_vjp(xp, ins, outs, douts, attrs):
    x, s, g = ins["X"], ins["slope"], douts["Y"]
    neg = x < 0
    return {"X": xp.where(neg, g * s, g), "slope": unbroadcast(xp, xp.where(neg, g * x, 0), s.shape)}


register(
    OpDef(
        "prelu",
        "light",
        ("X", "slope"),
        ("Y",),
        _prelu,
        _prelu_vjp,
        onnx="PRelu",
        infer_shape=same_as("X", "Y"),
    )
)
