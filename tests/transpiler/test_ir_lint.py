"""The IR guards itself: ops change only through Block methods that bump the program's version,
and `Program.lint` names the op of each broken invariant (each checked on a hand-broken program);
`transpile` lints after every pass, naming the pass that broke the program."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import Executor
from transpiler import LintError, Op, Program, transpile
from transpiler import builder as nn
from transpiler.config import TranspileConfig
from transpiler.models import wide_deep
from transpiler.passes import pipeline
from transpiler.passes.types import Tables


def small() -> Program:
    """x -> relu -> scale: three ops, one data feed, no parameters."""
    p = Program()
    b = p.global_block()
    b.create_var("x", shape=(-1, 2))
    b.create_var("r", shape=(-1, 2))
    b.create_var("y", shape=(-1, 2))
    p.append_op("data", {}, {"Out": "x"}, {"shape": [-1, 2], "dtype": "float32"})
    p.append_op("relu", {"X": "x"}, {"Y": "r"})
    p.append_op("scale", {"X": "r"}, {"Out": "y"}, {"scale": 2.0})
    return p


def test_a_sound_program_passes():
    small().lint()


def test_duplicate_op_id():
    p = small()
    p.ops[2].id = p.ops[1].id
    with pytest.raises(LintError, match=r"'scale' \(id 1\): id 1 is also the id of op 'relu'"):
        p.lint()


def test_op_id_not_made_by_the_program():
    p = small()
    p.ops[1].id = 99
    with pytest.raises(LintError, match=r"'relu' \(id 99\): id outside \[0, 3\)"):
        p.lint()


def test_unregistered_op_type():
    p = small()
    p.ops[1].type = "relu6x"
    with pytest.raises(LintError, match="op type 'relu6x' is not registered"):
        p.lint()


def test_unknown_role():
    p = small()
    p.ops[1].attrs["op_role"] = "fwd"
    with pytest.raises(LintError, match="'relu' .*op_role 'fwd' is not one of"):
        p.lint()


def test_slot_the_op_does_not_have():
    p = small()
    p.ops[1].outputs = {"Out": ["r"]}
    with pytest.raises(LintError, match="'relu' .*slot 'Out' is not one of 'relu'"):
        p.lint()


def test_var_missing_from_block():
    p = small()
    del p.global_block().vars["r"]
    with pytest.raises(LintError, match="'relu' .*names var 'r', which block 0 does not have"):
        p.lint()


def test_read_before_defined():
    p = small()
    relu, scale = p.ops[1], p.ops[2]
    p.global_block().set_ops([p.ops[0], scale, relu])
    with pytest.raises(LintError, match=r"#1 'scale' \(id 2\): reads 'r' before"):
        p.lint()


def test_persistable_vars_need_no_definition():
    p = small()
    p.global_block().create_var("w", shape=(2, 2), persistable=True, is_parameter=True)
    p.global_block().create_var("z", shape=(-1, 2))
    p.append_op("matmul", {"A": "y", "B": "w"}, {"Y": "z"})
    p.lint()
    p.var("w").persistable = False
    with pytest.raises(LintError, match="reads 'w' before anything defines it"):
        p.lint()


def test_ops_change_only_through_block_methods_that_bump_the_version():
    p = small()
    with pytest.raises(AttributeError):
        p.ops.append(Op("relu"))  # a read-only view
    with pytest.raises(AttributeError):
        p.global_block().ops = []
    b, v = p.global_block(), p.version
    b.update_op(p.ops[2], attrs={"scale": 3.0})
    assert p.version > v
    v = p.version
    b.set_ops(list(p.ops))
    assert p.version > v


def test_executor_sees_a_change_made_through_the_block():
    """The Executor caches per (program, version): a changed attr must change the result."""
    p = small()
    exe, x = Executor(), np.array([[1.0, -2.0]], dtype=np.float32)
    (y,) = exe.run(p, {"x": x}, ["y"])
    np.testing.assert_allclose(y, [[2.0, 0.0]])
    p.global_block().update_op(p.ops[2], attrs={"scale": 5.0})
    (y,) = exe.run(p, {"x": x}, ["y"])
    np.testing.assert_allclose(y, [[5.0, 0.0]])


def test_transpile_names_the_pass_that_broke_the_program(monkeypatch):
    real = pipeline.insert_ps

    def broken(program: Program, config: TranspileConfig) -> Tables:
        out = real(program, config)
        program.ops[-1].id = program.ops[0].id
        return out

    monkeypatch.setattr(pipeline, "insert_ps", broken)
    with pytest.raises(LintError, match="after insert_ps: .* is also the id of op"):
        transpile(wide_deep(vocab=50, optimizer=nn.SGD(0.1)).main, TranspileConfig())
