"""Loss functions (category `loss`: placed with the dense part by default)."""

from __future__ import annotations

import math

import numpy as np

from ops_registry.base import OpDef, register, unbroadcast
from ops_registry.nn import _sigmoid, log_softmax, softmax
from ops_registry.shapes import broadcast, same_as


def check_binary_labels(y, op: str, slot: str) -> None:
    """ValueError unless every label of binary cross-entropy `op` lies in [0, 1]: 0/1 labels, or soft
    ones (probabilities); a rating, a class index or a NaN fed as its `slot` is refused. Checked in
    the loss kernels (the one place that knows a tensor is a bce label), on the batch's labels.
    Not on a device array: reading the check's answer would copy it to the host and wait for the
    device on every micro-batch (the gpu trainer's labels come from its readers' host feeds)."""
    if hasattr(y, "__cuda_array_interface__"):
        return
    bad = ~((y >= 0) & (y <= 1))
    if bool(bad.any()):
        got = y[bad].reshape(-1)[:5].tolist()
        raise ValueError(
            f"{op}: {slot} holds {int(bad.sum())} values outside [0, 1] (e.g. {got}); a binary "
            "cross-entropy needs 0/1 labels (or probabilities): map them to 0/1 (a data schema's "
            "label_threshold does) or use another loss"
        )


def _sce(xp, ins, attrs):
    """Out = max(X, 0) - X * Label + log(1 + exp(-|X|)): log loss on logits, elementwise."""
    x, y = ins["X"], ins["Label"]
    check_binary_labels(y, "sigmoid_cross_entropy_with_logits", "Label")
    return {"Out": (xp.maximum(x, 0) - x * y + xp.log1p(xp.exp(-xp.abs(x)))).astype(x.dtype)}


register(
    OpDef(
        "sigmoid_cross_entropy_with_logits",
        "loss",
        ("X", "Label"),
        ("Out",),
        _sce,
        lambda xp, i, o, d, a: {"X": d["Out"] * (_sigmoid(xp, i["X"]) - i["Label"])},
        no_grad=("Label",),
        infer_shape=same_as("X", "Out"),
    )
)


def _log_loss(xp, ins, attrs):
    """Loss = -Labels * log(Predicted + epsilon) - (1 - Labels) * log(1 - Predicted + epsilon)
    (Paddle's log_loss: a log loss on probabilities, elementwise)."""
    p, y, eps = ins["Predicted"], ins["Labels"], attrs["epsilon"]
    check_binary_labels(y, "log_loss", "Labels")
    return {"Loss": (-y * xp.log(p + eps) - (1 - y) * xp.log(1 - p + eps)).astype(p.dtype, copy=False)}


def _log_loss_vjp(xp, ins, outs, douts, attrs):
    p, y, eps = ins["Predicted"], ins["Labels"], attrs["epsilon"]
    g = douts["Loss"] * (-y / (p + eps) + (1 - y) / (1 - p + eps))
    return {"Predicted": g.astype(p.dtype, copy=False)}


register(
    OpDef(
        "log_loss",
        "loss",
        ("Predicted", "Labels"),
        ("Loss",),
        _log_loss,
        _log_loss_vjp,
        no_grad=("Labels",),
        infer_shape=same_as("Predicted", "Loss"),
        attrs={"epsilon": 1e-4},
    )
)


def _softmax_ce(xp, ins, attrs):
    """Softmax = softmax(Logits, axis); Loss = -sum(onehot(Label) * log Softmax) over axis, kept.

    Label holds class indices (shape of Loss) unless soft_label, then a distribution like Logits.
    """
    x, label, axis = ins["Logits"], ins["Label"], attrs["axis"]
    sm = softmax(xp, x, axis)
    logp = log_softmax(xp, x, axis)
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


register(
    OpDef(
        "softmax_cross_entropy",
        "loss",
        ("Logits", "Label"),
        ("Softmax", "Loss"),
        _softmax_ce,
        _softmax_ce_vjp,
        no_grad=("Label",),
        infer_shape=lambda s, a: {"Softmax": s["Logits"], "Loss": _kept(s["Logits"], a.get("axis", -1))},
        attrs={"axis": -1, "soft_label": 0},
    )
)


def _square_error(xp, ins, attrs):
    """Out = (X - Y)^2 elementwise (Paddle's square_error_cost)."""
    d = ins["X"] - ins["Y"]
    return {"Out": d * d}


def _square_error_vjp(xp, ins, outs, douts, attrs):
    d = 2 * (ins["X"] - ins["Y"]) * douts["Out"]
    return {"X": unbroadcast(xp, d, ins["X"].shape), "Y": unbroadcast(xp, -d, ins["Y"].shape)}


register(
    OpDef(
        "square_error",
        "loss",
        ("X", "Y"),
        ("Out",),
        _square_error,
        _square_error_vjp,
        infer_shape=lambda s, a: {"Out": broadcast(s["X"], s["Y"])},
    )
)


def _log_clamped(xp, p):
    """log(p) floored at -100, as torch's BCELoss and Paddle's bce_loss do (log 0 stays finite)."""
    with np.errstate(divide="ignore"):  # cupy never warns
        return xp.maximum(xp.log(p), -100.0)


def _bce(xp, ins, attrs):
    """Out = -(Label * log X + (1 - Label) * log(1 - X)) on probabilities X, logs floored at -100."""
    x, y = ins["X"], ins["Label"]
    check_binary_labels(y, "bce_loss", "Label")
    return {"Out": (-(y * _log_clamped(xp, x) + (1 - y) * _log_clamped(xp, 1 - x))).astype(x.dtype)}


def _bce_vjp(xp, ins, outs, douts, attrs):
    x, y, g = ins["X"], ins["Label"], douts["Out"]
    floor = math.exp(-100.0)  # below it the clamped log is flat
    with np.errstate(divide="ignore", invalid="ignore"):
        d = xp.where(x > floor, y / x, 0) - xp.where(1 - x > floor, (1 - y) / (1 - x), 0)
    return {"X": unbroadcast(xp, -g * d, x.shape).astype(x.dtype)}


register(
    OpDef(
        "bce_loss",
        "loss",
        ("X", "Label"),
        ("Out",),
        _bce,
        _bce_vjp,
        no_grad=("Label",),
        infer_shape=lambda s, a: {"Out": broadcast(s["X"], s["Label"])},
    )
)


def _class_weights(xp, target, weight, ignore_index, dtype):
    """Per-element class index (ignored ones set to 0) and weight (0 where ignored)."""
    t = target.astype("int64")
    keep = t != ignore_index if ignore_index is not None else xp.ones(t.shape, dtype=bool)
    t = xp.where(keep, t, 0)
    w = weight[t] if weight is not None else xp.ones(t.shape, dtype=dtype)
    return t, (w * keep).astype(dtype)


def _nll(xp, logp, target, weight, attrs):
    """ONNX NegativeLogLikelihoodLoss of logp [N, C, d1, ...] against class ids [N, d1, ...]."""
    t, w = _class_weights(xp, target, weight, attrs["ignore_index"], logp.dtype)
    loss = -xp.take_along_axis(logp, xp.expand_dims(t, 1), axis=1).squeeze(1) * w
    if attrs["reduction"] == "none":
        return loss
    if attrs["reduction"] == "sum":
        return loss.sum()
    return loss.sum() / w.sum()


def _nll_vjp(xp, logp, target, weight, g, attrs):
    """d loss / d logp: -weight at the target class, scaled like the reduction."""
    t, w = _class_weights(xp, target, weight, attrs["ignore_index"], logp.dtype)
    if attrs["reduction"] == "mean":
        w = w / w.sum()
    glogp = xp.zeros_like(logp)
    xp.put_along_axis(glogp, xp.expand_dims(t, 1), xp.expand_dims(-w * g, 1), axis=1)
    return glogp


def _check_reduction(attrs) -> None:
    if attrs["reduction"] not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be none, sum or mean, not {attrs['reduction']!r}")


def _nll_kernel(xp, ins, attrs):
    """loss = -input[n, target[n, ...], ...] * weight[target] (0 at ignore_index), then reduced:
    none, sum, or mean = sum / sum of the weights used (ONNX NegativeLogLikelihoodLoss)."""
    _check_reduction(attrs)
    x = ins["input"]
    return {"loss": xp.asarray(_nll(xp, x, ins["target"], ins.get("weight"), attrs)).astype(x.dtype)}


register(
    OpDef(
        "nll_loss",
        "loss",
        ("input", "target", "weight?"),
        ("loss",),
        _nll_kernel,
        lambda xp, i, o, d, a: {
            "input": _nll_vjp(xp, i["input"], i["target"], i.get("weight"), d["loss"], a)
        },
        no_grad=("target", "weight"),
        onnx="NegativeLogLikelihoodLoss",
        attrs={"ignore_index": None, "reduction": "mean"},
    )
)


def _sce_loss(xp, ins, attrs):
    """log_prob = log_softmax(scores, axis 1); output = NegativeLogLikelihoodLoss(log_prob, labels,
    weights) with the same ignore_index / reduction (ONNX SoftmaxCrossEntropyLoss)."""
    _check_reduction(attrs)
    x = ins["scores"]
    logp = log_softmax(xp, x, 1)
    out = _nll(xp, logp, ins["labels"], ins.get("weights"), attrs)
    return {"output": xp.asarray(out).astype(x.dtype), "log_prob": logp.astype(x.dtype)}


def _sce_loss_vjp(xp, ins, outs, douts, attrs):
    logp = outs["log_prob"] if "log_prob" in outs else log_softmax(xp, ins["scores"], 1)  # undeclared
    g = xp.zeros_like(logp)
    if douts.get("output") is not None:
        g = _nll_vjp(xp, logp, ins["labels"], ins.get("weights"), douts["output"], attrs)
    if douts.get("log_prob") is not None:
        g = g + douts["log_prob"]
    return {"scores": g - xp.exp(logp) * g.sum(axis=1, keepdims=True)}


register(
    OpDef(
        "softmax_cross_entropy_loss",
        "loss",
        ("scores", "labels", "weights?"),
        ("output", "log_prob"),
        _sce_loss,
        _sce_loss_vjp,
        no_grad=("labels", "weights"),
        onnx="SoftmaxCrossEntropyLoss",
        attrs={"ignore_index": None, "reduction": "mean"},
    )
)
