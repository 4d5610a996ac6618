"""`If`s decided by dims known at import time although the shapes holding them are not
(transpiler/frontends/onnx/shape_values.py).

TorchScript writes `x.squeeze(dim)` as If(Equal(Gather(Shape(x), dim), 1)) with Squeeze / Identity
branches. Here x comes out of Reshape(y, Concat(Slice(Shape(y)), ...)) chains with y's batch
dynamic, so x's shape is only partly known: the tested dim is static, and the import folds the If
and matches onnxruntime at several batch sizes. Where the dim really is dynamic, the import refuses
naming the If node and the dim.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime import Executor
from transpiler import from_onnx
from transpiler.frontends.onnx.graph import UnsupportedOnnxOpsError
from transpiler.frontends.onnx.shape_values import Unknown, shape_facts


def _i64(name: str, v) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(v, np.int64), name)


def _squeeze_if(x: str, dim: int, out: str, rank: int) -> list[onnx.NodeProto]:
    """TorchScript's x.squeeze(dim) where x's dim is not known to its shape inference."""
    then = helper.make_graph(
        [
            helper.make_node("Constant", [], [f"{out}_axes"], value=_i64("a", [dim])),
            helper.make_node("Squeeze", [x, f"{out}_axes"], [f"{out}_sq"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info(f"{out}_sq", TensorProto.FLOAT, [None] * (rank - 1))],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", [x], [f"{out}_id"])],
        "else",
        [],
        [helper.make_tensor_value_info(f"{out}_id", TensorProto.FLOAT, [None] * rank)],
    )
    return [
        helper.make_node("Shape", [x], [f"{out}_shape"]),
        helper.make_node("Constant", [], [f"{out}_dim"], value=_i64("d", dim)),
        helper.make_node("Gather", [f"{out}_shape", f"{out}_dim"], [f"{out}_n"], axis=0),
        helper.make_node("Constant", [], [f"{out}_one"], value=_i64("o", 1)),
        helper.make_node("Equal", [f"{out}_n", f"{out}_one"], [f"{out}_cond"]),
        helper.make_node("If", [f"{out}_cond"], [out], name=f"{out}_if", then_branch=then, else_branch=other),
    ]


def _model(nodes, y_shape, inits, z_rank: int) -> onnx.ModelProto:
    """y -> nodes -> z, z declared by its rank only (its dims are what the import has to prove)."""
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [None] * z_rank)
    graph = helper.make_graph(nodes, "squeeze", [y], [z], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def slice_chain(dim: int) -> tuple[onnx.ModelProto, tuple]:
    """y [batch, 12] -> Reshape(y, Concat(Slice(Shape(y), 0, 1), [1, 12])) -> Relu -> squeeze(dim)."""
    nodes = [
        helper.make_node("Shape", ["y"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "one"], ["head"]),
        helper.make_node("Concat", ["head", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["y", "target"], ["x"]),
        helper.make_node("Relu", ["x"], ["r"]),  # an op the propagation has no rule for
        *_squeeze_if("r", dim, "z", 3),
    ]
    inits = [_i64("zero", [0]), _i64("one", [1]), _i64("tail", [1, 12])]
    return _model(nodes, ["batch", 12], inits, 2 if dim == 1 else 3), (12,)


def arithmetic_chain(dim: int) -> tuple[onnx.ModelProto, tuple]:
    """y [batch, 3, 8] -> Reshape(y, Concat(Slice(Shape(y)), Unsqueeze(Cast(Div(Cast(d1 * d2), 24.)) - 1 + 1),
    [24])) -> squeeze(dim): dim 1 is (3 * 8) / 24 = 1 by Gather / Mul / Cast / Div / Sub / Add."""
    nodes = [
        helper.make_node("Shape", ["y"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "one"], ["head"]),
        helper.make_node("Gather", ["s", "i1"], ["d1"], axis=0),
        helper.make_node("Gather", ["s", "i2"], ["d2"], axis=0),
        helper.make_node("Mul", ["d1", "d2"], ["prod"]),
        helper.make_node("Cast", ["prod"], ["prod_f"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["prod_f", "f24"], ["ratio_f"]),
        helper.make_node("Cast", ["ratio_f"], ["ratio"], to=TensorProto.INT64),
        helper.make_node("Sub", ["ratio", "i1"], ["less"]),
        helper.make_node("Add", ["less", "i1"], ["same"]),
        helper.make_node("Unsqueeze", ["same", "zero"], ["mid"]),
        helper.make_node("Concat", ["head", "mid", "last"], ["target"], axis=0),
        helper.make_node("Reshape", ["y", "target"], ["x"]),
        *_squeeze_if("x", dim, "z", 3),
    ]
    inits = [
        _i64("zero", [0]),
        _i64("one", [1]),
        _i64("i1", 1),
        _i64("i2", 2),
        _i64("last", [24]),
        numpy_helper.from_array(np.array(24.0, np.float32), "f24"),
    ]
    return _model(nodes, ["batch", 3, 8], inits, 2 if dim == 1 else 3), (3, 8)


def _expected(build, y: np.ndarray, dim: int) -> np.ndarray:
    """By hand: the reshape to [batch, 1, width] (then Relu in slice_chain), squeezed when dim is 1."""
    x = y.reshape(len(y), 1, -1)
    x = np.maximum(x, 0) if build is slice_chain else x
    return x[:, 0] if dim == 1 else x


@pytest.mark.parametrize("dim", [1, 2], ids=["squeezes", "keeps"])
@pytest.mark.parametrize("build", [slice_chain, arithmetic_chain])
def test_if_on_a_static_dim_folds_and_matches_onnxruntime(build, dim: int) -> None:
    model, rest = build(dim)
    program = from_onnx(model)
    assert not [op for op in program.global_block().ops if op.type == "If"]
    # onnxruntime's own shape inference sees the slice chain's dim 2 (12) and refuses the model for
    # its then-branch (Squeeze of a dim that is not 1): there the reference is the numpy above alone
    session = (
        None
        if (build, dim) == (slice_chain, 2)
        else ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    )
    for batch in (3, 5):
        y = np.random.default_rng(batch).normal(size=(batch, *rest)).astype(np.float32)
        (got,) = Executor().run(program, feed={"y": y}, fetch_list=["z"])
        want = _expected(build, y, dim)
        width = int(np.prod(rest))
        assert got.shape == want.shape == ((batch, width) if dim == 1 else (batch, 1, width))
        np.testing.assert_array_equal(got, want)
        if session is not None:
            np.testing.assert_array_equal(got, session.run(["z"], {"y": y})[0])


def test_shape_facts_say_which_dims_are_known() -> None:
    model, _ = slice_chain(1)
    facts = shape_facts(model)
    batch, one, twelve = facts.shapes["x"]
    assert isinstance(batch, Unknown) and "'batch'" in batch.reason and (one, twelve) == (1, 12)
    assert facts.shapes["r"][1:] == (1, 12)  # proved for Reshape, then carried by ONNX's inference
    assert facts.value("z_cond").tolist() is True
    assert facts.value("target") is None and "dim 0 of 'y'" in facts.unknown("target")


def test_dynamic_dim_is_refused_naming_the_if_and_the_dim() -> None:
    """y [batch, n] -> Reshape(y, Concat(Slice(Shape(y), 0, 2), [1])) -> squeeze(1): dim 1 is y's n."""
    nodes = [
        helper.make_node("Shape", ["y"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "two"], ["head"]),
        helper.make_node("Concat", ["head", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["y", "target"], ["x"]),
        *_squeeze_if("x", 1, "z", 3),
    ]
    model = _model(nodes, ["batch", "n"], [_i64("zero", [0]), _i64("two", [2]), _i64("tail", [1])], 2)
    with pytest.raises(UnsupportedOnnxOpsError) as e:
        from_onnx(model)
    msg = str(e.value)
    assert "z_if" in msg and "dim 1 of 'y' (symbolic 'n')" in msg, msg


def test_torchscript_squeeze_export_folds_and_matches_onnxruntime() -> None:
    """A real torch 2.13 TorchScript export (opset 18, batch dynamic) of

        x = y.view(y.size(0), y.size(1) // 12, 12); return torch.relu(x).squeeze(1)

    with y [batch, 12]: the exporter writes the squeeze as an If on Shape(Relu(x))[1], x's dim 1
    computed by Shape / Gather / Div / Cast / Unsqueeze / Concat into a Reshape."""
    path = Path(__file__).resolve().parents[2] / "models" / "ts_squeeze_if.onnx"
    assert "If" in {n.op_type for n in onnx.load(path).graph.node}
    program = from_onnx(path)
    assert "squeeze" in {op.type for op in program.global_block().ops}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 7):
        y = np.random.default_rng(batch).normal(size=(batch, 12)).astype(np.float32)
        (got,) = Executor().run(program, feed={"y": y}, fetch_list=["z"])
        want = session.run(["z"], {"y": y})[0]
        assert got.shape == want.shape == (batch, 12)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, np.maximum(y, 0))
