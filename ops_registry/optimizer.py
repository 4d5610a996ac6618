"""Optimizer update ops, Paddle's formulas, and the one home of optimizer facts.

An update op updates Param (and state) in place. A row-sparse Grad updates only its rows (SGD,
Adagrad, lazy Adam); non-lazy Adam treats it as dense, as Paddle does. The parameter server calls
these same kernels, so server-side updates are numerically the trainer-side ones.

Facts kept here, read by the builder, the PS pass, the tables and the Paddle import:
- `update_attrs(type, hyper)`: an update op's attrs from its hyper-parameters, checked (the
  parameter servers' tables build their optimizer step from it).
- `STATE[type]`: the per-parameter state slots (`Slot`): name, output slot, scalar or parameter
  shaped, and the start value (a number, or the hyper-parameter that gives it).
- Rules every update op takes as attrs, applied around its kernel (`_with_rules`), in this order:
  `lr_schedule` (a spec, see `scheduled_lr`; adds the scalar `Step` state, the count of updates
  applied so far), `l2_decay` (Paddle's `L2Decay` regularizer: Grad += coeff * Param; a row-sparse
  Grad becomes dense, as Paddle's `sum` with the decay term makes it — on a parameter-server sparse
  table that is every row the server holds; rows are created undecayed) and, for `adamw`,
  `weight_decay` (decoupled: Param -= lr * weight_decay * Param before the Adam step, Paddle's
  AdamW with lr_ratio 1).
- `clip_by_global_norm`: Paddle's ClipGradByGlobalNorm over every gradient of a step, an op of its
  own before the updates. Single-process training runs the op; on the parameter servers (sync mode)
  each shard holds its clipped tables' step gradients and reports their `sum_squares`, and one
  trainer turns the shards' sums into the scale (`global_norm_scale`) the shards then apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ops_registry.base import OpDef, SparseRows, register, scatter_add


@dataclass(frozen=True)
class Slot:
    """One optimizer state slot: `name` (the op's input slot) is updated into `out`; `scalar` state
    has shape [1] per parameter, other state the parameter's shape; it starts at `init`, a number or
    the name of the hyper-parameter that gives it."""

    name: str
    out: str
    scalar: bool = False
    init: float | str = 0.0


_ADAM_STATE = (
    Slot("Moment1", "Moment1Out"),
    Slot("Moment2", "Moment2Out"),
    Slot("Beta1Pow", "Beta1PowOut", True, "beta1"),
    Slot("Beta2Pow", "Beta2PowOut", True, "beta2"),
)
STATE: dict[str, tuple[Slot, ...]] = {
    "sgd": (),
    "adagrad": (Slot("Moment", "MomentOut", False, "initial_accumulator_value"),),
    "adam": _ADAM_STATE,
    "adamw": _ADAM_STATE,
}
STEP = Slot("Step", "StepOut", True)  # updates applied so far; present when lr_schedule is set
SCHEDULES = ("step", "exponential", "cosine", "linear_warmup")


def state_slots(type: str, attrs: dict[str, Any]) -> tuple[Slot, ...]:
    """The state slots of update op `type` with hyper-parameters `attrs`."""
    if type not in STATE:
        raise ValueError(f"optimizer {type!r} is not one of {sorted(STATE)}")
    return STATE[type] + ((STEP,) if attrs.get("lr_schedule") else ())


def state_init(slot: Slot, attrs: dict[str, Any]) -> float:
    """The start value of `slot` under hyper-parameters `attrs`."""
    return float(attrs[slot.init]) if isinstance(slot.init, str) else float(slot.init)


def update_attrs(type: str, hyper: dict[str, Any]) -> dict[str, Any]:
    """The attrs of update op `type` for hyper-parameters `hyper` (`lr` and any of the op's attrs, as
    the builder's optimizers and a table spec's optimizer give them; `grad_clip_norm` is checked and
    left out): the op's defaults overridden, numbers normalised. ValueError naming what is wrong."""
    if type not in STATE:
        raise ValueError(f"optimizer {type!r} is not one of {sorted(STATE)}")
    defaults = _DEFAULTS[type]
    unknown = sorted(set(hyper) - set(defaults) - {"grad_clip_norm"})
    if unknown:
        raise ValueError(f"unknown hyper-parameters {unknown}; {type} takes {sorted(defaults)}")
    check_schedule(hyper.get("lr_schedule"))
    clip = hyper.get("grad_clip_norm")
    if clip is not None and not clip > 0:
        raise ValueError(f"grad_clip_norm must be > 0, got {clip}")
    attrs = {**defaults, **{k: v for k, v in hyper.items() if k != "grad_clip_norm"}}
    for key, kind in (
        ("l2_decay", float),
        ("weight_decay", float),
        ("lazy_mode", int),
        ("paddle_sparse", int),
    ):
        if key in attrs:
            attrs[key] = kind(attrs[key])
    return attrs


def check_schedule(spec: dict[str, Any] | None) -> None:
    """ValueError naming what is wrong with an `lr_schedule` spec (None: no schedule)."""
    if spec is None:
        return
    need = {
        "step": ("step_size", "gamma"),
        "exponential": ("gamma",),
        "cosine": ("T_max",),
        "linear_warmup": ("warmup_steps", "start_lr", "end_lr"),
    }
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in need:
        raise ValueError(f"lr_schedule {spec!r}: 'type' must be one of {list(need)}")
    missing = [k for k in need[kind] if k not in spec]
    if missing:
        raise ValueError(f"lr_schedule {spec!r}: a {kind} schedule needs {missing}")
    for k in ("step_size", "T_max", "warmup_steps"):
        if k in spec and (not isinstance(spec[k], int) or spec[k] < 1):
            raise ValueError(f"lr_schedule {spec!r}: {k} must be a positive int")
    if kind == "linear_warmup":
        check_schedule(spec.get("then"))


def scheduled_lr(lr: float, spec: dict[str, Any] | None, step: int) -> float:
    """The learning rate of update `step` (0 = the first) under `spec`, Paddle's schedulers stepped
    once per update (`paddle.optimizer.lr`, closed forms):
    - step: lr * gamma ** (step // step_size)                         (StepDecay)
    - exponential: lr * gamma ** step                                 (ExponentialDecay)
    - cosine: eta_min + (lr - eta_min) * (1 + cos(pi * step / T_max)) / 2   (CosineAnnealingDecay)
    - linear_warmup: start_lr + (end_lr - start_lr) * step / warmup_steps while step < warmup_steps,
      then lr, or the `then` schedule at step - warmup_steps           (LinearWarmup)
    """
    if not spec:
        return lr
    kind = spec["type"]
    if kind == "step":
        return lr * spec["gamma"] ** (step // spec["step_size"])
    if kind == "exponential":
        return lr * spec["gamma"] ** step
    if kind == "cosine":
        eta = spec.get("eta_min", 0.0)
        return eta + (lr - eta) * (1 + math.cos(math.pi * step / spec["T_max"])) / 2
    if kind == "linear_warmup":
        w = spec["warmup_steps"]
        if step < w:
            return spec["start_lr"] + (spec["end_lr"] - spec["start_lr"]) * step / w
        return scheduled_lr(lr, spec.get("then"), step - w)
    raise ValueError(f"lr_schedule type {kind!r} is not one of {SCHEDULES}")


def _with_rules(update):
    """`update` with the rules every optimizer takes (see the module docstring)."""

    def kernel(xp, ins, attrs):
        extra = {}
        if attrs.get("lr_schedule"):
            step = ins.get("Step")
            if step is None:
                raise ValueError("an update with lr_schedule needs its Step state input")
            lr = scheduled_lr(attrs["lr"], attrs["lr_schedule"], int(step.reshape(-1)[0]))
            # in the parameter's dtype, as Paddle's kernels read the LR
            attrs = {**attrs, "lr": float(ins["Param"].dtype.type(lr))}
            extra["StepOut"] = step + 1
        coeff = attrs.get("l2_decay") or 0.0
        if coeff:
            p, g = ins["Param"], ins["Grad"]
            g = g.to_dense(xp) if isinstance(g, SparseRows) else g
            ins = {**ins, "Grad": (g + coeff * p).astype(p.dtype, copy=False)}
        return {**update(xp, ins, attrs), **extra}

    kernel.__doc__ = update.__doc__
    return kernel


_DEFAULTS: dict[str, dict[str, Any]] = {}  # update op type -> its attrs' defaults (`_register`)


def _register(type: str, update, defaults: dict[str, Any]) -> None:
    slots = STATE[type]
    _DEFAULTS[type] = {**defaults, "l2_decay": 0.0, "lr_schedule": None}
    register(
        OpDef(
            type,
            "optimizer",
            ("Param", "Grad", *(s.name for s in slots), "Step?"),
            ("ParamOut", *(s.out for s in slots), "StepOut?"),
            _with_rules(update),
            attrs=dict(_DEFAULTS[type]),
        )
    )


def _sgd(xp, ins, attrs):
    """ParamOut = Param - lr * Grad."""
    p, g = ins["Param"], ins["Grad"]
    lr = attrs["lr"]
    if isinstance(g, SparseRows):
        scatter_add(xp, p, g.rows, (-lr * g.values).astype(p.dtype, copy=False), unique=g.unique)
    else:
        p -= (lr * g).astype(p.dtype, copy=False)
    return {"ParamOut": p}


_register("sgd", _sgd, {"lr": 0.01})


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


_register("adagrad", _adagrad, {"lr": 0.01, "epsilon": 1e-6, "initial_accumulator_value": 0.0})


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
    return {
        "ParamOut": p,
        "Moment1Out": m1,
        "Moment2Out": m2,
        "Beta1PowOut": b1p * b1,
        "Beta2PowOut": b2p * b2,
    }


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
    if attrs["lazy_mode"]:
        m1r = b1 * m1[r] + (1 - b1) * g.values
        m2r = b2 * m2[r] + (1 - b2) * g.values * g.values
        pr = p[r]
    else:  # every row decays and moves; the gradient rows are then redone from their old Param
        pr = p[r]
        m1 *= b1
        m2 *= b2
        p -= (lr * m1 / (xp.sqrt(m2) + eps)).astype(p.dtype, copy=False)
        m1r = m1[r] + (1 - b1) * g.values
        m2r = m2[r] + (1 - b2) * g.values * g.values
    m1[r], m2[r] = m1r, m2r
    p[r] = pr - (lr * m1r / (xp.sqrt(m2r) + eps * xp.sqrt(1 - b2p))).astype(p.dtype, copy=False)
    return {"ParamOut": p, "Moment1Out": m1, "Moment2Out": m2, "Beta1PowOut": b1p, "Beta2PowOut": b2p}


ADAM_DEFAULTS = {
    "lr": 0.001,
    "beta1": 0.9,
    "beta2": 0.999,
    "epsilon": 1e-8,
    "lazy_mode": 0,
    "paddle_sparse": 0,
}
_register("adam", _adam, ADAM_DEFAULTS)


def _adamw(xp, ins, attrs):
    """Paddle's AdamW (lr_ratio 1): Param -= lr * weight_decay * Param over the whole parameter
    (for a row-sparse Grad too, lazy or not, as Paddle's SelectedRows AdamW does), then the Adam
    step on the decayed Param."""
    p, wd = ins["Param"], attrs["weight_decay"]
    if wd:
        p -= (attrs["lr"] * wd * p).astype(p.dtype, copy=False)
    return _adam(xp, ins, attrs)


_register("adamw", _adamw, {**ADAM_DEFAULTS, "weight_decay": 0.01})


def sum_squares(xp, g: Any) -> float:
    """The squared L2 norm of one gradient (a row-sparse one's rows merged first), summed in the
    gradient's dtype as Paddle does."""
    if isinstance(g, SparseRows):
        g = g.merged(xp).values
    return float(xp.sum(xp.square(g)))


def global_norm_scale(total: float, clip_norm: float, dtype: Any) -> Any:
    """ClipGradByGlobalNorm's scale for gradients whose squared norms sum to `total`:
    clip_norm / max(sqrt(total), clip_norm), in `dtype` (the gradients')."""
    dtype = np.dtype(dtype)
    return dtype.type(clip_norm) / max(dtype.type(math.sqrt(total)), dtype.type(clip_norm))


def _clip_by_global_norm(xp, ins, attrs):
    """Paddle's ClipGradByGlobalNorm: norm = sqrt(sum of every gradient's squared L2 norm) (a
    row-sparse gradient's rows merged first); every gradient is scaled by
    clip_norm / max(norm, clip_norm). The scaled gradients keep their form (dense or row-sparse)."""
    merged = [g.merged(xp) if isinstance(g, SparseRows) else g for g in ins["X"]]
    dtype = (merged[0].values if isinstance(merged[0], SparseRows) else merged[0]).dtype
    scale = global_norm_scale(sum(sum_squares(xp, g) for g in merged), attrs["clip_norm"], dtype)
    out = [
        SparseRows(g.rows, (g.values * scale).astype(dtype, copy=False), g.height, g.unique)
        if isinstance(g, SparseRows)
        else (g * scale).astype(g.dtype, copy=False)
        for g in merged
    ]
    return {"Out": out}


register(
    OpDef(
        "clip_by_global_norm", "optimizer", ("X*",), ("Out*",), _clip_by_global_norm, attrs={"clip_norm": 1.0}
    )
)
