"""Errors name the variable / op and say what was expected."""

from __future__ import annotations

import numpy as np
import pytest

from ops_registry import UnknownOpError, get_op
from runtime import ExecutionError, Executor, MissingFeedError
from runtime.data import SyntheticCTR
from transpiler import Program, append_backward
from transpiler import builder as nn
from transpiler.models import wide_deep


@pytest.fixture(scope="module")
def trained():
    """A W&D with initialised parameters and one good batch."""
    model = wide_deep(vocab=100, hidden=(8,), optimizer=nn.SGD(0.05))
    exe = Executor()
    exe.run(model.startup)
    return model, exe, SyntheticCTR(vocab=100).batch(0, 16)


# -- missing / malformed feeds ---------------------------------------------------------------
def test_missing_feed_names_the_variable_and_what_was_fed(trained):
    model, exe, batch = trained
    with pytest.raises(MissingFeedError) as info:
        exe.run(model.main, feed={k: v for k, v in batch.items() if k != "label"})
    msg = str(info.value)
    assert "missing feed for data variable 'label'" in msg
    assert "fed: ['dense', 'sparse']" in msg
    assert isinstance(info.value, KeyError)


def test_feed_of_the_wrong_shape_or_dtype_names_it_and_the_expectation(trained):
    model, exe, batch = trained
    with pytest.raises(ValueError, match=r"feed 'dense' has shape \[16, 12\], expected \[-1, 13\]"):
        exe.run(model.main, feed={**batch, "dense": batch["dense"][:, :12]})
    with pytest.raises(TypeError, match="feed 'sparse' has dtype float32, expected int64"):
        exe.run(model.main, feed={**batch, "sparse": batch["sparse"].astype(np.float32)})


# -- unknown op types ------------------------------------------------------------------------
def _check_unknown(msg: str, where: str) -> None:
    assert "unknown op type 'fancy_attention'" in msg and where in msg
    supported = msg.split("supported op types: ")[1].split(", ")
    assert {"gemm", "relu", "embedding", "sgd"} <= set(supported)
    assert not any(s.endswith("_grad") for s in supported)


def test_unknown_op_type_at_run_time_names_it_where_and_the_supported_ops(trained):
    model, exe, batch = trained
    program = Program.from_json(model.main.to_json())
    op = program.append_op("fancy_attention", {"X": "dense"}, {"Y": "att"}, index=3)
    with pytest.raises(UnknownOpError) as info:
        exe.run(program, feed=batch)
    _check_unknown(str(info.value), f"op #3 (id {op.id})")


def test_unknown_op_type_from_the_builder_and_the_backward_pass():
    main = Program()
    with nn.program_guard(main, Program()):
        x = nn.data("x", [-1, 4])
        with pytest.raises(UnknownOpError) as info:
            nn.append("fancy_attention", {"X": x})
    _check_unknown(str(info.value), "")
    op = main.append_op("fancy_attention", {"X": "x"}, {"Y": "y"})
    main.global_block().create_var("y", shape=(-1, 4))
    with pytest.raises(UnknownOpError) as info:
        append_backward(main, "y")
    _check_unknown(str(info.value), f"op id {op.id}")


def test_get_op_reports_where_an_op_came_from():
    with pytest.raises(UnknownOpError) as info:
        get_op("fancy_attention", where="ONNX node 'attn_3'")
    _check_unknown(str(info.value), "(from ONNX node 'attn_3')")


# -- shape mismatches at build time (shape rules) ----------------------------------------------
@pytest.mark.parametrize(
    "build, expected",
    [
        (
            lambda a, b, c: nn.add(a, b),
            r"add: shape mismatch on inputs A=\['a'\]:\(-1, 3\), B=\['b'\]:\(-1, 4\)"
            r".*do not broadcast",
        ),
        (
            lambda a, b, c: nn.append("gemm", {"A": a, "B": c}),
            r"gemm: shape mismatch on inputs A=\['a'\]:"
            r"\(-1, 3\), B=\['c'\]:\(4, 2\).*3 vs 4",
        ),
        (
            lambda a, b, c: nn.append("matmul", {"A": a, "B": c}),
            r"matmul: shape mismatch on inputs A=\['a'\]:\(-1, 3\), B=\['c'\]:\(4, 2\).*contracted.*3 vs 4",
        ),
        (
            lambda a, b, c: nn.concat([a, b], axis=0),
            r"concat: shape mismatch on inputs inputs=\['a', 'b'\]:"
            r".*input 1 has shape \[-1, 4\], expected \[-1, 3\] "
            r"except on axis 0",
        ),
        (lambda a, b, c: nn.square_error(a, c), r"square_error: shape mismatch .* do not broadcast"),
    ],
)
def test_shape_mismatch_at_build_time_names_op_inputs_and_shapes(build, expected):
    main = Program()
    with nn.program_guard(main, Program()):
        a, b = nn.data("a", [-1, 3]), nn.data("b", [-1, 4])
        c = nn.create_parameter([4, 2], name="c")
        n_ops = len(main.ops)
        with pytest.raises(ValueError, match=expected):
            build(a, b, c)
    assert len(main.ops) == n_ops  # nothing half-appended


def test_fc_on_mismatched_features_fails_at_its_gemm():
    main = Program()
    with nn.program_guard(main, Program()):
        h = nn.fc(nn.data("x", [-1, 5]), 3)
        w = nn.create_parameter([4, 2], name="w")
        with pytest.raises(ValueError, match=r"gemm: shape mismatch.*\(-1, 3\).*\(4, 2\).*3 vs 4"):
            nn.append("gemm", {"A": h, "B": w})


# -- shape mismatches at run time (executor) ------------------------------------------------------
def test_kernel_failure_at_run_time_names_op_inputs_and_shapes():
    """A program with undeclared shapes (as an import may give) fails in the kernel: the error
    names the op, each input var with its runtime shape, and numpy's reason."""
    main = Program()
    block = main.global_block()
    for name in ("a", "b"):
        block.create_var(name, shape=None)
        main.append_op("data", {}, {"Out": name}, {"shape": [-1, -1]})
    block.create_var("y")
    op = main.append_op("matmul", {"A": "a", "B": "b"}, {"Y": "y"})
    with pytest.raises(ExecutionError) as info:
        Executor().run(main, feed={"a": np.ones((2, 3)), "b": np.ones((4, 5))}, fetch_list=["y"])
    msg = str(info.value)
    assert f"op 'matmul' (id {op.id}) failed on inputs A=a:[2, 3], B=b:[4, 5]" in msg
    assert "mismatch in its core dimension" in msg


def test_wrong_shaped_parameter_is_caught_before_it_broadcasts(trained):
    """fc_1.b_0 of shape [8] instead of [1] would broadcast [N, 1] + [8] -> [N, 8] silently and
    train garbage; the executor checks every output against its declared shape."""
    model, exe, batch = trained
    scope = {k: v.copy() for k, v in exe.scope.items()}
    scope["fc_1.b_0"] = np.zeros(8, np.float32)
    with pytest.raises(ExecutionError) as info:
        Executor().run(model.main, feed=batch, scope=scope)
    msg = str(info.value)
    assert "op 'gemm'" in msg and "made 'gemm_1.tmp' with shape [16, 8]" in msg
    assert "declares [-1, 1]" in msg and "C=fc_1.b_0:[8]" in msg


def test_program_params_of_the_wrong_shape_are_rejected():
    main = Program()
    with nn.program_guard(main, Program()):
        x = nn.data("x", [-1, 3])
        y = nn.fc(x, 2)
    main.params = {"fc_0.w_0": np.zeros((3, 5), np.float32), "fc_0.b_0": np.zeros(2, np.float32)}
    with pytest.raises(ValueError, match=r"'fc_0.w_0' .*\[3, 5\].* declares \[3, 2\]"):
        Executor().run(main, feed={"x": np.ones((1, 3), np.float32)}, fetch_list=[y])


def test_reading_a_variable_nothing_produced_names_it():
    main = Program()
    main.global_block().create_var("ghost", shape=(2,))
    main.global_block().create_var("r", shape=(2,))
    op = main.append_op("relu", {"X": "ghost"}, {"Y": "r"})
    with pytest.raises(ExecutionError, match=rf"'relu' \(id {op.id}\) reads 'ghost'"):
        Executor().run(main)


def test_fetching_an_unknown_variable_names_it(trained):
    model, exe, batch = trained
    with pytest.raises(KeyError, match="fetch 'nope'"):
        exe.run(model.main, feed=batch, fetch_list=["nope"])
