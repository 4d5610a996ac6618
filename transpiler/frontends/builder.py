"""The builder API: author a static training program the way `paddle.static` does.

    main, startup = Program(), Program()
    with program_guard(main, startup):
        x = data("x", [-1, 13])
        y = fc(x, 1)
        ...
        SGD(lr=0.05).minimize(loss)

Layer functions append ops to the current main program and parameter-initialising ops to the
current startup program; shapes come from the registry's shape rules.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

from ops_registry import get_op
from ops_registry import optimizer as opt
from transpiler.ir import Program, Var
from transpiler.passes.backward import append_backward
from transpiler.tasks import Task, add_total_loss

_main: Program | None = None
_startup: Program | None = None
_counters: dict[str, int] = {}


@contextlib.contextmanager
def program_guard(main: Program, startup: Program | None = None) -> Iterator[None]:
    """Make `main` (and `startup`) the programs that layer functions append to."""
    global _main, _startup, _counters
    saved = _main, _startup, _counters
    _main, _startup = main, startup if startup is not None else Program()
    _counters = main.attrs.setdefault("_name_counters", {})
    try:
        yield
    finally:
        _main, _startup, _counters = saved


def default_main_program() -> Program:
    if _main is None:
        raise RuntimeError("no program: wrap builder calls in `with program_guard(main, startup):`")
    return _main


def default_startup_program() -> Program:
    default_main_program()
    return _startup


def unique_name(prefix: str) -> str:
    n = _counters.get(prefix, 0)
    _counters[prefix] = n + 1
    return f"{prefix}_{n}"


def _tmp(prefix: str, shape: Sequence[int] | None, dtype: str) -> Var:
    block = default_main_program().global_block()
    return block.create_var(f"{unique_name(prefix)}.tmp", shape=shape, dtype=dtype)


def append(
    op_type: str,
    inputs: dict[str, Any],
    attrs: dict[str, Any] | None = None,
    dtype: str | None = None,
    **out_names: str,
) -> dict[str, Var]:
    """Append one op; create its output vars with shapes from the op's shape rule. Returns them."""
    main = default_main_program()
    opdef = get_op(op_type)
    ins = {k: ([v] if isinstance(v, Var) else list(v)) for k, v in inputs.items() if v is not None}
    first = next(iter(ins.values()))[0] if ins else None
    dtype = dtype or (first.dtype if first is not None else "float32")
    full_attrs = {**opdef.attrs, **(attrs or {})}
    shapes: dict[str, Any] = {}
    if opdef.infer_shape is not None and all(v.shape is not None for vs in ins.values() for v in vs):
        in_shapes = {
            k: ([v.shape for v in vs] if opdef.is_variadic(k) else vs[0].shape) for k, vs in ins.items()
        }
        try:
            shapes = opdef.infer_shape(in_shapes, full_attrs)
        except (ValueError, IndexError) as e:
            desc = ", ".join(f"{k}={[v.name for v in vs]}:{in_shapes[k]}" for k, vs in ins.items())
            raise ValueError(f"{op_type}: shape mismatch on inputs {desc}: {e}") from None
    outs: dict[str, Var] = {}
    block = main.global_block()
    for slot in opdef.out_slots:
        name = out_names.get(slot) or f"{unique_name(op_type)}.tmp"
        shape = shapes.get(slot)
        outs[slot] = block.create_var(name, shape=shape, dtype=dtype)
    main.append_op(op_type, ins, {k: [v] for k, v in outs.items()}, attrs)
    return outs


def _param(
    prefix: str,
    suffix: str,
    shape: Sequence[int],
    dtype: str,
    init: dict[str, Any],
    is_sparse: bool = False,
    name: str | None = None,
) -> Var:
    main, startup = default_main_program(), default_startup_program()
    name = name or f"{prefix}.{suffix}"
    seed = int(main.attrs.get("random_seed", 0)) * 100003 + len(main.parameters())
    init = {"seed": seed, **init}
    kw = dict(
        shape=tuple(shape),
        dtype=dtype,
        persistable=True,
        is_parameter=True,
        initializer=init,
        is_sparse=is_sparse,
    )
    v = main.global_block().create_var(name, **kw)
    startup.global_block().create_var(name, **kw)
    startup.append_op(
        "init", {}, {"Out": [name]}, {"initializer": init, "shape": list(shape), "dtype": dtype}
    )
    return v


def create_parameter(
    shape: Sequence[int],
    dtype: str = "float32",
    name: str | None = None,
    initializer: dict[str, Any] | None = None,
    is_sparse: bool = False,
) -> Var:
    """A trainable parameter initialised in the startup program (default: Xavier uniform)."""
    prefix = name or unique_name("param")
    return _param(prefix, "w", shape, dtype, initializer or {"type": "xavier"}, is_sparse, name)


# -- layers ------------------------------------------------------------------------------
def data(name: str, shape: Sequence[int], dtype: str = "float32") -> Var:
    """A fed input; -1 marks the batch dimension. Emits a `data` op (category io)."""
    block = default_main_program().global_block()
    v = block.create_var(name, shape=tuple(shape), dtype=dtype, stop_gradient=True)
    default_main_program().append_op("data", {}, {"Out": [name]}, {"shape": list(shape), "dtype": dtype})
    return v


def embedding(
    ids: Var,
    vocab: int,
    dim: int,
    sparse: bool = True,
    name: str | None = None,
    initializer: dict[str, Any] | None = None,
    dtype: str = "float32",
) -> Var:
    """Look up rows of a [vocab, dim] table: output ids.shape + [dim]. `sparse` gives a row-sparse
    gradient (and makes the table a parameter-server sparse table when transpiled)."""
    prefix = name or unique_name("embedding")
    init = initializer or {"type": "uniform", "low": -1 / math.sqrt(dim), "high": 1 / math.sqrt(dim)}
    w = _param(prefix, "w_0", (vocab, dim), dtype, init, is_sparse=sparse)
    return append("embedding", {"W": w, "Ids": ids}, {"is_sparse": int(sparse)}, dtype=dtype)["Out"]


def fc(
    x: Var,
    size: int,
    act: str | None = None,
    name: str | None = None,
    weight_init: dict[str, Any] | None = None,
    bias_init: dict[str, Any] | None = None,
) -> Var:
    """y = act(x @ W + b), x flattened to 2-D after its first dim (Paddle's fc)."""
    prefix = name or unique_name("fc")
    if x.shape is not None and len(x.shape) > 2:
        x = reshape(x, [-1, math.prod(x.shape[1:])])
    w = _param(prefix, "w_0", (x.shape[1], size), x.dtype, weight_init or {"type": "xavier"})
    b = _param(prefix, "b_0", (size,), x.dtype, bias_init or {"type": "constant", "value": 0.0})
    y = append("gemm", {"A": x, "B": w, "C": b})["Y"]
    return activation(y, act) if act else y


linear = fc


def activation(x: Var, act: str) -> Var:
    acts = {"relu": relu, "sigmoid": sigmoid, "tanh": tanh}
    if act not in acts:
        raise ValueError(f"unknown activation {act!r}; one of {sorted(acts)}")
    return acts[act](x)


def relu(x: Var) -> Var:
    return append("relu", {"X": x})["Y"]


def sigmoid(x: Var) -> Var:
    return append("sigmoid", {"X": x})["Y"]


def tanh(x: Var) -> Var:
    return append("tanh", {"input": x})["output"]


def concat(xs: Sequence[Var], axis: int = 1) -> Var:
    return append("concat", {"inputs": list(xs)}, {"axis": axis})["concat_result"]


def reshape(x: Var, shape: Sequence[int]) -> Var:
    return append("reshape", {"data": x}, {"shape": list(shape)})["reshaped"]


def reduce_sum(x: Var, axes: Sequence[int] | None = None, keepdims: bool = False) -> Var:
    return append(
        "reduce_sum",
        {"data": x},
        {"axes": list(axes) if axes is not None else None, "keepdims": int(keepdims)},
    )["reduced"]


def reduce_mean(x: Var, axes: Sequence[int] | None = None, keepdims: bool = False) -> Var:
    return append(
        "reduce_mean",
        {"data": x},
        {"axes": list(axes) if axes is not None else None, "keepdims": int(keepdims)},
    )["reduced"]


def add(a: Var, b: Var) -> Var:
    return append("add", {"A": a, "B": b})["C"]


def sub(a: Var, b: Var) -> Var:
    return append("sub", {"A": a, "B": b})["C"]


def mul(a: Var, b: Var) -> Var:
    return append("mul", {"A": a, "B": b})["C"]


def div(a: Var, b: Var) -> Var:
    return append("div", {"A": a, "B": b})["C"]


def sigmoid_cross_entropy_with_logits(logits: Var, label: Var) -> Var:
    """Elementwise log loss on logits (reduce it with reduce_mean for a scalar loss)."""
    return append("sigmoid_cross_entropy_with_logits", {"X": logits, "Label": label})["Out"]


def bce(prob: Var, label: Var) -> Var:
    """Elementwise binary cross entropy on probabilities (logs floored at -100, as torch's BCELoss)."""
    return append("bce_loss", {"X": prob, "Label": label})["Out"]


def softmax(x: Var, axis: int = -1) -> Var:
    return append("softmax", {"input": x}, {"axis": axis})["output"]


def multi_task_loss(
    tasks: dict[str, tuple[Var, Var, Var]], weights: dict[str, float] | None = None, kind: str = "bce"
) -> Var:
    """The loss of a multi-task model: {task: (prediction, label, its mean loss)} -> the weighted sum
    of the task losses (`weights`: {task: weight}, 1.0 where not given), with the tasks recorded on
    the program (transpiler/tasks.py: each task's AUC in training and evaluation, its column in
    predict, its output in the servable export). Minimize the returned var."""
    weights = dict(weights or {})
    if extra := [k for k in weights if k not in tasks]:
        raise ValueError(f"weights name {extra}, which are not tasks; the tasks are {list(tasks)}")
    recs = [
        Task(name, pred.name, label.name, kind, loss.name, float(weights.get(name, 1.0)))
        for name, (pred, label, loss) in tasks.items()
    ]
    return default_main_program().var(add_total_loss(default_main_program(), recs))


def softmax_cross_entropy(logits: Var, label: Var, soft_label: bool = False, axis: int = -1) -> Var:
    """Per-example cross entropy of softmax(logits) against class ids (or a distribution)."""
    return append(
        "softmax_cross_entropy",
        {"Logits": logits, "Label": label},
        {"soft_label": int(soft_label), "axis": axis},
    )["Loss"]


def square_error(x: Var, y: Var) -> Var:
    return append("square_error", {"X": x, "Y": y})["Out"]


def dropout(x: Var, ratio: float = 0.5, seed: int = 0, training: bool = True) -> Var:
    return append("dropout", {"data": x}, {"ratio": ratio, "seed": seed, "training_mode": int(training)})[
        "output"
    ]


def layer_norm(x: Var, epsilon: float = 1e-5, axis: int = -1, name: str | None = None) -> Var:
    prefix = name or unique_name("layer_norm")
    dims = x.shape[axis % len(x.shape) :]
    scale = _param(prefix, "w_0", dims, x.dtype, {"type": "constant", "value": 1.0})
    bias = _param(prefix, "b_0", dims, x.dtype, {"type": "constant", "value": 0.0})
    return append("layer_norm", {"X": x, "Scale": scale, "B": bias}, {"epsilon": epsilon, "axis": axis})["Y"]


# -- optimizers --------------------------------------------------------------------------
class Optimizer:
    """`minimize(loss)` appends backward ops and one update op per parameter (op_role optimize).

    Every optimizer takes `lr_schedule` (a spec: {"type": "step" | "exponential" | "cosine" |
    "linear_warmup", ...}, see `ops_registry.optimizer.scheduled_lr`), `l2_decay` (Paddle's
    `L2Decay` coefficient) and `grad_clip_norm` (Paddle's `ClipGradByGlobalNorm`: one
    `clip_by_global_norm` op over all gradients before the updates; single-process, and sync mode on
    the parameter servers: runtime/ps/clip.py). Its state slots (`state`, from
    `ops_registry.optimizer.STATE`) become persistable vars `<param>_<slot>_0`: the parameter's
    shape, or [1] when scalar.
    """

    type = ""

    def __init__(
        self,
        lr: float,
        lr_schedule: dict[str, Any] | None = None,
        l2_decay: float = 0.0,
        grad_clip_norm: float | None = None,
    ) -> None:
        opt.check_schedule(lr_schedule)
        if grad_clip_norm is not None and not grad_clip_norm > 0:
            raise ValueError(f"grad_clip_norm must be > 0, got {grad_clip_norm}")
        self.lr, self.grad_clip_norm = lr, grad_clip_norm
        self.hyper: dict[str, Any] = {"l2_decay": float(l2_decay), "lr_schedule": lr_schedule}

    def attrs(self) -> dict[str, Any]:
        return {"lr": self.lr, **self.hyper}

    @property
    def state(self) -> tuple[opt.Slot, ...]:
        return opt.state_slots(self.type, self.attrs())

    def minimize(self, loss: Var, parameter_list: list[str] | None = None) -> list[tuple[str, str]]:
        main, startup = default_main_program(), default_startup_program()
        params_grads = append_backward(main, loss, parameter_list)
        main.attrs["loss_name"] = loss.name if isinstance(loss, Var) else loss
        main.attrs["optimizer"] = {"type": self.type, **self.attrs()}
        grads = [g for _, g in params_grads]
        if self.grad_clip_norm is not None:
            grads = [f"{g}@CLIP" for g in grads]
            for (p, _), c in zip(params_grads, grads, strict=True):
                main.global_block().create_var(c, shape=main.var(p).shape, dtype=main.var(p).dtype)
            main.append_op(
                "clip_by_global_norm",
                {"X": [g for _, g in params_grads]},
                {"Out": grads},
                {"clip_norm": float(self.grad_clip_norm), "op_role": "optimize"},
            )
        for (p, _), g in zip(params_grads, grads, strict=True):
            pv = main.var(p)
            ins, outs = {"Param": [p], "Grad": [g]}, {"ParamOut": [p]}
            for slot in self.state:
                shape = (1,) if slot.scalar else pv.shape
                name = f"{p}_{slot.name.lower()}_0"
                kw = dict(shape=shape, dtype=pv.dtype, persistable=True)
                main.global_block().create_var(name, **kw)
                startup.global_block().create_var(name, **kw)
                startup.append_op(
                    "init",
                    {},
                    {"Out": [name]},
                    {
                        "initializer": {"type": "constant", "value": opt.state_init(slot, self.attrs())},
                        "shape": list(shape),
                        "dtype": pv.dtype,
                    },
                )
                ins[slot.name], outs[slot.out] = [name], [name]
            main.append_op(self.type, ins, outs, {**self.attrs(), "op_role": "optimize"})
        return params_grads


class SGD(Optimizer):
    type = "sgd"


class Adagrad(Optimizer):
    type = "adagrad"

    def __init__(
        self,
        lr: float,
        epsilon: float = 1e-6,
        initial_accumulator_value: float = 0.0,
        lr_schedule: dict[str, Any] | None = None,
        l2_decay: float = 0.0,
        grad_clip_norm: float | None = None,
    ) -> None:
        super().__init__(lr, lr_schedule, l2_decay, grad_clip_norm)
        # kept in the op's attrs too, so a parameter server can start the accumulator the same way
        self.hyper.update(epsilon=epsilon, initial_accumulator_value=initial_accumulator_value)


class Adam(Optimizer):
    type = "adam"

    def __init__(
        self,
        lr: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        lazy_mode: bool = False,
        paddle_sparse: bool = False,
        lr_schedule: dict[str, Any] | None = None,
        l2_decay: float = 0.0,
        grad_clip_norm: float | None = None,
    ) -> None:
        super().__init__(lr, lr_schedule, l2_decay, grad_clip_norm)
        # paddle_sparse: row-sparse gradients take Paddle's CPU SelectedRows step (set by from_paddle
        # for legacy-IR is_sparse tables; see ops_registry/optimizer.py)
        self.hyper.update(
            beta1=beta1,
            beta2=beta2,
            epsilon=epsilon,
            lazy_mode=int(lazy_mode),
            paddle_sparse=int(paddle_sparse),
        )


class AdamW(Adam):
    """Adam with decoupled weight decay (Paddle's AdamW): Param -= lr * weight_decay * Param, then
    the Adam step."""

    type = "adamw"

    def __init__(self, lr: float = 0.001, weight_decay: float = 0.01, **kw: Any) -> None:
        super().__init__(lr, **kw)
        self.hyper["weight_decay"] = float(weight_decay)


OPTIMIZERS: dict[str, type[Optimizer]] = {c.type: c for c in (SGD, Adagrad, Adam, AdamW)}
