"""Loss functions (category `loss`: placed with the dense part by default)."""

from __future__ import annotations

from .base import OpDef, register
from .nn import _sigmoid
from .shapes import broadcast, same_as


def _sce(xp, ins, attrs):
    """Out = max(X, 0) - X * Label + log(1 + exp(-|X|)): log loss on logits, elementwise."""
    x, y = ins["X"], ins["Label"]
    return {"Out": (xp.maximum(x, 0) - x * y + xp.log1p(xp.exp(-xp.abs(x)))).astype(x.dtype)}


register(OpDef("sigmoid_cross_entropy_with_logits", "loss", ("X", "Label"), ("Out",), _sce,
               lambda xp, i, o, d, a: {"X": d["Out"] * (_sigmoid(xp, i["X"]) - i["Label"])},
               no_grad=("Label",), infer_shape=same_as("X", "Out")))


def _log_loss(xp, ins, attrs):
    """Loss = -Labels * log(Predicted + epsilon) - (1 - Labels) * log(1 - Predicted + epsilon)
    (Paddle's log_loss: a log loss on probabilities, elementwise)."""
    p, y, eps = ins["Predicted"], ins["Labels"], attrs["epsilon"]
    return {"Loss": (-y * xp.log(p + eps) - (1 - y) * xp.log(1 - p + eps)).astype(p.dtype, copy=False)}


def _log_loss_vjp(xp, ins, outs, douts, attrs):
    p, y, eps = ins["Predicted"], ins["Labels"], attrs["epsilon"]
    g = douts["Loss"] * (-y / (p + eps) + (1 - y) / (1 - p + eps))
    return {"Predicted": g.astype(p.dtype, copy=False)}


register(OpDef("log_loss", "loss", ("Predicted", "Labels"), ("Loss",), _log_loss, _log_loss_vjp,
               no_grad=("Labels",), infer_shape=same_as("Predicted", "Loss"), attrs={"epsilon": 1e-4}))


def _softmax(xp, x, axis):
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _softmax_ce(xp, ins, attrs):
    """Softmax = softmax(Logits, axis); Loss = -sum(onehot(Label) * log Softmax) over axis, kept.

    Label holds class indices (shape of Loss) unless soft_label, then a distribution like Logits.
    """
    x, label, axis = ins["Logits"], ins["Label"], attrs["axis"]
    sm = _softmax(xp, x, axis)
    logp = x - x.max(axis=axis, keepdims=True)
    logp = logp - xp.log(xp.exp(logp).sum(axis=axis, keepdims=True))
    if attrs["soft_label"]:
        loss = -(label * logp).sum(axis=axis, keepdims=True)
    else:
        idx = label.astype("int64").reshape(_kept(x.shape, axis))
        loss = -xp.take_along_axis(logp, idx, axis=axis)
    return {"Softmax": sm.astype(x.dtype), "Loss": loss.astype(x.dtype)}


def _kept(shape, axis):
    return tuple(1 if i == axis % len(shape) else d for i, d in enumerate(shape))


def _softmax_ce_vjp(xp, ins, outs, douts, attrs):
    x, label, axis, g = ins["Logits"], ins["Label"], attrs["axis"], douts["Loss"]
    sm = outs["Softmax"]
    if attrs["soft_label"]:
        target = label
    else:
        target = xp.zeros_like(sm)
        xp.put_along_axis(target, label.astype("int64").reshape(_kept(x.shape, axis)), 1, axis=axis)
    return {"Logits": ((sm - target) * g).astype(x.dtype)}


register(OpDef("softmax_cross_entropy", "loss", ("Logits", "Label"), ("Softmax", "Loss"),
               _softmax_ce, _softmax_ce_vjp, no_grad=("Label",),
               infer_shape=lambda s, a: {"Softmax": s["Logits"],
                                         "Loss": _kept(s["Logits"], a.get("axis", -1))},
               attrs={"axis": -1, "soft_label": 0}))


def _square_error(xp, ins, attrs):
    """Out = (X - Y)^2 elementwise (Paddle's square_error_cost)."""
    d = ins["X"] - ins["Y"]
    return {"Out": d * d}


def _square_error_vjp(xp, ins, outs, douts, attrs):
    from .base import unbroadcast

    d = 2 * (ins["X"] - ins["Y"]) * douts["Out"]
    return {"X": unbroadcast(xp, d, ins["X"].shape), "Y": unbroadcast(xp, -d, ins["Y"].shape)}


register(OpDef("square_error", "loss", ("X", "Y"), ("Out",), _square_error, _square_error_vjp,
               infer_shape=lambda s, a: {"Out": broadcast(s["X"], s["Y"])}))
