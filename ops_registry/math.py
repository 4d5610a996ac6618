"""Arithmetic and linear algebra with ONNX semantics (multidirectional broadcasting)."""

from __future__ import annotations

from .base import OpDef, SparseRows, register, unbroadcast
from .shapes import binary, broadcast, same_as


def _binary(name, onnx, fwd, vjp, doc):
    def kernel(xp, ins, attrs):
        return {"C": fwd(xp, ins["A"], ins["B"])}

    kernel.__doc__ = doc

    def grad(xp, ins, outs, douts, attrs):
        a, b, g = ins["A"], ins["B"], douts["C"]
        ga, gb = vjp(xp, a, b, g)
        return {"A": unbroadcast(xp, ga, a.shape), "B": unbroadcast(xp, gb, b.shape)}

    register(OpDef(name, "elementwise", ("A", "B"), ("C",), kernel, grad,
                   infer_shape=binary("C"), onnx=onnx))


_binary("add", "Add", lambda xp, a, b: a + b, lambda xp, a, b, g: (g, g), "C = A + B (broadcasting).")
_binary("sub", "Sub", lambda xp, a, b: a - b, lambda xp, a, b, g: (g, -g), "C = A - B (broadcasting).")
_binary("mul", "Mul", lambda xp, a, b: a * b, lambda xp, a, b, g: (g * b, g * a),
        "C = A * B elementwise (broadcasting).")
_binary("div", "Div", lambda xp, a, b: a / b, lambda xp, a, b, g: (g / b, -g * a / (b * b)),
        "C = A / B elementwise (broadcasting).")


def _matmul(xp, ins, attrs):
    """Y = A @ B with numpy.matmul semantics (batched, 1-D promotion)."""
    return {"Y": xp.matmul(ins["A"], ins["B"])}


def _matmul_vjp(xp, ins, outs, douts, attrs):
    a, b, g = ins["A"], ins["B"], douts["Y"]
    a2 = a.reshape(1, -1) if a.ndim == 1 else a
    b2 = b.reshape(-1, 1) if b.ndim == 1 else b
    g2 = xp.expand_dims(g, -1) if b.ndim == 1 else g  # restore the dims 1-D promotion removed
    if a.ndim == 1:
        g2 = xp.expand_dims(g2, -2)
    ga = xp.matmul(g2, xp.swapaxes(b2, -1, -2))
    gb = xp.matmul(xp.swapaxes(a2, -1, -2), g2)
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


register(OpDef("matmul", "dense", ("A", "B"), ("Y",), _matmul, _matmul_vjp,
               infer_shape=_matmul_shape, onnx="MatMul"))


def _gemm(xp, ins, attrs):
    """Y = alpha * op(A) @ op(B) + beta * C, op = transpose when transA / transB (ONNX Gemm)."""
    a = ins["A"].T if attrs["transA"] else ins["A"]
    b = ins["B"].T if attrs["transB"] else ins["B"]
    y = a @ b
    if attrs["alpha"] != 1.0:
        y = y * attrs["alpha"]
    if "C" in ins:
        y = y + (ins["C"] if attrs["beta"] == 1.0 else attrs["beta"] * ins["C"])
    return {"Y": y.astype(ins["A"].dtype, copy=False)}


def _gemm_vjp(xp, ins, outs, douts, attrs):
    a, b, g = ins["A"], ins["B"], douts["Y"]
    alpha = attrs["alpha"]
    a_ = a.T if attrs["transA"] else a
    b_ = b.T if attrs["transB"] else b
    ga_ = g @ b_.T
    gb_ = a_.T @ g
    ga = ga_.T if attrs["transA"] else ga_
    gb = gb_.T if attrs["transB"] else gb_
    if alpha != 1.0:
        ga, gb = ga * alpha, gb * alpha
    out = {"A": ga, "B": gb}
    if "C" in ins:
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


register(OpDef("gemm", "dense", ("A", "B", "C?"), ("Y",), _gemm, _gemm_vjp,
               infer_shape=_gemm_shape, onnx="Gemm",
               attrs={"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}))


def _sum(xp, ins, attrs):
    """sum = elementwise sum of all inputs (broadcasting); row-sparse inputs are concatenated."""
    xs = ins["data_0"]
    sparse = [x for x in xs if isinstance(x, SparseRows)]
    if sparse and len(sparse) == len(xs):
        return {"sum": SparseRows(xp.concatenate([x.rows for x in xs]),
                                  xp.concatenate([x.values for x in xs]), xs[0].height)}
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


register(OpDef("sum", "elementwise", ("data_0*",), ("sum",), _sum, _sum_vjp,
               infer_shape=_sum_shape, onnx="Sum"))


def _scale(xp, ins, attrs):
    """Out = scale * X + bias (Paddle's scale op, bias_after_scale)."""
    x = ins["X"]
    return {"Out": (x * attrs["scale"] + attrs["bias"]).astype(x.dtype, copy=False)}


register(OpDef("scale", "elementwise", ("X",), ("Out",), _scale,
               lambda xp, i, o, d, a: {"X": d["Out"] * a["scale"]},
               infer_shape=same_as("X", "Out"), attrs={"scale": 1.0, "bias": 0.0}))
