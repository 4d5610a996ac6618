"""Every differentiable op the builder emits agrees with central finite differences (float64).

Each case is tested through the real path: a small program is built with the builder, the loss
`reduce_sum(out * R)` (R a fixed random feed, so every output element gets its own weight) gets
`append_backward`, the Executor runs it, and every parameter's gradient is compared with central
differences of the loss that same program computes, element by element.
"""

from __future__ import annotations

import numpy as np
import pytest

from ops_registry import SparseRows, get_op
from runtime import Executor
from runtime.exec.executor import RunContext
from transpiler import Program, append_backward
from transpiler import builder as nn

EPS, RTOL = 1e-6, 1e-5
F64 = "float64"


def param(shape, low=-1.0, high=1.0) -> nn.Var:
    return nn.create_parameter(shape, F64, initializer={"type": "uniform", "low": low, "high": high})


class Case:
    """Builds one program: `data()` declares fed inputs, the builder function returns the output."""

    def __init__(self) -> None:
        self.feed: dict[str, np.ndarray] = {}
        self.rng = np.random.default_rng(0)

    def data(self, value) -> nn.Var:
        value = np.asarray(value)
        name = f"in{len(self.feed)}"
        self.feed[name] = value
        return nn.data(name, value.shape, str(value.dtype))


def check_gradients(build, reset_rng: bool = False) -> dict:
    """Build `build(case)`, differentiate reduce_sum(out * R), compare with central differences.

    Returns {param name: analytic gradient} (SparseRows stay sparse) for further checks.
    `reset_rng` keeps random ops (dropout) on one mask across the finite-difference runs.
    """
    main, startup, case = Program(), Program(), Case()
    with nn.program_guard(main, startup):
        out = build(case)
        assert out.shape is not None and -1 not in out.shape, f"shape rule left {out.shape}"
        weights = case.data(case.rng.uniform(0.5, 1.5, out.shape) * case.rng.choice([-1, 1], out.shape))
        loss = nn.reduce_sum(nn.mul(out, weights))
    params = [p.name for p in main.parameters()]
    grads = dict(append_backward(main, loss, params))
    exe = Executor()
    exe.run(startup)
    for p in main.parameters():  # biases, norm scales: general position, not their constant init
        if p.initializer["type"] == "constant":
            exe.scope[p.name] = case.rng.uniform(0.5, 1.5, p.shape)

    def run(program, fetch):  # a fixed step: every run draws the same random mask (dropout)
        return exe.run(program, feed=case.feed, fetch_list=fetch, ctx=RunContext(0) if reset_rng else None)

    got = dict(zip(params, run(main, [grads[p] for p in params]), strict=True))
    for name in params:
        value = exe.scope[name]
        fd = np.zeros(value.shape)
        for i in np.ndindex(*value.shape):
            orig = value[i]
            value[i] = orig + EPS
            up = run(main, [loss])[0]
            value[i] = orig - EPS
            down = run(main, [loss])[0]
            value[i] = orig
            fd[i] = (up - down) / (2 * EPS)
        g = got[name].to_dense(np) if isinstance(got[name], SparseRows) else got[name]
        assert g.shape == fd.shape and g.dtype == np.float64, (name, g.shape, g.dtype)
        err = np.abs(g - fd).max() / max(np.abs(fd).max(), 1e-8)
        assert err <= RTOL, f"{name}: gradient rel err {err:.2e} > {RTOL}\nanalytic {g}\nnumeric {fd}"
    return got


def binary(op, sa, sb, low=-1.0, high=1.0):
    return lambda c: getattr(nn, op)(param(sa), param(sb, low, high))


CASES = {
    # elementwise binaries, equal shapes and every broadcasting direction
    **{
        f"{op}-{sa}-{sb}": binary(op, sa, sb, *((0.5, 2.0) if op == "div" else ()))
        for op in ("add", "sub", "mul", "div")
        for sa, sb in (((2, 3), (2, 3)), ((2, 3), (3,)), ((3,), (2, 3)), ((2, 1, 3), (4, 1)), ((), (2, 2)))
    },
    "relu": lambda c: nn.relu(param((3, 4))),
    "sigmoid": lambda c: nn.sigmoid(param((3, 4), -4, 4)),
    "tanh": lambda c: nn.tanh(param((2, 3, 2))),
    "concat-axis1-3inputs": lambda c: nn.concat([param((2, 3)), param((2, 1)), param((2, 2))], axis=1),
    "concat-axis0": lambda c: nn.concat([param((1, 3)), param((2, 3))], axis=0),
    "concat-axis-1-3d": lambda c: nn.concat([param((2, 2, 1)), param((2, 2, 3))], axis=-1),
    "reshape": lambda c: nn.reshape(param((2, 3, 2)), [0, -1]),
    "reshape-flat": lambda c: nn.reshape(param((2, 3)), [6]),
    "reduce_sum-all": lambda c: nn.reduce_sum(param((2, 3))),
    "reduce_sum-axis1": lambda c: nn.reduce_sum(param((2, 3, 2)), axes=[1]),
    "reduce_sum-keepdims": lambda c: nn.reduce_sum(param((2, 3, 2)), axes=[0, -1], keepdims=True),
    "reduce_mean-all": lambda c: nn.reduce_mean(param((2, 3))),
    "reduce_mean-axis-1": lambda c: nn.reduce_mean(param((2, 3, 2)), axes=[-1]),
    "reduce_mean-keepdims": lambda c: nn.reduce_mean(param((4, 3)), axes=[0], keepdims=True),
    "fc": lambda c: nn.fc(c.data(c.rng.normal(size=(4, 3))), 2),
    "fc-relu-3d-input": lambda c: nn.fc(param((2, 2, 3)), 3, act="relu"),
    "sigmoid_cross_entropy": lambda c: nn.sigmoid_cross_entropy_with_logits(
        param((4, 1), -3, 3), c.data(c.rng.random((4, 1)))
    ),
    "softmax_ce-hard": lambda c: nn.softmax_cross_entropy(
        param((4, 5), -2, 2), c.data(np.array([[0], [3], [4], [3]]))
    ),
    "softmax_ce-soft": lambda c: nn.softmax_cross_entropy(
        param((4, 5), -2, 2), c.data(c.rng.dirichlet(np.ones(5), 4)), soft_label=True
    ),
    "softmax_ce-hard-axis1-3d": lambda c: nn.softmax_cross_entropy(
        param((2, 3, 2), -2, 2), c.data(np.array([[[0, 2]], [[1, 1]]])), axis=1
    ),
    "square_error": lambda c: nn.square_error(param((3, 2)), c.data(c.rng.normal(size=(3, 2)))),
    "square_error-broadcast-both-params": lambda c: nn.square_error(param((3, 2)), param((2,))),
    "layer_norm": lambda c: nn.layer_norm(param((3, 4), -2, 2)),
    "layer_norm-axis1-3d": lambda c: nn.layer_norm(param((2, 3, 2), -2, 2), axis=1),
    "dropout-eval": lambda c: nn.dropout(param((3, 4)), 0.5, training=False),
    "scale": lambda c: nn.append("scale", {"X": param((2, 3))}, {"scale": -1.5, "bias": 0.25})["Out"],
    "sum-variadic-broadcast": lambda c: nn.append(
        "sum", {"data_0": [param((2, 3)), param((3,)), param((2, 1))]}
    )["sum"],
    "sum-single": lambda c: nn.append("sum", {"data_0": [param((2, 3))]})["sum"],
}
CASES.update(
    {
        f"gemm-tA{ta}-tB{tb}-a{al}-b{be}-C{cs}": (
            lambda c, ta=ta, tb=tb, al=al, be=be, cs=cs: nn.append(
                "gemm",
                {
                    "A": param((4, 3) if ta else (3, 4)),
                    "B": param((2, 4) if tb else (4, 2)),
                    "C": param(cs) if cs else None,
                },
                {"transA": ta, "transB": tb, "alpha": al, "beta": be},
            )["Y"]
        )
        for ta, tb, al, be, cs in (
            (0, 0, 1.0, 1.0, (2,)),
            (1, 0, 0.5, 1.0, (3, 2)),
            (0, 1, 1.0, -2.0, (1, 2)),
            (1, 1, 2.0, 0.5, (3, 1)),
            (0, 0, 1.5, 1.0, None),
        )
    }
)
CASES.update(
    {
        f"matmul-{sa}-{sb}": (
            lambda c, sa=sa, sb=sb: nn.append("matmul", {"A": param(sa), "B": param(sb)})["Y"]
        )
        for sa, sb in (
            ((3, 4), (4, 2)),
            ((2, 3, 4), (4, 2)),
            ((2, 3, 4), (2, 4, 2)),
            ((2, 1, 2, 3), (3, 3, 2)),
            ((4,), (4, 2)),
            ((3, 4), (4,)),
            ((4,), (2, 4, 3)),
            ((4,), (4,)),
        )
    }
)


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_matches_finite_differences(name):
    check_gradients(CASES[name])


def test_every_builder_emitted_differentiable_op_is_covered():
    """The cases above exercise each differentiable op the builder can emit (guards this list)."""
    emitted = {
        "add",
        "sub",
        "mul",
        "div",
        "relu",
        "sigmoid",
        "tanh",
        "concat",
        "reshape",
        "reduce_sum",
        "reduce_mean",
        "gemm",
        "sigmoid_cross_entropy_with_logits",
        "softmax_cross_entropy",
        "square_error",
        "dropout",
        "layer_norm",
        "embedding",
        "sum",
        "matmul",
        "scale",
    }
    assert all(get_op(t).differentiable for t in emitted)
    covered = set()
    for build in CASES.values():
        main = Program()
        with nn.program_guard(main, Program()):
            build(Case())
        covered |= {op.type for op in main.ops}
    assert emitted - covered <= {"dropout", "embedding"}  # these two have their own tests below


@pytest.mark.parametrize("ratio", [0.3, 0.7])
def test_dropout_gradient_uses_the_forward_mask(ratio):
    def build(c):
        x = param((6, 5))
        return nn.append("dropout", {"data": x}, {"ratio": ratio, "seed": 7, "training_mode": 1})["output"]

    check_gradients(build, reset_rng=True)
    main, startup = Program(), Program()
    with nn.program_guard(main, startup):
        x = nn.data("x", [200, 50], F64)
        out = nn.append("dropout", {"data": x}, {"ratio": ratio, "seed": 7})
    xv = np.random.default_rng(1).normal(size=(200, 50))
    y, mask = Executor().run(main, feed={"x": xv}, fetch_list=[out["output"], out["mask"]])
    assert mask.dtype == bool and abs(1 - mask.mean() - ratio) < 0.02  # about `ratio` dropped
    np.testing.assert_allclose(y, np.where(mask, xv / (1 - ratio), 0.0), rtol=1e-12)


@pytest.mark.parametrize("sparse", [True, False])
def test_embedding_gradient(sparse):
    """Sparse: rows = the looked-up ids (repeats kept), never a vocab-sized array; both match FD."""
    ids = np.array([[1, 4, 1], [6, 4, 0]])

    def build(c):
        return nn.embedding(c.data(ids), vocab=8, dim=3, sparse=sparse, dtype=F64)

    (g,) = check_gradients(build).values()
    if sparse:
        assert isinstance(g, SparseRows) and g.height == 8
        assert g.rows.tolist() == ids.reshape(-1).tolist() and g.values.shape == (6, 3)
    else:
        assert isinstance(g, np.ndarray) and g.shape == (8, 3)
        assert not g[[2, 3, 5, 7]].any()  # rows never looked up get nothing


def test_shared_input_gradients_are_summed():
    """x feeds three grad contributions (tanh, both sides of mul): one `sum` op adds them."""

    def build(c):
        x = param((2, 3))
        return nn.add(nn.tanh(x), nn.mul(x, x))

    check_gradients(build)
    main = Program()
    with nn.program_guard(main, Program()):
        x = param((2, 3))
        loss = nn.reduce_sum(nn.add(nn.tanh(x), nn.mul(x, x)))
    append_backward(main, loss)
    sums = [op for op in main.ops if op.type == "sum"]
    assert len(sums) == 1 and len(sums[0].inputs["data_0"]) == 3
    assert sums[0].outputs["sum"] == [f"{x.name}@GRAD"]


def test_grad_ops_carry_role_forward_id_and_device():
    main = Program()
    with nn.program_guard(main, Program()):
        h = nn.fc(nn.data("x", [-1, 4]), 3, act="relu")
        loss = nn.reduce_mean(h)
    next(op for op in main.ops if op.type == "gemm").attrs["op_device"] = "gpu"
    n_fwd = len(main.ops)
    append_backward(main, loss)
    fwd = {op.id: op for op in main.ops[:n_fwd]}
    for op in main.ops[n_fwd:]:
        assert op.role == "backward" and op.attrs["fwd_id"] in fwd, op
        assert op.device == fwd[op.attrs["fwd_id"]].device
    assert [op.device for op in main.ops if op.type == "gemm_grad"] == ["gpu"]
    assert fwd[main.ops[n_fwd - 1].id].role == "loss"


def test_stop_gradient_and_no_grad_set_block_gradients():
    main = Program()
    with nn.program_guard(main, Program()):
        a, b, w = param((2, 2)), param((2, 2)), param((2, 2))
        frozen = nn.tanh(a)
        frozen.stop_gradient = True
        loss = nn.reduce_sum(nn.mul(nn.add(frozen, nn.tanh(b)), w))
    got = append_backward(main, loss, no_grad_set={w.name})
    assert [p for p, _ in got] == [b.name]
    assert not main.global_block().has_var(f"{a.name}@GRAD")
    assert not main.global_block().has_var(f"{w.name}@GRAD")


def test_finite_difference_check_catches_a_wrong_rule(monkeypatch):
    """The checker is not vacuous: tanh's rule off by 1% fails it."""
    opdef = get_op("tanh")
    right = opdef.vjp
    monkeypatch.setattr(opdef, "vjp", lambda *a: {k: v * 1.01 for k, v in right(*a).items()})
    with pytest.raises(AssertionError, match="gradient rel err"):
        check_gradients(CASES["tanh"])
