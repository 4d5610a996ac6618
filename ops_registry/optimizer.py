"""Optimizer update ops, Paddle's formulas. They update Param (and state) in place.

A row-sparse Grad updates only its rows (SGD, Adagrad, lazy Adam); non-lazy Adam treats it as dense,
as Paddle does. The parameter server calls these same kernels, so server-side updates are
numerically the trainer-side ones.
"""

from __future__ import annotations

from .base import OpDef, SparseRows, register, scatter_add


def _sgd(xp, ins, attrs):
    """ParamOut = Param - lr * Grad."""
    p, g = ins["Param"], ins["Grad"]
    lr = attrs["lr"]
    if isinstance(g, SparseRows):
        scatter_add(xp, p, g.rows, (-lr * g.values).astype(p.dtype, copy=False))
    else:
        p -= (lr * g).astype(p.dtype, copy=False)
    return {"ParamOut": p}


register(OpDef("sgd", "optimizer", ("Param", "Grad"), ("ParamOut",), _sgd, attrs={"lr": 0.01}))


def _adagrad(xp, ins, attrs):
    """MomentOut = Moment + Grad^2; ParamOut = Param - lr * Grad / (sqrt(MomentOut) + epsilon)."""
    p, g, m = ins["Param"], ins["Grad"], ins["Moment"]
    lr, eps = attrs["lr"], attrs["epsilon"]
    if isinstance(g, SparseRows):
        g = g.merged(xp)
        rows, gv = g.rows, g.values
        mr = m[rows] + gv * gv
        m[rows] = mr
        p[rows] -= (lr * gv / (xp.sqrt(mr) + eps)).astype(p.dtype, copy=False)
    else:
        m += g * g
        p -= (lr * g / (xp.sqrt(m) + eps)).astype(p.dtype, copy=False)
    return {"ParamOut": p, "MomentOut": m}


register(OpDef("adagrad", "optimizer", ("Param", "Grad", "Moment"), ("ParamOut", "MomentOut"),
               _adagrad, attrs={"lr": 0.01, "epsilon": 1e-6}))


def _adam(xp, ins, attrs):
    """Paddle's Adam: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    Param -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + epsilon * sqrt(1-b2^t)); b^t *= b.
    With lazy_mode a row-sparse Grad touches only its rows. With `paddle_sparse` a row-sparse Grad
    follows Paddle's CPU SelectedRows kernel instead (`_paddle_sparse_adam`)."""
    p, g, m1, m2 = ins["Param"], ins["Grad"], ins["Moment1"], ins["Moment2"]
    b1p, b2p = ins["Beta1Pow"], ins["Beta2Pow"]
    b1, b2, eps = attrs["beta1"], attrs["beta2"], attrs["epsilon"]
    if isinstance(g, SparseRows) and attrs.get("paddle_sparse"):
        return _paddle_sparse_adam(xp, p, g, m1, m2, b1p, b2p, attrs)
    lr = attrs["lr"] * xp.sqrt(1 - b2p) / (1 - b1p)
    eps_hat = eps * xp.sqrt(1 - b2p)
    if isinstance(g, SparseRows) and attrs["lazy_mode"]:
        g = g.merged(xp)
        r = g.rows
        m1r = b1 * m1[r] + (1 - b1) * g.values
        m2r = b2 * m2[r] + (1 - b2) * g.values * g.values
        m1[r], m2[r] = m1r, m2r
        p[r] -= (lr * m1r / (xp.sqrt(m2r) + eps_hat)).astype(p.dtype, copy=False)
    else:
        if isinstance(g, SparseRows):
            g = g.to_dense(xp)
        m1 *= b1
        m1 += (1 - b1) * g
        m2 *= b2
        m2 += (1 - b2) * g * g
        p -= (lr * m1 / (xp.sqrt(m2) + eps_hat)).astype(p.dtype, copy=False)
    return {"ParamOut": p, "Moment1Out": m1, "Moment2Out": m2,
            "Beta1PowOut": b1p * b1, "Beta2PowOut": b2p * b2}


def _paddle_sparse_adam(xp, p, g: SparseRows, m1, m2, b1p, b2p, attrs):
    """Adam on a row-sparse gradient as Paddle 3.3.1's CPU kernel runs it
    (phi/kernels/selected_rows/cpu/adam_kernel.cc, used for `is_sparse=True` lookups in the legacy
    IR): Beta1Pow/Beta2Pow are advanced *before* the update reads them, so step t bias-corrects with
    b^(t+1); rows with a gradient take the Adam step with epsilon * sqrt(1-b2^(t+1)); without
    lazy_mode every other row decays its moments (m *= b1, v *= b2) and moves by
    lr_t * m / (sqrt(v) + epsilon), epsilon unscaled. A gradient with no rows changes nothing."""
    b1, b2, eps = attrs["beta1"], attrs["beta2"], attrs["epsilon"]
    if g.rows.size == 0:
        return {"ParamOut": p, "Moment1Out": m1, "Moment2Out": m2, "Beta1PowOut": b1p, "Beta2PowOut": b2p}
    b1p, b2p = b1p * b1, b2p * b2
    lr = attrs["lr"] * xp.sqrt(1 - b2p) / (1 - b1p)
    g = g.merged(xp)
    r = g.rows
    if not attrs["lazy_mode"]:
        rest = xp.ones(p.shape[0], dtype=bool)
        rest[r] = False
        m1[rest] *= b1
        m2[rest] *= b2
        p[rest] -= (lr * m1[rest] / (xp.sqrt(m2[rest]) + eps)).astype(p.dtype, copy=False)
    m1r = b1 * m1[r] + (1 - b1) * g.values
    m2r = b2 * m2[r] + (1 - b2) * g.values * g.values
    m1[r], m2[r] = m1r, m2r
    p[r] -= (lr * m1r / (xp.sqrt(m2r) + eps * xp.sqrt(1 - b2p))).astype(p.dtype, copy=False)
    return {"ParamOut": p, "Moment1Out": m1, "Moment2Out": m2, "Beta1PowOut": b1p, "Beta2PowOut": b2p}


register(OpDef("adam", "optimizer",
               ("Param", "Grad", "Moment1", "Moment2", "Beta1Pow", "Beta2Pow"),
               ("ParamOut", "Moment1Out", "Moment2Out", "Beta1PowOut", "Beta2PowOut"), _adam,
               attrs={"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": 0,
                      "paddle_sparse": 0}))
