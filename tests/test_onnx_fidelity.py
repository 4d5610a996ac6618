"""What real exporters write that hand-made graphs do not (issue 14): declared shapes that disagree
with the computed ones (paddle2onnx's rank-0 loss), and control flow (`Loop` / `If`).

References are onnxruntime runs of the same model and numpy by hand.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime import Executor
from transpiler import from_onnx
from transpiler.onnx_import import OnnxImportError, OnnxShapeWarning

rng = np.random.default_rng(14)


def _ort(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # its own lenient-merge warnings
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _model(nodes, inputs, outputs, value_info=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _scalar_loss_model(declared_loss_shape, value_info=()) -> onnx.ModelProto:
    """paddle2onnx's pattern: weights as Constant nodes, the mean loss reshaped to [1] and the graph
    output declared with another shape."""
    w = rng.normal(size=(3, 1)).astype(np.float32)
    nodes = [_const("w", w), _const("one", np.array([1], np.int64)),
             helper.make_node("MatMul", ["x", "w"], ["z"]),
             helper.make_node("Sigmoid", ["z"], ["p"]),
             helper.make_node("Sub", ["p", "y"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["m"], keepdims=0),
             helper.make_node("Reshape", ["m", "one"], ["r"]),
             helper.make_node("Identity", ["r"], ["loss"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
              helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])]
    out = helper.make_tensor_value_info("loss", TensorProto.FLOAT, declared_loss_shape)
    return _model(nodes, inputs, [out], value_info)


def _feed(n: int = 5) -> dict:
    return {"x": rng.normal(size=(n, 3)).astype(np.float32),
            "y": rng.integers(0, 2, (n, 1)).astype(np.float32)}


def test_rank0_declared_loss_of_shape_1_runs_with_one_warning() -> None:
    """The held-out Wide&Deep failure: `op 'identity' made 'loss' with shape [1], but the program
    declares []`. Now the computed [1] wins, one warning names the value, values equal onnxruntime's."""
    model = _scalar_loss_model([])
    feed = _feed()
    with pytest.warns(OnnxShapeWarning) as record:
        program = from_onnx(model)
    assert len(record) == 1 and "'loss'" in str(record[0].message)
    assert program.var("loss").shape == (1,)
    (got,) = Executor().run(program, feed=feed, fetch_list=["loss"])
    (ref,) = _ort(model, feed)
    assert got.shape == ref.shape == (1,)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert program.attrs["loss_name"] == "loss"  # still found as the loss


def test_value_info_that_disagrees_is_lenient_too() -> None:
    vi = helper.make_tensor_value_info("r", TensorProto.FLOAT, [])
    with pytest.warns(OnnxShapeWarning) as record:
        program = from_onnx(_scalar_loss_model([1], value_info=[vi]))
    assert [str(r.message).split(":")[0] for r in record] == ["value 'r'"]
    assert program.var("r").shape == (1,)


def test_fixed_declared_dim_vs_symbolic_computed_dim() -> None:
    """A graph output declared with a fixed batch while the graph computes a symbolic one: any batch
    runs (the computed [N, 1] wins), as in onnxruntime."""
    nodes = [_const("w", rng.normal(size=(3, 1)).astype(np.float32)),
             helper.make_node("MatMul", ["x", "w"], ["z"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                   [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 1])])
    with pytest.warns(OnnxShapeWarning, match="'z'"):
        program = from_onnx(model)
    feed = {"x": rng.normal(size=(7, 3)).astype(np.float32)}
    (got,) = Executor().run(program, feed=feed, fetch_list=["z"])
    np.testing.assert_allclose(got, _ort(model, feed)[0], rtol=1e-6)


def test_agreeing_declarations_give_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = from_onnx(_scalar_loss_model([1]))
        program_sym = from_onnx(_scalar_loss_model(["one"]))  # symbolic where the graph computes 1
    assert program.var("loss").shape == program_sym.var("loss").shape == (1,)


def test_incompatible_declaration_is_refused_naming_the_value() -> None:
    with pytest.raises(OnnxImportError, match=r"graph output 'loss' is declared with shape \[2\]"):
        from_onnx(_scalar_loss_model([2]))
