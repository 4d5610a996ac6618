"""`Executor.run(..., scope=, ctx=)` and the one handler table for comm / PS ops (runtime.exec.comm_ops)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import ExecutionError, Executor
from runtime.exec.comm_ops import comm_handlers
from runtime.exec.executor import RunContext
from transpiler.ir import Program


def pull_then_scale() -> Program:
    """w = pull_dense(table "w"); y = scale(w, 2); push_dense(y) (to table "w"); dropout(y)."""
    p = Program()
    b = p.global_block()
    for n in ("w", "y"):
        b.create_var(n, shape=(2, 3), dtype="float32")
    p.append_op("pull_dense", outputs={"Out": "w"}, attrs={"table": "w", "shape": [2, 3], "dtype": "float32"})
    p.append_op("scale", inputs={"X": "w"}, outputs={"Out": "y"}, attrs={"scale": 2.0})
    p.append_op("push_dense", inputs={"Grad": "y"}, attrs={"table": "w"})
    return p


class Tables:
    """A backend with the two dense PS ops: values per (step, table); pushes recorded with their ctx."""

    def __init__(self) -> None:
        self.pushed: list[tuple[int, str, np.ndarray]] = []

    def pull_dense(self, ctx, table):
        return np.full((2, 3), 10.0 * ctx.step, np.float32)

    def push_dense(self, ctx, table, grad):
        self.pushed.append((ctx.step, table, np.array(grad)))


def test_handlers_get_the_run_context_and_the_op_slots():
    tables = Tables()
    exe = Executor(handlers=comm_handlers(tables))
    (y,) = exe.run(pull_then_scale(), fetch_list=["y"], ctx=RunContext(step=3))
    np.testing.assert_array_equal(y, np.full((2, 3), 60.0))  # 2 * (10 * 3)
    assert [(s, t) for s, t, _ in tables.pushed] == [(3, "w")]
    np.testing.assert_array_equal(tables.pushed[0][2], np.full((2, 3), 60.0))


def test_the_handler_table_has_exactly_the_ops_a_backend_implements():
    assert sorted(comm_handlers(Tables())) == ["pull_dense", "push_dense"]
    p = Program()
    p.global_block().create_var("x", shape=(1,), dtype="float32")
    p.append_op("fill_constant", outputs={"Out": "x"}, attrs={"shape": [1], "value": 1.0, "dtype": "float32"})
    p.append_op("send", inputs={"X": "x"}, attrs={"tensor": "x", "dst": "gpu"})
    with pytest.raises(ExecutionError, match="'send' has no kernel and no runtime handler"):
        Executor(handlers=comm_handlers(Tables())).run(p)


def test_scope_argument_is_read_and_updated_instead_of_the_executors_own():
    p = Program()
    b = p.global_block()
    b.create_var("a", shape=(2,), dtype="float32", persistable=True)
    b.create_var("b", shape=(2,), dtype="float32", persistable=True)
    p.append_op("scale", inputs={"X": "a"}, outputs={"Out": "b"}, attrs={"scale": 3.0})
    exe = Executor()
    scope = {"a": np.array([1.0, 2.0], np.float32)}
    (got,) = exe.run(p, fetch_list=["b"], scope=scope)
    np.testing.assert_array_equal(got, [3.0, 6.0])
    np.testing.assert_array_equal(scope["b"], [3.0, 6.0])  # the persistable output went to `scope`
    assert exe.scope == {}


def test_ctx_step_seeds_random_ops_as_the_run_count_did():
    """A run with ctx step k draws the mask the k-th plain run (k = the executor's run count) draws."""
    p = Program()
    b = p.global_block()
    b.create_var("x", shape=(64,), dtype="float32")
    b.create_var("y", shape=(64,), dtype="float32")
    b.create_var("mask", shape=(64,), dtype="bool")
    p.append_op(
        "fill_constant", outputs={"Out": "x"}, attrs={"shape": [64], "value": 1.0, "dtype": "float32"}
    )
    p.append_op(
        "dropout", inputs={"data": "x"}, outputs={"output": "y", "mask": "mask"}, attrs={"ratio": 0.5}
    )
    plain = Executor()
    masks = [plain.run(p, fetch_list=["y"])[0] for _ in range(3)]
    assert not np.array_equal(masks[1], masks[2])  # the count moves the seed on
    ctx_run = Executor()
    for _ in range(5):
        (again,) = ctx_run.run(p, fetch_list=["y"], ctx=RunContext(step=2))
        np.testing.assert_array_equal(again, masks[2])
