"""Logic, remainder, special functions and extrema that exporters emit for recommendation models
(issue 14), with ONNX semantics (multidirectional broadcasting)."""

from __future__ import annotations

import math

from ops_registry.base import OpDef, cupyx_of, register, unbroadcast
from ops_registry.math import _binary, _sum_shape
from ops_registry.nn import _unary
from ops_registry.shapes import binary

# -- ops exporters emit for recommendation models (issue 14) ---------------------------------------
_binary("and", "And", lambda xp, a, b: xp.logical_and(a, b), None, "C = A and B, bool (broadcasting).")
_binary("or", "Or", lambda xp, a, b: xp.logical_or(a, b), None, "C = A or B, bool (broadcasting).")
_binary("xor", "Xor", lambda xp, a, b: xp.logical_xor(a, b), None, "C = A xor B, bool (broadcasting).")
_unary("not", "Not", lambda xp, x, a: xp.logical_not(x), None, "Y = not X, bool.")


def _mod(xp, ins, attrs):
    """C = A mod B (broadcasting): the remainder takes the divisor's sign (Python's %), or the
    dividend's when `fmod` (C's fmod)."""
    a, b = ins["A"], ins["B"]
    return {"C": (xp.fmod(a, b) if attrs["fmod"] else xp.mod(a, b)).astype(a.dtype, copy=False)}


def _mod_vjp(xp, ins, outs, douts, attrs):
    """C = A - B * q with q piecewise constant (trunc or floor of A / B): dA = g, dB = -g q."""
    a, b, g = ins["A"], ins["B"], douts["C"]
    q = xp.trunc(a / b) if attrs["fmod"] else xp.floor(a / b)
    return {"A": unbroadcast(xp, g, a.shape), "B": unbroadcast(xp, -g * q, b.shape)}


register(
    OpDef(
        "mod",
        "light",
        ("A", "B"),
        ("C",),
        _mod,
        _mod_vjp,
        infer_shape=binary("C"),
        onnx="Mod",
        attrs={"fmod": 0},
    )
)


def _zero_grad(xp, x, y, g, a):
    """A piecewise-constant function: the gradient is 0 (as torch's floor / ceil / round / sign)."""
    return xp.zeros_like(g)


_unary("floor", "Floor", lambda xp, x, a: xp.floor(x), _zero_grad, "Y = floor(X).")
_unary("ceil", "Ceil", lambda xp, x, a: xp.ceil(x), _zero_grad, "Y = ceil(X).")
_unary(
    "round",
    "Round",
    lambda xp, x, a: xp.round(x),
    _zero_grad,
    "Y = X rounded to the nearest integer, halves to even.",
)
_unary(
    "sign",
    "Sign",
    lambda xp, x, a: xp.sign(x),
    _zero_grad,
    "output = -1, 0 or 1 by the sign of input.",
    slots=("input", "output"),
)
_unary(
    "reciprocal",
    "Reciprocal",
    lambda xp, x, a: (1 / x).astype(x.dtype, copy=False),
    lambda xp, x, y, g, a: -g * y * y,
    "Y = 1 / X.",
)
_unary(
    "sin",
    "Sin",
    lambda xp, x, a: xp.sin(x),
    lambda xp, x, y, g, a: g * xp.cos(x),
    "output = sin(input).",
    slots=("input", "output"),
)
_unary(
    "cos",
    "Cos",
    lambda xp, x, a: xp.cos(x),
    lambda xp, x, y, g, a: -g * xp.sin(x),
    "output = cos(input).",
    slots=("input", "output"),
)


def _erf(xp, x, a):
    if xp.__name__ == "numpy":
        from scipy.special import erf
    else:  # cupy
        erf = cupyx_of(xp).scipy.special.erf
    return erf(x).astype(x.dtype, copy=False)


_unary(
    "erf",
    "Erf",
    _erf,
    lambda xp, x, y, g, a: g * (2 / math.sqrt(math.pi)) * xp.exp(-x * x),
    "output = erf(input), the Gauss error function (exact GELU is x/2 * (1 + erf(x / sqrt 2))).",
    slots=("input", "output"),
)
_unary("is_nan", "IsNaN", lambda xp, x, a: xp.isnan(x), None, "Y = X is NaN, bool.")


def _is_inf(xp, x, a):
    inf = xp.isinf(x)
    if not a["detect_positive"]:
        inf &= x < 0
    if not a["detect_negative"]:
        inf &= x > 0
    return inf


_unary(
    "is_inf",
    "IsInf",
    _is_inf,
    None,
    "Y = X is +inf (when detect_positive) or -inf (when detect_negative), bool.",
    attrs={"detect_positive": 1, "detect_negative": 1},
)


def _extremum(name: str, onnx: str, pick, out: str) -> None:
    """Min / Max: the elementwise extremum of all inputs (broadcasting); the gradient goes to the
    inputs holding it, shared equally between ties."""

    def kernel(xp, ins, attrs):
        xs = ins["data_0"]
        y = xs[0]
        for x in xs[1:]:
            y = pick(xp, y, x)
        return {out: y}

    kernel.__doc__ = f"{out} = elementwise {out} of all inputs (broadcasting)."

    def vjp(xp, ins, outs, douts, attrs):
        xs, y, g = ins["data_0"], outs[out], douts[out]
        hits = [x == y for x in xs]
        ties = sum(h.astype(g.dtype) for h in hits)
        return {"data_0": [unbroadcast(xp, g * h / ties, x.shape) for h, x in zip(hits, xs, strict=True)]}

    register(
        OpDef(
            name,
            "light",
            ("data_0*",),
            (out,),
            kernel,
            vjp,
            onnx=onnx,
            infer_shape=lambda s, a: {out: _sum_shape(s, a)["sum"]},
        )
    )


_extremum("min", "Min", lambda xp, a, b: xp.minimum(a, b), "min")
_extremum("max", "Max", lambda xp, a, b: xp.maximum(a, b), "max")
