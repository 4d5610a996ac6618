"""Gradients of imported ONNX graphs against central finite differences (float64).

For every ONNX op type that from_onnx maps to a differentiable hetps op, a single-node graph is
built with onnx.helper; its float inputs are initializers (so they import as trainable parameters),
and its outputs are scalarised as sum_k sum(output_k * R_k) with random R_k fed as data. The
gradients append_backward produces must agree with central differences (eps 1e-6) to rtol 1e-5. The
node's outputs are graph outputs too, so the forward values are checked against
onnx.reference.ReferenceEvaluator on the way.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ops_registry import by_onnx
from runtime import Executor
from transpiler import append_backward, from_onnx
from transpiler.frontends.onnx.importer import LOSSES, supported_onnx_ops

rng = np.random.default_rng(7)


def _r(*shape, low=-1.0, high=1.0):
    return rng.uniform(low, high, shape)


def _away(*shape, low=0.2, high=1.0):
    """Values bounded away from 0 (kinks of Relu / Abs, poles of Div / Log)."""
    return rng.uniform(low, high, shape) * rng.choice([-1.0, 1.0], shape)


def _i64(values):
    return np.array(values, dtype=np.int64)


# (id, op_type, params (differentiable, float64), data (fed, non-differentiable), consts (folded /
#  non-trainable initializers), attrs, number of outputs in the loss, opset)
SPECS = [
    (
        "gather_axis1",
        "Gather",
        {"data": _r(3, 4, 2)},
        {"indices": _i64([[0, -1], [2, 2]])},
        {},
        {"axis": 1},
        1,
        18,
    ),
    ("gather_table", "Gather", {"data": _r(6, 3)}, {"indices": _i64([[1, 4, 1], [5, 0, 1]])}, {}, {}, 1, 18),
    (
        "gather_elements",
        "GatherElements",
        {"data": _r(3, 4)},
        {"indices": _i64([[0, 3], [-1, 1], [2, 2]])},
        {},
        {"axis": 1},
        1,
        18,
    ),
    ("matmul_batched", "MatMul", {"A": _r(2, 3, 4), "B": _r(4, 5)}, {}, {}, {}, 1, 18),
    ("matmul_1d", "MatMul", {"A": _r(4), "B": _r(2, 4, 3)}, {}, {}, {}, 1, 18),
    (
        "gemm",
        "Gemm",
        {"A": _r(4, 3), "B": _r(5, 4), "C": _r(5)},
        {},
        {},
        {"transA": 1, "transB": 1, "alpha": 0.7, "beta": 1.3},
        1,
        18,
    ),
    ("add", "Add", {"A": _r(2, 3), "B": _r(3)}, {}, {}, {}, 1, 18),
    ("sub", "Sub", {"A": _r(3, 1), "B": _r(2, 1, 4)}, {}, {}, {}, 1, 18),
    ("mul", "Mul", {"A": _r(2, 3), "B": _r(2, 1)}, {}, {}, {}, 1, 18),
    ("div", "Div", {"A": _r(2, 3), "B": _away(3)}, {}, {}, {}, 1, 18),
    ("neg", "Neg", {"X": _r(2, 3)}, {}, {}, {}, 1, 18),
    ("relu", "Relu", {"X": _away(2, 3)}, {}, {}, {}, 1, 18),
    ("leaky_relu", "LeakyRelu", {"X": _away(2, 3)}, {}, {}, {"alpha": 0.2}, 1, 18),
    ("sigmoid", "Sigmoid", {"X": _r(2, 3, low=-4, high=4)}, {}, {}, {}, 1, 18),
    ("tanh", "Tanh", {"input": _r(2, 3)}, {}, {}, {}, 1, 18),
    ("exp", "Exp", {"input": _r(2, 3)}, {}, {}, {}, 1, 18),
    ("log", "Log", {"input": _r(2, 3, low=0.3, high=2)}, {}, {}, {}, 1, 18),
    ("sqrt", "Sqrt", {"X": _r(2, 3, low=0.3, high=2)}, {}, {}, {}, 1, 18),
    ("pow", "Pow", {"X": _r(2, 3, low=0.3, high=2), "Y": _r(3)}, {}, {}, {}, 1, 18),
    ("abs", "Abs", {"X": _away(2, 3)}, {}, {}, {}, 1, 18),
    (
        "clip",
        "Clip",
        {"input": np.array([[-0.9, -0.3, 0.1], [0.45, 0.7, -0.55]])},
        {},
        {"min": np.array(-0.5), "max": np.array(0.5)},
        {},
        1,
        18,
    ),
    ("concat", "Concat", {"inputs": [_r(2, 3), _r(2, 2)]}, {}, {}, {"axis": 1}, 1, 18),
    ("split_sizes", "Split", {"input": _r(4, 6)}, {}, {"split": _i64([1, 2, 3])}, {"axis": 1}, 3, 18),
    ("split_num_outputs", "Split", {"input": _r(5, 2)}, {}, {}, {"axis": 0, "num_outputs": 2}, 2, 18),
    ("reshape", "Reshape", {"data": _r(2, 3, 2)}, {}, {"shape": _i64([3, -1])}, {}, 1, 18),
    ("flatten", "Flatten", {"input": _r(2, 3, 2)}, {}, {}, {"axis": 2}, 1, 18),
    ("transpose", "Transpose", {"data": _r(2, 3, 4)}, {}, {}, {"perm": [1, 2, 0]}, 1, 18),
    ("unsqueeze", "Unsqueeze", {"data": _r(2, 3)}, {}, {"axes": _i64([0, -1])}, {}, 1, 18),
    ("squeeze", "Squeeze", {"data": _r(2, 1, 3)}, {}, {"axes": _i64([1])}, {}, 1, 18),
    (
        "slice",
        "Slice",
        {"data": _r(5, 4)},
        {},
        {"starts": _i64([4, 1]), "ends": _i64([0, 10]), "axes": _i64([0, 1]), "steps": _i64([-2, 2])},
        {},
        1,
        18,
    ),
    ("expand", "Expand", {"input": _r(3, 1)}, {}, {"shape": _i64([2, 1, 4])}, {}, 1, 18),
    ("tile", "Tile", {"input": _r(2, 3)}, {}, {"repeats": _i64([2, 2])}, {}, 1, 18),
    ("reduce_sum", "ReduceSum", {"data": _r(2, 3, 4)}, {}, {"axes": _i64([1])}, {"keepdims": 1}, 1, 18),
    ("reduce_mean", "ReduceMean", {"data": _r(2, 3, 4)}, {}, {"axes": _i64([0, 2])}, {"keepdims": 0}, 1, 18),
    ("reduce_mean_opset13", "ReduceMean", {"data": _r(2, 3)}, {}, {}, {"axes": [-1], "keepdims": 1}, 1, 13),
    ("reduce_max", "ReduceMax", {"data": _r(3, 4)}, {}, {"axes": _i64([1])}, {"keepdims": 0}, 1, 18),
    ("softmax", "Softmax", {"input": _r(2, 3, 4)}, {}, {}, {"axis": 1}, 1, 18),
    ("log_softmax", "LogSoftmax", {"input": _r(2, 3, 4)}, {}, {}, {}, 1, 18),
    (
        "sce_mean_weights_ii",
        "SoftmaxCrossEntropyLoss",
        {"scores": _r(3, 4, 2)},
        {"labels": _i64([[0, 3], [2, 1], [1, 3]]), "weights": _r(4, low=0.5, high=2)},
        {},
        {"ignore_index": 1},
        2,
        18,
    ),
    (
        "sce_none",
        "SoftmaxCrossEntropyLoss",
        {"scores": _r(3, 5)},
        {"labels": _i64([4, 0, 2])},
        {},
        {"reduction": "none"},
        1,
        18,
    ),
    (
        "nll_mean",
        "NegativeLogLikelihoodLoss",
        {"input": _r(3, 4)},
        {"target": _i64([3, 0, 1]), "weight": _r(4, low=0.5, high=2)},
        {},
        {},
        1,
        18,
    ),
    (
        "nll_sum_ii",
        "NegativeLogLikelihoodLoss",
        {"input": _r(2, 3, 2)},
        {"target": _i64([[0, 2], [2, 1]])},
        {},
        {"reduction": "sum", "ignore_index": 2},
        1,
        18,
    ),
    ("cast", "Cast", {"input": _r(2, 3)}, {}, {}, {"to": TensorProto.DOUBLE}, 1, 18),
    (
        "where",
        "Where",
        {"X": _r(2, 3), "Y": _r(3)},
        {"condition": np.array([[True, False, True]] * 2)},
        {},
        {},
        1,
        18,
    ),
    ("identity", "Identity", {"input": _r(2, 3)}, {}, {}, {}, 1, 18),
    (
        "layer_norm",
        "LayerNormalization",
        {"X": _r(2, 3, 4), "Scale": _r(3, 4), "B": _r(3, 4)},
        {},
        {},
        {"axis": -2},
        1,
        18,
    ),
    (
        "batch_norm_inference",
        "BatchNormalization",
        {"X": _r(2, 3, 2), "scale": _r(3), "B": _r(3)},
        {"input_mean": _r(3), "input_var": _r(3, low=0.5, high=1.5)},
        {},
        {},
        1,
        18,
    ),
    (
        "batch_norm_training",
        "BatchNormalization",
        {"X": _r(4, 3, 2), "scale": _r(3), "B": _r(3)},
        {"input_mean": _r(3), "input_var": _r(3, low=0.5, high=1.5)},
        {},
        {"training_mode": 1},
        1,
        18,
    ),
    (
        "dropout_training",
        "Dropout",
        {"data": _r(4, 5)},
        {},
        {"ratio": np.array(0.3), "training_mode": np.array(True)},
        {"seed": 3},
        1,
        18,
    ),
    (
        "einsum_bmm",
        "Einsum",
        {"Inputs": [_r(2, 3, 4), _r(2, 4, 5)]},
        {},
        {},
        {"equation": "bij,bjk->bik"},
        1,
        18,
    ),
    (
        "einsum_ellipsis_sum",
        "Einsum",
        {"Inputs": [_r(2, 3, 4), _r(4)]},
        {},
        {},
        {"equation": "...ij,j"},
        1,
        18,
    ),
    ("einsum_outer_reduce", "Einsum", {"Inputs": [_r(3, 2), _r(4)]}, {}, {}, {"equation": "ij,k->k"}, 1, 18),
    ("sum", "Sum", {"data_0": [_r(2, 3), _r(3), _r(2, 1)]}, {}, {}, {}, 1, 18),
    ("mean", "Mean", {"data_0": [_r(2, 3), _r(1, 3)]}, {}, {}, {}, 1, 18),
    # issue 14: the ops exporters emit for recommendation models
    ("min", "Min", {"data_0": [_r(2, 3), _r(3), _r(2, 1)]}, {}, {}, {}, 1, 18),
    ("max", "Max", {"data_0": [_r(2, 3), _r(1, 3)]}, {}, {}, {}, 1, 18),
    ("mod_fmod", "Mod", {"A": _r(2, 3, low=-3, high=3), "B": _away(3)}, {}, {}, {"fmod": 1}, 1, 18),
    ("mod_floor", "Mod", {"A": _r(2, 3, low=-3, high=3), "B": _away(2, 1)}, {}, {}, {}, 1, 18),
    ("floor", "Floor", {"X": _r(2, 3, low=-3, high=3)}, {}, {}, {}, 1, 18),
    ("ceil", "Ceil", {"X": _r(2, 3, low=-3, high=3)}, {}, {}, {}, 1, 18),
    ("round", "Round", {"X": _r(2, 3, low=-3, high=3)}, {}, {}, {}, 1, 18),
    ("sign", "Sign", {"input": _away(2, 3)}, {}, {}, {}, 1, 18),
    ("reciprocal", "Reciprocal", {"X": _away(2, 3)}, {}, {}, {}, 1, 18),
    ("sin", "Sin", {"input": _r(2, 3, low=-3, high=3)}, {}, {}, {}, 1, 18),
    ("cos", "Cos", {"input": _r(2, 3, low=-3, high=3)}, {}, {}, {}, 1, 18),
    ("erf", "Erf", {"input": _r(2, 3, low=-2, high=2)}, {}, {}, {}, 1, 18),
    ("softplus", "Softplus", {"X": _r(2, 3, low=-5, high=5)}, {}, {}, {}, 1, 18),
    ("elu", "Elu", {"X": _away(2, 3, high=2)}, {}, {}, {"alpha": 0.7}, 1, 18),
    ("selu", "Selu", {"X": _away(2, 3, high=2)}, {}, {}, {}, 1, 18),
    (
        "hard_sigmoid",
        "HardSigmoid",
        {"X": np.array([[-4.0, -1.5, 0.3], [2.0, 3.5, -0.2]])},
        {},
        {},
        {"alpha": 0.25, "beta": 0.4},
        1,
        18,
    ),
    ("hard_swish", "HardSwish", {"X": np.array([[-4.0, -2.5, 0.3], [2.0, 3.5, -0.2]])}, {}, {}, {}, 1, 18),
    ("prelu", "PRelu", {"X": _away(2, 3, 4), "slope": _r(3, 1)}, {}, {}, {}, 1, 18),
    ("reduce_min", "ReduceMin", {"data": _r(3, 4)}, {}, {"axes": _i64([0])}, {"keepdims": 0}, 1, 18),
    (
        "reduce_prod",
        "ReduceProd",
        {"data": _away(2, 3, 2)},
        {},
        {"axes": _i64([1, 2])},
        {"keepdims": 1},
        1,
        18,
    ),
    (
        "reduce_prod_with_zero",
        "ReduceProd",
        {"data": np.array([[0.0, 0.5, -2.0], [1.5, 0.7, 0.4]])},
        {},
        {"axes": _i64([1])},
        {"keepdims": 0},
        1,
        18,
    ),
    ("reduce_l2", "ReduceL2", {"data": _r(2, 3, 4)}, {}, {"axes": _i64([-1])}, {"keepdims": 0}, 1, 18),
    ("reduce_sum_square", "ReduceSumSquare", {"data": _r(2, 3)}, {}, {}, {"keepdims": 1}, 1, 18),
    (
        "reduce_log_sum_exp",
        "ReduceLogSumExp",
        {"data": _r(2, 3, 4, low=-3, high=3)},
        {},
        {"axes": _i64([1])},
        {"keepdims": 0},
        1,
        18,
    ),
    (
        "gather_nd",
        "GatherND",
        {"data": _r(4, 3, 2)},
        {"indices": _i64([[[1, 2]], [[-1, 0]], [[1, 2]]])},
        {},
        {},
        1,
        18,
    ),
    (
        "gather_nd_batch",
        "GatherND",
        {"data": _r(2, 3, 4)},
        {"indices": _i64([[[2], [0]], [[1], [1]]])},
        {},
        {"batch_dims": 1},
        1,
        18,
    ),
    (
        "scatter_nd",
        "ScatterND",
        {"data": _r(4, 3), "updates": _r(2, 3)},
        {"indices": _i64([[2], [0]])},
        {},
        {},
        1,
        18,
    ),
    (
        "scatter_nd_add",
        "ScatterND",
        {"data": _r(3, 3), "updates": _r(3)},
        {"indices": _i64([[0, 1], [2, 2], [0, 1]])},
        {},
        {"reduction": "add"},
        1,
        18,
    ),
    (
        "scatter_elements",
        "ScatterElements",
        {"data": _r(3, 4), "updates": _r(3, 2)},
        {"indices": _i64([[0, 3], [-1, 1], [2, 0]])},
        {},
        {"axis": 1},
        1,
        18,
    ),
    (
        "scatter_elements_add",
        "ScatterElements",
        {"data": _r(3, 2), "updates": _r(2, 2)},
        {"indices": _i64([[1, 1], [1, 0]])},
        {},
        {"reduction": "add"},
        1,
        18,
    ),
    ("cumsum", "CumSum", {"x": _r(2, 4)}, {}, {"axis": np.array(1)}, {}, 1, 18),
    (
        "cumsum_reverse_exclusive",
        "CumSum",
        {"x": _r(3, 2)},
        {},
        {"axis": np.array(0)},
        {"reverse": 1, "exclusive": 1},
        1,
        18,
    ),
    ("trilu_upper", "Trilu", {"input": _r(2, 3, 4)}, {}, {"k": np.array(1)}, {}, 1, 18),
    ("trilu_lower", "Trilu", {"input": _r(4, 3)}, {}, {}, {"upper": 0}, 1, 18),
    ("topk", "TopK", {"X": _r(3, 5)}, {}, {"K": _i64([2])}, {"axis": 1}, 1, 18),
    ("topk_smallest_axis0", "TopK", {"X": _r(4, 2)}, {}, {"K": _i64([3])}, {"axis": 0, "largest": 0}, 1, 18),
    (
        "conv",
        "Conv",
        {"X": _r(2, 4, 5, 4), "W": _r(6, 2, 3, 2), "B": _r(6)},
        {},
        {},
        {"group": 2, "pads": [1, 0, 1, 1], "strides": [2, 1]},
        1,
        18,
    ),  # more cases: test_conv.py
    ("pad_reflect", "Pad", {"data": _r(3, 4)}, {}, {"pads": _i64([2, 1, 0, 3])}, {"mode": "reflect"}, 1, 18),
    # recurrent layers (more cases, sequence_lens among them, in tests/test_rnn.py)
    (
        "gru_bidirectional_lbr",
        "GRU",
        {"X": _r(3, 2, 2), "W": _r(2, 9, 2), "R": _r(2, 9, 3), "B": _r(2, 18), "initial_h": _r(2, 2, 3)},
        {},
        {},
        {"hidden_size": 3, "direction": "bidirectional", "linear_before_reset": 1},
        2,
        18,
    ),
    (
        "lstm_peepholes",
        "LSTM",
        {
            "X": _r(3, 2, 2),
            "W": _r(1, 12, 2),
            "R": _r(1, 12, 3),
            "B": _r(1, 24),
            "initial_h": _r(1, 2, 3),
            "initial_c": _r(1, 2, 3),
            "P": _r(1, 9),
        },
        {},
        {},
        {"hidden_size": 3},
        3,
        18,
    ),
]
# ONNX's reference evaluator computes these in float32 (its erf, HardSwish's 1/6), so the forward
# values agree to float32 precision only.
FORWARD_RTOL = {"Erf": 1e-6, "HardSwish": 1e-6}
UNUSED_OUTPUTS = {"TopK": 1}  # its Indices: required by the schema, int64 (no gradient)


def _schema_inputs(op_type: str, opset: int) -> list[str]:
    return [f.name for f in onnx.defs.get_schema(op_type, opset).inputs]


def _build(spec) -> tuple[onnx.ModelProto, dict, list[str], list[np.ndarray]]:
    """The model (node + scalarised loss "loss"), its feed, the parameter names, and the node's
    outputs as ONNX's reference evaluator computes them."""
    _, op_type, params, data, consts, attrs, n_out, opset = spec
    inits, names, trainable = [], [], []
    for slot in _schema_inputs(op_type, opset):
        values = params.get(slot, data.get(slot, consts.get(slot)))
        if values is None:
            names.append("")
            continue
        for k, v in enumerate(values if isinstance(values, list) else [values]):
            name = f"{slot}{k}"
            names.append(name)
            if slot not in data:
                inits.append(numpy_helper.from_array(np.asarray(v), name))
            if slot in params:
                trainable.append(name)
    while names and not names[-1]:
        names.pop()
    feed = {f"{slot}0": v for slot, v in data.items()}
    outs = [f"y{k}" for k in range(n_out)]
    extra = [f"unused{k}" for k in range(UNUSED_OUTPUTS.get(op_type, 0))]  # required, not in the loss
    node = helper.make_node(op_type, names, outs + extra, **attrs)
    data_vi = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for n, v in feed.items()
    ]
    probe_outs = [helper.make_empty_tensor_value_info(o) for o in outs]
    probe = helper.make_model(
        helper.make_graph([node], "probe", data_vi, probe_outs, inits),
        opset_imports=[helper.make_opsetid("", opset)],
    )
    ys = ReferenceEvaluator(probe).run(None, feed)
    nodes, terms = [node], []
    for o, y in zip(outs, ys, strict=True):
        feed[f"R_{o}"] = rng.normal(size=y.shape)
        data_vi.append(helper.make_tensor_value_info(f"R_{o}", TensorProto.DOUBLE, y.shape))
        nodes += [
            helper.make_node("Mul", [o, f"R_{o}"], [f"m_{o}"]),
            helper.make_node("ReduceSum", [f"m_{o}"], [f"s_{o}"], keepdims=0),
        ]
        terms.append(f"s_{o}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    graph_outs = [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])] + [
        helper.make_tensor_value_info(o, TensorProto.DOUBLE, y.shape) for o, y in zip(outs, ys, strict=True)
    ]
    model = helper.make_model(
        helper.make_graph(nodes, spec[0], data_vi, graph_outs, inits),
        opset_imports=[helper.make_opsetid("", opset)],
    )
    return model, feed, trainable, ys


def test_every_differentiable_op_has_a_case() -> None:
    differentiable = {t for t in supported_onnx_ops() if by_onnx(t) is not None and by_onnx(t).differentiable}
    assert differentiable - {s[1] for s in SPECS} == set()


def _assert_gradients_match(
    make_program, feed: dict, trainable: list[str], sample: int | None = None
) -> None:
    """append_backward's gradients of the program's loss w.r.t. `trainable` vs central differences;
    `make_program()` gives a fresh copy of the program (with parameter values). `sample` checks that
    many elements per parameter (half the largest analytic gradients, half at random) instead of all."""
    program = make_program()
    loss = program.attrs["loss_name"]
    params_grads = dict(append_backward(program, loss))
    assert sorted(params_grads) == sorted(trainable)
    grads = Executor().run(program, feed=feed, fetch_list=[params_grads[p] for p in trainable])
    forward = make_program()

    def loss_at(name: str, value: np.ndarray) -> float:
        exe = Executor()  # fresh: a training-mode Dropout then draws the same mask every time
        exe.scope[name] = value
        return float(exe.run(forward, feed=feed, fetch_list=[loss])[0])

    eps = 1e-6
    for name, grad in zip(trainable, grads, strict=True):
        grad = grad.to_dense(np) if hasattr(grad, "to_dense") else grad
        base = forward.params[name]
        numeric = np.zeros(base.shape)
        positions = list(np.ndindex(base.shape))
        if sample is not None and len(positions) > sample:
            largest = np.argsort(-np.abs(grad).reshape(-1), kind="stable")[: sample // 2]
            others = np.random.default_rng(0).choice(len(positions), sample - len(largest), replace=False)
            positions = [positions[k] for k in sorted(set(largest) | set(others))]
        for i in positions:
            hi, lo = base.copy(), base.copy()
            hi[i] += eps
            lo[i] -= eps
            numeric[i] = (loss_at(name, hi) - loss_at(name, lo)) / (2 * eps)
        picked = tuple(np.array(positions).T)
        np.testing.assert_allclose(
            grad[picked], numeric[picked], rtol=1e-5, atol=1e-8, err_msg=f"d loss / d {name}"
        )


@pytest.mark.parametrize("spec", SPECS, ids=[s[0] for s in SPECS])
def test_gradient_matches_finite_differences(spec) -> None:
    model, feed, trainable, expected = _build(spec)
    program = from_onnx(model)
    assert program.attrs["loss_name"] == "loss"
    got = Executor().run(program, feed=feed, fetch_list=[o.name for o in model.graph.output])
    if spec[1] != "Dropout":  # a random mask: ours and the evaluator's differ
        for g, e in zip(got[1:], expected, strict=True):  # forward values vs ONNX's reference evaluator
            np.testing.assert_allclose(g, e, rtol=FORWARD_RTOL.get(spec[1], 1e-12), atol=1e-12)
    _assert_gradients_match(lambda: from_onnx(model), feed, trainable)


def _log_sigmoid(z):
    return -np.logaddexp(0, -z)


@pytest.mark.parametrize("loss", LOSSES)
def test_attached_loss_value_and_gradient(loss: str) -> None:
    """from_onnx(model, loss=...) on a forward graph (x @ W + b, then Sigmoid for "bce"): the mean
    loss equals the numpy formula and its gradients match finite differences."""
    x, w, b = _r(5, 3), _r(3, 2), _r(2)
    z = x @ w + b
    y = {"softmax_ce": _i64([0, 1, 1, 0, 1]), "mse": _r(5, 2)}.get(loss, rng.integers(0, 2, (5, 2)) * 1.0)
    if loss == "softmax_ce":
        expected = -np.mean((z - np.logaddexp.reduce(z, axis=1, keepdims=True))[np.arange(5), y])
    elif loss == "mse":
        expected = np.mean((z - y) ** 2)
    else:
        expected = -np.mean(y * _log_sigmoid(z) + (1 - y) * _log_sigmoid(-z))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["z"])]
    if loss == "bce":
        nodes.append(helper.make_node("Sigmoid", ["z"], ["p"]))
    out = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.DOUBLE, [-1, 2])
    graph = helper.make_graph(
        nodes,
        loss,
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [-1, 3])],
        [out],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    program = from_onnx(model, loss=loss, label="y")
    got = Executor().run(program, feed={"x": x, "y": y}, fetch_list=[program.attrs["loss_name"]])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    _assert_gradients_match(lambda: from_onnx(model, loss=loss, label="y"), {"x": x, "y": y}, ["W", "b"])
