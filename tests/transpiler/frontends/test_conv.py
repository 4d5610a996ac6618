"""Conv and Pad (ops_registry/conv.py) against independent references.

- Forward: single-node ONNX models built with onnx.helper, run by from_onnx + Executor and by
  onnxruntime, over a grid of 1-D / 2-D / 3-D convolutions (pads, strides, dilations, group > 1,
  auto_pad SAME_UPPER / SAME_LOWER / VALID, kernel 1, with and without B) and Pad's modes (constant,
  reflect, edge, wrap; `axes`; negative pads; pads computed at run time).
- Shapes: the op's shape rule gives onnxruntime's output shape.
- The kernel-1 fast path is the path taken (and only for stride 1, no padding, one group).
- Gradients (X, W, B; Pad's data) in float64 against central finite differences, with the helpers
  of test_onnx_gradients.
(ONNX's own Conv / Pad node cases run in test_onnx_conformance.py, which picks every covered op.)
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from test_onnx_gradients import _assert_gradients_match, _build

import ops_registry.conv as conv_mod
from ops_registry import get_op
from runtime import Executor
from transpiler import from_onnx

rng = np.random.default_rng(33)


def _model(op_type: str, feeds: dict, inits: dict, attrs: dict, inputs: list[str], opset: int = 18):
    """One node reading `inputs` (feeds as graph inputs, inits as initializers), output "y" typed by
    ONNX's shape inference."""
    vis = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in feeds.items()
    ]
    node = helper.make_node(op_type, inputs, ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        op_type.lower(),
        vis,
        [helper.make_empty_tensor_value_info("y")],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def _ort(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], feed)[0]


def _ours(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    program = from_onnx(model)
    return Executor().run(program, feed=feed, fetch_list=["y"])[0]


# (id, X shape, W shape, attrs, bias)
CONVS = [
    ("1d_plain", (2, 3, 7), (4, 3, 3), {}, False),
    ("1d_bias", (2, 3, 7), (4, 3, 3), {}, True),
    ("1d_pads", (2, 3, 7), (4, 3, 3), {"pads": [1, 2]}, True),
    ("1d_strides", (2, 3, 9), (4, 3, 3), {"strides": [2]}, False),
    ("1d_dilations", (2, 3, 9), (4, 3, 3), {"dilations": [2], "pads": [2, 2]}, True),
    ("1d_group2", (2, 4, 7), (6, 2, 3), {"group": 2, "pads": [1, 1]}, True),
    ("1d_depthwise", (2, 4, 7), (4, 1, 3), {"group": 4}, False),
    ("1d_same_upper", (2, 3, 8), (4, 3, 4), {"auto_pad": "SAME_UPPER", "strides": [3]}, True),
    ("1d_same_lower", (2, 3, 8), (4, 3, 4), {"auto_pad": "SAME_LOWER", "strides": [3]}, True),
    ("1d_same_lower_dilated", (2, 3, 8), (4, 3, 2), {"auto_pad": "SAME_LOWER", "dilations": [3]}, False),
    ("1d_valid", (2, 3, 8), (4, 3, 3), {"auto_pad": "VALID", "strides": [2]}, False),
    ("1d_kernel1_cin", (3, 6, 4), (5, 6, 1), {}, True),  # xDeepFM's CIN as a Conv1d
    ("1d_kernel1_nobias", (3, 6, 4), (5, 6, 1), {"kernel_shape": [1]}, False),
    ("1d_kernel1_strided", (3, 6, 5), (5, 6, 1), {"strides": [2]}, True),
    ("1d_kernel1_padded", (3, 6, 4), (5, 6, 1), {"pads": [1, 0]}, False),
    ("1d_kernel1_group", (3, 6, 4), (4, 3, 1), {"group": 2}, True),
    ("2d_plain", (2, 3, 5, 6), (4, 3, 3, 2), {}, True),
    ("2d_ccpm_kx1", (2, 1, 6, 4), (3, 1, 3, 1), {"pads": [1, 0, 1, 0]}, True),  # CCPM's k x 1 conv
    ("2d_asym_pads_strides", (2, 3, 7, 6), (4, 3, 3, 3), {"pads": [0, 1, 2, 1], "strides": [2, 3]}, True),
    ("2d_dilations", (1, 2, 7, 7), (3, 2, 2, 3), {"dilations": [3, 2], "pads": [1, 1, 0, 2]}, False),
    ("2d_group3", (2, 6, 5, 5), (9, 2, 3, 3), {"group": 3, "pads": [1, 1, 1, 1], "strides": [2, 1]}, True),
    ("2d_same_upper", (2, 3, 6, 7), (4, 3, 3, 4), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, True),
    ("2d_same_lower", (2, 3, 6, 7), (4, 3, 3, 4), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}, False),
    ("2d_valid", (2, 3, 6, 7), (4, 3, 3, 4), {"auto_pad": "VALID"}, True),
    ("2d_1x1_tf2onnx_cin", (4, 8, 1, 5), (3, 8, 1, 1), {}, True),  # tf2onnx's CIN: a 1x1 Conv2d
    ("3d_plain", (1, 2, 4, 5, 3), (2, 2, 2, 3, 2), {"pads": [1, 0, 0, 0, 1, 1], "strides": [1, 2, 1]}, True),
]


def _conv_case(xs, ws, attrs, bias, dtype=np.float32):
    x = rng.normal(size=xs).astype(dtype)
    inits = {"W": rng.normal(size=ws).astype(dtype)}
    if bias:
        inits["B"] = rng.normal(size=ws[0]).astype(dtype)
    return x, inits, ["x", "W", "B"] if bias else ["x", "W"]


# onnxruntime refuses dilations with SAME_* auto_pad: ONNX's reference evaluator is the reference there
REFERENCE_EVALUATOR_ONLY = {"1d_same_lower_dilated"}


@pytest.mark.parametrize("case", CONVS, ids=[c[0] for c in CONVS])
def test_conv_forward_equals_onnxruntime(case) -> None:
    name, xs, ws, attrs, bias = case
    x, inits, inputs = _conv_case(xs, ws, attrs, bias)
    model = _model("Conv", {"x": x}, inits, attrs, inputs)
    if name in REFERENCE_EVALUATOR_ONLY:
        want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    else:
        want = _ort(model, {"x": x})
    got = _ours(model, {"x": x})
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    shape = get_op("conv").infer_shape({"X": xs, "W": ws}, {**get_op("conv").attrs, **attrs})["Y"]
    assert shape == want.shape
    assert get_op("conv").infer_shape({"X": (-1, *xs[1:]), "W": ws}, attrs)["Y"] == (-1, *want.shape[1:])


def test_conv_by_hand_1d() -> None:
    """One 1-D case written out: y[n, m, o] = b[m] + sum_c,k w[m, c, k] * xpad[n, c, o * s + k * d]."""
    x, w, b = rng.normal(size=(2, 3, 9)), rng.normal(size=(4, 3, 3)), rng.normal(size=4)
    pads, s, d = (2, 1), 2, 2
    xpad = np.pad(x, [(0, 0), (0, 0), pads])
    n_out = (9 + 3 - 5) // s + 1
    want = np.zeros((2, 4, n_out))
    for o in range(n_out):
        for k in range(3):
            want[:, :, o] += xpad[:, :, o * s + k * d] @ w[:, :, k].T
    want += b[None, :, None]
    got = get_op("conv").kernel(
        np, {"X": x, "W": w, "B": b}, {"pads": list(pads), "strides": [s], "dilations": [d], "group": 1}
    )["Y"]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_kernel1_convolution_is_one_matmul(monkeypatch) -> None:
    """Kernel 1, stride 1, no pads, one group: no columns gathered (forward and backward); any
    other convolution gathers them."""
    calls = []
    real = conv_mod._columns
    monkeypatch.setattr(conv_mod, "_columns", lambda *a: calls.append(1) or real(*a))
    op = get_op("conv")
    x, w = rng.normal(size=(3, 6, 4)), rng.normal(size=(5, 6, 1))
    y = op.kernel(np, {"X": x, "W": w}, {"group": 1})["Y"]
    np.testing.assert_allclose(y, np.einsum("mc,ncp->nmp", w[:, :, 0], x), rtol=1e-12)
    op.vjp(np, {"X": x, "W": w}, {"Y": y}, {"Y": np.ones_like(y)}, {"group": 1})
    assert calls == []
    op.kernel(np, {"X": x, "W": w}, {"group": 1, "strides": [2]})
    assert calls == [1]


def test_conv_errors_name_the_problem() -> None:
    op = get_op("conv")
    with pytest.raises(ValueError, match="group 2"):
        op.kernel(np, {"X": np.zeros((1, 3, 4)), "W": np.zeros((4, 3, 1))}, {"group": 2})
    with pytest.raises(ValueError, match="output sizes"):
        op.kernel(np, {"X": np.zeros((1, 3, 2)), "W": np.zeros((4, 3, 3))}, {"group": 1})
    with pytest.raises(ValueError, match="auto_pad"):
        op.kernel(np, {"X": np.zeros((1, 3, 4)), "W": np.zeros((4, 3, 1))}, {"auto_pad": "SAME"})


# (id, data shape, pads, mode, constant_value, axes, opset)
PADS = [
    ("constant_zero", (2, 3, 4), [0, 1, 2, 0, 2, 1], "constant", None, None, 18),
    ("constant_value", (2, 3, 4), [1, 0, 0, 1, 1, 2], "constant", 1.5, None, 18),
    ("constant_ccpm", (2, 1, 6, 4), [0, 0, 1, 0, 0, 0, 1, 0], "constant", None, None, 13),
    ("constant_negative", (3, 5), [-1, 2, 1, -2], "constant", 0.25, None, 18),
    ("constant_axes", (2, 3, 4), [1, 2, 0, 3], "constant", -1.0, [2, 0], 18),
    ("constant_negative_axes", (2, 3, 4), [2, 1], "constant", None, [-2], 18),
    ("reflect", (2, 4, 5), [0, 2, 3, 0, 1, 4], "reflect", None, None, 18),
    ("edge", (2, 4, 5), [1, 3, 2, 0, 2, 6], "edge", None, None, 18),
    ("edge_axes", (3, 4), [2, 5], "edge", None, [1], 18),
    ("wrap", (2, 4, 5), [0, 3, 2, 1, 1, 4], "wrap", None, None, 19),
]


def _pad_model(case, dynamic: bool = False):
    _, shape, pads, mode, value, axes, opset = case
    x = rng.normal(size=shape).astype(np.float32)
    feeds, inits = {"x": x}, {}
    (feeds if dynamic else inits)["pads"] = np.array(pads, np.int64)
    inputs = ["x", "pads"]
    if value is not None or axes is not None:
        inputs.append("" if value is None else "cv")
        if value is not None:
            inits["cv"] = np.array(value, np.float32)
    if axes is not None:
        inputs.append("axes")
        inits["axes"] = np.array(axes, np.int64)
    return _model("Pad", feeds, inits, {"mode": mode}, inputs, opset), feeds


@pytest.mark.parametrize("dynamic", [False, True], ids=["pads_constant", "pads_fed"])
@pytest.mark.parametrize("case", PADS, ids=[c[0] for c in PADS])
def test_pad_forward_equals_onnxruntime(case, dynamic: bool) -> None:
    model, feed = _pad_model(case, dynamic)
    want = _ort(model, feed)
    got = _ours(model, feed)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_pad_errors_name_the_problem() -> None:
    op = get_op("pad")
    with pytest.raises(ValueError, match="mode 'symmetric'"):
        op.kernel(np, {"data": np.zeros((2, 2))}, {"pads": [1, 1, 1, 1], "mode": "symmetric"})
    with pytest.raises(ValueError, match="3 pads for 2 axes"):
        op.kernel(np, {"data": np.zeros((2, 2))}, {"pads": [1, 1, 1], "mode": "constant"})


def _r(*shape):
    return rng.uniform(-1, 1, shape)


def _i64(v):
    return np.array(v, np.int64)


# test_onnx_gradients' spec format: (id, op, params, data, consts, attrs, outputs in the loss, opset)
GRAD_SPECS = [
    (
        "conv1d_pads_dil_bias",
        "Conv",
        {"X": _r(2, 3, 8), "W": _r(4, 3, 3), "B": _r(4)},
        {},
        {},
        {"pads": [2, 1], "dilations": [2]},
        1,
        18,
    ),
    (
        "conv1d_group_stride",
        "Conv",
        {"X": _r(2, 4, 9), "W": _r(6, 2, 3), "B": _r(6)},
        {},
        {},
        {"group": 2, "strides": [2], "pads": [1, 0]},
        1,
        18,
    ),
    ("conv1d_kernel1", "Conv", {"X": _r(3, 5, 4), "W": _r(2, 5, 1), "B": _r(2)}, {}, {}, {}, 1, 18),
    ("conv1d_kernel1_nobias", "Conv", {"X": _r(2, 3, 4), "W": _r(4, 3, 1)}, {}, {}, {}, 1, 18),
    (
        "conv2d_ccpm_kx1",
        "Conv",
        {"X": _r(2, 1, 5, 3), "W": _r(2, 1, 3, 1), "B": _r(2)},
        {},
        {},
        {"pads": [1, 0, 1, 0]},
        1,
        18,
    ),
    (
        "conv2d_same_lower_group",
        "Conv",
        {"X": _r(1, 4, 5, 4), "W": _r(4, 2, 2, 3)},
        {},
        {},
        {"auto_pad": "SAME_LOWER", "group": 2, "strides": [2, 1]},
        1,
        18,
    ),
    (
        "conv2d_same_upper_dil",
        "Conv",
        {"X": _r(1, 2, 5, 5), "W": _r(3, 2, 2, 2), "B": _r(3)},
        {},
        {},
        {"auto_pad": "SAME_UPPER", "dilations": [2, 1]},
        1,
        18,
    ),
    ("conv2d_1x1", "Conv", {"X": _r(2, 3, 1, 4), "W": _r(2, 3, 1, 1), "B": _r(2)}, {}, {}, {}, 1, 18),
    (
        "pad_constant",
        "Pad",
        {"data": _r(2, 3)},
        {},
        {"pads": _i64([1, 0, 2, 3]), "constant_value": np.array(0.5)},
        {},
        1,
        18,
    ),
    (
        "pad_reflect",
        "Pad",
        {"data": _r(2, 4, 3)},
        {},
        {"pads": _i64([0, 3, 2, 1, 2, 2])},
        {"mode": "reflect"},
        1,
        18,
    ),
    (
        "pad_edge_axes",
        "Pad",
        {"data": _r(2, 3, 3)},
        {},
        {"pads": _i64([2, 4]), "axes": _i64([-1])},
        {"mode": "edge"},
        1,
        18,
    ),
    ("pad_wrap", "Pad", {"data": _r(3, 4)}, {}, {"pads": _i64([1, 5, 2, 3])}, {"mode": "wrap"}, 1, 19),
]


@pytest.mark.parametrize("spec", GRAD_SPECS, ids=[s[0] for s in GRAD_SPECS])
def test_gradients_match_finite_differences(spec) -> None:
    model, feed, trainable, expected = _build(spec)
    program = from_onnx(model)
    got = Executor().run(program, feed=feed, fetch_list=[o.name for o in model.graph.output])
    np.testing.assert_allclose(got[1], expected[0], rtol=1e-12, atol=1e-12)  # vs ONNX's reference evaluator
    _assert_gradients_match(lambda: from_onnx(model), feed, trainable)


def test_negative_pads_gradient_matches_finite_differences() -> None:
    """Negative pads (which ONNX's reference evaluator cannot run): loss = sum(Pad(data) * R)."""
    data, r = _r(3, 4), _r(3, 4)  # pads [-1, 2, 1, -2] keep the shape: rows 1..3 (+1), cols 0..1 (+2)
    nodes = [
        helper.make_node("Pad", ["data", "pads"], ["y"]),
        helper.make_node("Mul", ["y", "R"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "pad_negative",
        [helper.make_tensor_value_info("R", onnx.TensorProto.DOUBLE, r.shape)],
        [helper.make_tensor_value_info("loss", onnx.TensorProto.DOUBLE, [])],
        [numpy_helper.from_array(data, "data"), numpy_helper.from_array(_i64([-1, 2, 1, -2]), "pads")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    want = np.pad(data[1:, :2], [(0, 1), (2, 0)])
    (got,) = Executor().run(from_onnx(model), feed={"R": r}, fetch_list=["y"])
    np.testing.assert_array_equal(got, want)
    _assert_gradients_match(lambda: from_onnx(model), {"R": r}, ["data"])


def test_conv_float64_forward_matches_reference_evaluator() -> None:
    """float64 (which onnxruntime's CPU Conv lacks) against ONNX's reference evaluator, to 1e-12."""
    x, inits, inputs = _conv_case((2, 4, 6, 5), (6, 2, 3, 2), {}, True, dtype=np.float64)
    attrs = {"group": 2, "pads": [1, 0, 1, 1], "strides": [1, 2]}
    model = _model("Conv", {"x": x}, inits, attrs, inputs)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(_ours(model, {"x": x}), want, rtol=1e-12, atol=1e-12)
