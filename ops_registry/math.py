"""Arithmetic and linear algebra with ONNX semantics (multidirectional broadcasting)."""

from __future__ import annotations

import string
from collections import Counter

from ops_registry.base import OpDef, SparseRows, register, static_arg, unbroadcast
from ops_registry.nn import _unary
from ops_registry.parallel import matmul as _pmm  # (2-D numpy products over the kernel threads)
from ops_registry.shapes import binary, broadcast, same_as


def _binary(name, onnx, fwd, vjp, doc):
    """Register A, B -> C with broadcasting; `vjp(xp, a, b, g)` -> (dA, dB), None when not
    differentiable (comparisons)."""

    def kernel(xp, ins, attrs):
        return {"C": fwd(xp, ins["A"], ins["B"])}

    kernel.__doc__ = doc

    def grad(xp, ins, outs, douts, attrs):
        a, b, g = ins["A"], ins["B"], douts["C"]
        ga, gb = vjp(xp, a, b, g)
        return {"A": unbroadcast(xp, ga, a.shape), "B": unbroadcast(xp, gb, b.shape)}

    register(
        OpDef(
            name,
            "light",
            ("A", "B"),
            ("C",),
            kernel,
            grad if vjp else None,
            infer_shape=binary("C"),
            onnx=onnx,
        )
    )


def _div(xp, a, b):
    """True division for floats; integer division truncates toward zero, as ONNX (C) does."""
    if a.dtype.kind in "iu":
        q = xp.abs(a) // xp.abs(b)
        return xp.where((a < 0) != (b < 0), -q, q).astype(a.dtype, copy=False)
    return a / b


_binary("add", "Add", lambda xp, a, b: a + b, lambda xp, a, b, g: (g, g), "C = A + B (broadcasting).")
_binary("sub", "Sub", lambda xp, a, b: a - b, lambda xp, a, b, g: (g, -g), "C = A - B (broadcasting).")
_binary(
    "mul",
    "Mul",
    lambda xp, a, b: a * b,
    lambda xp, a, b, g: (g * b, g * a),
    "C = A * B elementwise (broadcasting).",
)
_binary(
    "div",
    "Div",
    _div,
    lambda xp, a, b, g: (g / b, -g * a / (b * b)),
    "C = A / B elementwise (broadcasting; integers truncate toward zero).",
)
_binary("equal", "Equal", lambda xp, a, b: a == b, None, "C = (A == B), bool (broadcasting).")
_binary("less", "Less", lambda xp, a, b: a < b, None, "C = (A < B), bool (broadcasting).")
_binary("greater", "Greater", lambda xp, a, b: a > b, None, "C = (A > B), bool (broadcasting).")

_unary("neg", "Neg", lambda xp, x, a: -x, lambda xp, x, y, g, a: -g, "Y = -X.")
_unary("abs", "Abs", lambda xp, x, a: xp.abs(x), lambda xp, x, y, g, a: g * xp.sign(x), "Y = |X|.")
_unary("sqrt", "Sqrt", lambda xp, x, a: xp.sqrt(x), lambda xp, x, y, g, a: g / (2 * y), "Y = sqrt(X).")
_unary(
    "exp",
    "Exp",
    lambda xp, x, a: xp.exp(x),
    lambda xp, x, y, g, a: g * y,
    "output = exp(input).",
    slots=("input", "output"),
)
_unary(
    "log",
    "Log",
    lambda xp, x, a: xp.log(x),
    lambda xp, x, y, g, a: g / x,
    "output = log(input).",
    slots=("input", "output"),
)


def _pow(xp, ins, attrs):
    """Z = X ** Y (broadcasting), in X's dtype (ONNX Pow: the exponent may have another type)."""
    x, y = ins["X"], ins["Y"]
    if x.dtype.kind in "iu" and y.dtype.kind in "iu":
        return {"Z": xp.power(x, y.astype(x.dtype))}
    return {"Z": xp.power(x.astype("float64") if x.dtype.kind in "iu" else x, y).astype(x.dtype)}


def _pow_vjp(xp, ins, outs, douts, attrs):
    """dX = g * Y * X^(Y-1); dY = g * Z * log X where X > 0 (0 elsewhere: real pow has no slope)."""
    x, y, z, g = ins["X"], ins["Y"], outs["Z"], douts["Z"]
    gx = g * y * xp.power(x, y - 1)
    gy = g * z * xp.log(xp.where(x > 0, x, 1))
    return {
        "X": unbroadcast(xp, gx, x.shape).astype(x.dtype),
        "Y": unbroadcast(xp, gy, y.shape).astype(y.dtype),
    }


register(
    OpDef(
        "pow",
        "light",
        ("X", "Y"),
        ("Z",),
        _pow,
        _pow_vjp,
        onnx="Pow",
        infer_shape=lambda s, a: {"Z": broadcast(s["X"], s["Y"])},
    )
)


def _clip(xp, ins, attrs):
    """output = min(max(input, min), max); an absent bound does not clip (ONNX Clip)."""
    x = ins["input"]
    lo, hi = static_arg(ins, attrs, "min"), static_arg(ins, attrs, "max")
    if lo is not None:
        x = xp.maximum(x, xp.asarray(lo, dtype=x.dtype))
    if hi is not None:
        x = xp.minimum(x, xp.asarray(hi, dtype=x.dtype))
    return {"output": x}


def _clip_vjp(xp, ins, outs, douts, attrs):
    x = ins["input"]
    lo, hi = static_arg(ins, attrs, "min"), static_arg(ins, attrs, "max")
    inside = xp.ones(x.shape, dtype=bool)
    if lo is not None:
        inside &= x >= lo
    if hi is not None:
        inside &= x <= hi
    return {"input": douts["output"] * inside}


register(
    OpDef(
        "clip",
        "light",
        ("input", "min?", "max?"),
        ("output",),
        _clip,
        _clip_vjp,
        no_grad=("min", "max"),
        onnx="Clip",
        infer_shape=same_as("input", "output"),
        attrs={"min": None, "max": None},
    )
)


def _where(xp, ins, attrs):
    """output = X where condition else Y (broadcasting all three)."""
    return {"output": xp.where(ins["condition"], ins["X"], ins["Y"])}


def _where_vjp(xp, ins, outs, douts, attrs):
    c, g = ins["condition"], douts["output"]
    zero = xp.zeros((), dtype=g.dtype)
    return {
        "X": unbroadcast(xp, xp.where(c, g, zero), ins["X"].shape),
        "Y": unbroadcast(xp, xp.where(c, zero, g), ins["Y"].shape),
    }


register(
    OpDef(
        "where",
        "light",
        ("condition", "X", "Y"),
        ("output",),
        _where,
        _where_vjp,
        no_grad=("condition",),
        onnx="Where",
        infer_shape=lambda s, a: {"output": broadcast(s["condition"], broadcast(s["X"], s["Y"]))},
    )
)


def _matmul(xp, ins, attrs):
    """Y = A @ B with numpy.matmul semantics (batched, 1-D promotion)."""
    return {"Y": _pmm(ins["A"], ins["B"])}


def _matmul_vjp(xp, ins, outs, douts, attrs):
    a, b, g = ins["A"], ins["B"], douts["Y"]
    a2 = a.reshape(1, -1) if a.ndim == 1 else a
    b2 = b.reshape(-1, 1) if b.ndim == 1 else b
    g2 = xp.expand_dims(g, -1) if b.ndim == 1 else g  # restore the dims 1-D promotion removed
    if a.ndim == 1:
        g2 = xp.expand_dims(g2, -2)
    ga = _pmm(g2, xp.swapaxes(b2, -1, -2))
    gb = _pmm(xp.swapaxes(a2, -1, -2), g2)
    ga = unbroadcast(xp, ga, a2.shape).reshape(a.shape)
    gb = unbroadcast(xp, gb, b2.shape).reshape(b.shape)
    return {"A": ga, "B": gb}


def _same_dim(what: str, x: int, y: int) -> None:
    if x != y and x != -1 and y != -1:
        raise ValueError(f"{what} differ: {x} vs {y}")


def _matmul_shape(s, attrs):
    a, b = tuple(s["A"]), tuple(s["B"])
    a2 = (1, *a) if len(a) == 1 else a  # numpy.matmul's 1-D promotion
    b2 = (*b, 1) if len(b) == 1 else b
    _same_dim("contracted dims (last of A, second-to-last of B)", a2[-1], b2[-2])
    y = broadcast(a2[:-2], b2[:-2]) + (a2[-2], b2[-1])
    if len(a) == 1:
        y = y[:-2] + y[-1:]
    if len(b) == 1:
        y = y[:-1]
    return {"Y": y}


register(
    OpDef(
        "matmul", "dense", ("A", "B"), ("Y",), _matmul, _matmul_vjp, infer_shape=_matmul_shape, onnx="MatMul"
    )
)


def _gemm(xp, ins, attrs):
    """Y = alpha * op(A) @ op(B) + beta * C, op = transpose when transA / transB (ONNX Gemm)."""
    a = ins["A"].T if attrs["transA"] else ins["A"]
    b = ins["B"].T if attrs["transB"] else ins["B"]
    y = _pmm(a, b)
    if attrs["alpha"] != 1.0:
        y = y * attrs["alpha"]
    if "C" in ins:
        y = y + (ins["C"] if attrs["beta"] == 1.0 else attrs["beta"] * ins["C"])
    return {"Y": y.astype(ins["A"].dtype, copy=False)}


def _gemm_vjp(xp, ins, outs, douts, attrs):
    """The gradients of A, B (and C); with attr `grads` (a list of slots) only those: a runtime may
    split gemm_grad into its input gradient and its weight gradients (transpiler/passes/segment_order.py)."""
    a, b, g = ins["A"], ins["B"], douts["Y"]
    alpha, want = attrs["alpha"], attrs.get("grads") or ("A", "B", "C")
    out = {}
    if "A" in want:
        b_ = b.T if attrs["transB"] else b
        ga_ = _pmm(g, b_.T)
        ga = ga_.T if attrs["transA"] else ga_
        out["A"] = ga * alpha if alpha != 1.0 else ga
    if "B" in want:
        a_ = a.T if attrs["transA"] else a
        gb_ = _pmm(a_.T, g)
        gb = gb_.T if attrs["transB"] else gb_
        out["B"] = gb * alpha if alpha != 1.0 else gb
    if "C" in ins and "C" in want:
        out["C"] = unbroadcast(xp, g * attrs["beta"] if attrs["beta"] != 1.0 else g, ins["C"].shape)
    return out


def _gemm_shape(s, attrs):
    a, b = s["A"], s["B"]
    if len(a) != 2 or len(b) != 2:
        raise ValueError(f"A and B must be 2-D, got {list(a)} and {list(b)}")
    (m, ka), (kb, n) = a[::-1] if attrs.get("transA") else a, b[::-1] if attrs.get("transB") else b
    _same_dim("contracted dims of op(A) and op(B)", ka, kb)
    if "C" in s and broadcast(s["C"], (m, n)) != (m, n):
        raise ValueError(f"C {list(s['C'])} does not broadcast to the output {[m, n]}")
    return {"Y": (m, n)}


register(
    OpDef(
        "gemm",
        "dense",
        ("A", "B", "C?"),
        ("Y",),
        _gemm,
        _gemm_vjp,
        infer_shape=_gemm_shape,
        onnx="Gemm",
        attrs={"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0},
    )
)


def _sum(xp, ins, attrs):
    """sum = elementwise sum of all inputs (broadcasting); row-sparse inputs are concatenated."""
    xs = ins["data_0"]
    sparse = [x for x in xs if isinstance(x, SparseRows)]
    if sparse and len(sparse) == len(xs):
        return {
            "sum": SparseRows(
                xp.concatenate([x.rows for x in xs]), xp.concatenate([x.values for x in xs]), xs[0].height
            )
        }
    dense = [x.to_dense(xp) if isinstance(x, SparseRows) else x for x in xs]
    out = dense[0]
    for x in dense[1:]:
        out = out + x
    return {"sum": out}


def _sum_vjp(xp, ins, outs, douts, attrs):
    g = douts["sum"]
    return {"data_0": [unbroadcast(xp, g, x.shape) for x in ins["data_0"]]}


def _sum_shape(s, attrs):
    out = ()
    for x in s["data_0"]:
        out = broadcast(out, x)
    return {"sum": out}


register(OpDef("sum", "light", ("data_0*",), ("sum",), _sum, _sum_vjp, infer_shape=_sum_shape, onnx="Sum"))


def _mean(xp, ins, attrs):
    """mean = elementwise mean of all inputs (broadcasting)."""
    xs = ins["data_0"]
    return {"mean": (_sum(xp, ins, attrs)["sum"] / len(xs)).astype(xs[0].dtype, copy=False)}


def _mean_vjp(xp, ins, outs, douts, attrs):
    g = douts["mean"] / len(ins["data_0"])
    return {"data_0": [unbroadcast(xp, g, x.shape) for x in ins["data_0"]]}


register(
    OpDef(
        "mean",
        "light",
        ("data_0*",),
        ("mean",),
        _mean,
        _mean_vjp,
        infer_shape=lambda s, a: {"mean": _sum_shape(s, a)["sum"]},
        onnx="Mean",
    )
)


def einsum_subscripts(equation: str, shapes: list[tuple[int, ...]]) -> tuple[list[str], str]:
    """Explicit per-operand subscripts and output subscript of an einsum `equation`: "..." replaced
    by letters (right-aligned, numpy broadcasting), an implicit output made explicit."""
    eq = equation.replace(" ", "")
    lhs, rhs = eq.split("->") if "->" in eq else (eq, None)
    ins = lhs.split(",")
    free = [c for c in string.ascii_letters if c not in eq]
    n_ell = max((len(sh) - len(s) + 3 for s, sh in zip(ins, shapes, strict=True) if "..." in s), default=0)
    ell = "".join(free[:n_ell])
    subs = [
        s.replace("...", ell[n_ell - (len(sh) - len(s) + 3) :]) if "..." in s else s
        for s, sh in zip(ins, shapes, strict=True)
    ]
    if rhs is None:  # numpy's implicit mode: broadcast dims, then letters seen once, sorted
        counts = Counter(lhs.replace(".", "").replace(",", ""))
        rhs = ell + "".join(sorted(c for c, k in counts.items() if k == 1))
    return subs, rhs.replace("...", ell)


def _einsum(xp, ins, attrs):
    """Output = einsum(equation, *Inputs) (numpy semantics: implicit output, "..." broadcasting)."""
    xs = ins["Inputs"]
    return {"Output": xp.asarray(xp.einsum(attrs["equation"], *xs)).astype(xs[0].dtype, copy=False)}


def _einsum_vjp(xp, ins, outs, douts, attrs):
    """dInput_i = einsum(output subscripts and the other operands' -> operand i's), broadcast over
    the letters only operand i has (they were summed away)."""
    xs, g = ins["Inputs"], douts["Output"]
    subs, out = einsum_subscripts(attrs["equation"], [x.shape for x in xs])
    grads = []
    for i, (s, x) in enumerate(zip(subs, xs, strict=True)):
        if len(set(s)) != len(s):
            raise NotImplementedError(
                f"einsum {attrs['equation']!r}: no gradient for the repeated "
                f"subscript (diagonal) in operand {i} {s!r}"
            )
        others = [(subs[j], xs[j]) for j in range(len(xs)) if j != i]
        seen = set(out).union(*(set(sj) for sj, _ in others))
        keep = "".join(c for c in s if c in seen)
        spec = ",".join([out] + [sj for sj, _ in others]) + "->" + keep
        gi = xp.einsum(spec, g, *[xj for _, xj in others])
        gi = gi.reshape([d if c in keep else 1 for c, d in zip(s, x.shape, strict=True)])
        grads.append(xp.broadcast_to(gi, x.shape).astype(x.dtype))
    return {"Inputs": grads}


register(
    OpDef(
        "einsum",
        "dense",
        ("Inputs*",),
        ("Output",),
        _einsum,
        _einsum_vjp,
        onnx="Einsum",
        attrs={"equation": ""},
    )
)


def _scale(xp, ins, attrs):
    """Out = scale * X + bias (Paddle's scale op, bias_after_scale)."""
    x = ins["X"]
    return {"Out": (x * attrs["scale"] + attrs["bias"]).astype(x.dtype, copy=False)}


register(
    OpDef(
        "scale",
        "light",
        ("X",),
        ("Out",),
        _scale,
        lambda xp, i, o, d, a: {"X": d["Out"] * a["scale"]},
        infer_shape=same_as("X", "Out"),
        attrs={"scale": 1.0, "bias": 0.0},
    )
)
