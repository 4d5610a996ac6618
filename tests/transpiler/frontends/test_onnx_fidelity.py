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
from transpiler.frontends.onnx.importer import OnnxImportError, OnnxShapeWarning

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
    nodes = [
        _const("w", w),
        _const("one", np.array([1], np.int64)),
        helper.make_node("MatMul", ["x", "w"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["p"]),
        helper.make_node("Sub", ["p", "y"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["m"], keepdims=0),
        helper.make_node("Reshape", ["m", "one"], ["r"]),
        helper.make_node("Identity", ["r"], ["loss"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1]),
    ]
    out = helper.make_tensor_value_info("loss", TensorProto.FLOAT, declared_loss_shape)
    return _model(nodes, inputs, [out], value_info)


def _feed(n: int = 5) -> dict:
    return {
        "x": rng.normal(size=(n, 3)).astype(np.float32),
        "y": rng.integers(0, 2, (n, 1)).astype(np.float32),
    }


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
    nodes = [
        _const("w", rng.normal(size=(3, 1)).astype(np.float32)),
        helper.make_node("MatMul", ["x", "w"], ["z"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 1])],
    )
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


# -- control flow ---------------------------------------------------------------------------------
def _i64(v) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def _float(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _bag_model(
    mode: str, per_sample_weights: bool, dtype=np.float32, rows: int = 7, dim: int = 3, loss: bool = False
) -> tuple[onnx.ModelProto, np.ndarray]:
    """nn.EmbeddingBag as torch's TorchScript exporter writes it (symbolic_helper's
    _embedding_bag_helper, include_last_offset=False, opset 18): offsets completed with len(input),
    a Loop over the bags that Slices the bag's indices, Gathers the rows, multiplies by the per-sample
    weights, and reduces over axis 0. With `loss`, a scalar sum(bags * R) output "loss" (R fed)."""
    w = rng.normal(size=(rows, dim)).astype(dtype)
    body_nodes = [
        _const("b_axes0", _i64([0])),
        helper.make_node("Gather", ["starts", "i"], ["s"], axis=0),
        helper.make_node("Gather", ["ends", "i"], ["e"], axis=0),
        helper.make_node("Unsqueeze", ["s", "b_axes0"], ["s1"]),
        helper.make_node("Unsqueeze", ["e", "b_axes0"], ["e1"]),
        helper.make_node("Slice", ["input", "s1", "e1", "zero"], ["row"]),
        helper.make_node("Gather", ["emb.weight", "row"], ["emb"], axis=0),
    ]
    pooled_in = "emb"
    if per_sample_weights:
        body_nodes += [
            helper.make_node("Slice", ["per_sample_weights", "s1", "e1", "zero"], ["pw"]),
            _const("b_axes1", _i64([1])),
            helper.make_node("Unsqueeze", ["pw", "b_axes1"], ["pw1"]),
            helper.make_node("Mul", ["emb", "pw1"], ["embw"]),
        ]
        pooled_in = "embw"
    reduce_op = {"sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax"}[mode]
    body_nodes += [
        helper.make_node(reduce_op, [pooled_in, "b_axes0"], ["pooled"], keepdims=0),
        helper.make_node("Cast", ["loop_cond"], ["cond_out"], to=TensorProto.BOOL),
    ]
    body = helper.make_graph(
        body_nodes,
        "bag_body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("pooled", _float(dtype), [dim]),
        ],
    )
    nodes = [
        _const("one", np.array(1, np.int64)),
        helper.make_node("Cast", ["one"], ["loop_cond"], to=TensorProto.BOOL),
        _const("zero", _i64([0])),
        _const("c0", np.array(0, np.int64)),
        _const("ax0", _i64([0])),
        _const("big", _i64([2**63 - 1])),
        _const("first", _i64([1])),
        helper.make_node("Shape", ["input"], ["ishape"]),
        helper.make_node("Gather", ["ishape", "c0"], ["ilen_s"], axis=0),
        helper.make_node("Unsqueeze", ["ilen_s", "ax0"], ["ilen"]),
        helper.make_node("Concat", ["offsets", "ilen"], ["offs"], axis=0),
        helper.make_node("Slice", ["offs", "zero", "big", "zero", "first"], ["starts"]),
        helper.make_node("Slice", ["offs", "first", "big", "zero", "first"], ["ends"]),
        helper.make_node("Shape", ["ends"], ["eshape"]),
        helper.make_node("Gather", ["eshape", "c0"], ["loop_len"], axis=0),
        helper.make_node("Loop", ["loop_len", "loop_cond"], ["bags"], name="embedding_bag_loop", body=body),
    ]
    inputs = [
        helper.make_tensor_value_info("input", TensorProto.INT64, ["L"]),
        helper.make_tensor_value_info("offsets", TensorProto.INT64, ["B"]),
    ]
    if per_sample_weights:
        inputs.append(helper.make_tensor_value_info("per_sample_weights", _float(dtype), ["L"]))
    outputs = [helper.make_tensor_value_info("bags", _float(dtype), ["B", dim])]
    if loss:
        inputs.append(helper.make_tensor_value_info("R", _float(dtype), ["B", dim]))
        nodes += [
            helper.make_node("Mul", ["bags", "R"], ["weighted"]),
            helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
        ]
        outputs = [helper.make_tensor_value_info("loss", _float(dtype), []), *outputs]
    graph = helper.make_graph(nodes, "bag", inputs, outputs, [numpy_helper.from_array(w, "emb.weight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), w


def _bag_feed(per_sample_weights: bool, dtype=np.float32, rows: int = 7, bags: int = 4) -> dict:
    lengths = rng.integers(1, 4, bags)
    ids = rng.integers(0, rows, int(lengths.sum()))
    feed = {"input": ids.astype(np.int64), "offsets": (np.cumsum(lengths) - lengths).astype(np.int64)}
    if per_sample_weights:
        feed["per_sample_weights"] = rng.uniform(0.5, 1.5, ids.size).astype(dtype)
    return feed


def _bag_by_hand(w: np.ndarray, feed: dict, mode: str) -> np.ndarray:
    """torch.nn.functional.embedding_bag's definition, bag by bag."""
    ids, offs = feed["input"], list(feed["offsets"]) + [feed["input"].size]
    out = []
    for b in range(len(offs) - 1):
        rows = w[ids[offs[b] : offs[b + 1]]]
        if "per_sample_weights" in feed:
            rows = rows * feed["per_sample_weights"][offs[b] : offs[b + 1], None]
        out.append({"sum": rows.sum(0), "mean": rows.mean(0), "max": rows.max(0)}[mode])
    return np.stack(out)


@pytest.mark.parametrize("mode,weights", [("sum", False), ("mean", False), ("max", False), ("sum", True)])
def test_torch_embedding_bag_loop_becomes_a_pooled_sparse_lookup(mode: str, weights: bool) -> None:
    model, w = _bag_model(mode, weights)
    program = from_onnx(model)
    readers = [op.type for op in program.ops if "emb.weight" in op.input_names()]
    assert readers == ["embedding_bag"] and "loop" not in [op.type for op in program.ops]
    assert program.var("emb.weight").is_sparse  # a parameter-server table candidate
    for bags in (4, 9):  # the batch stays dynamic
        feed = _bag_feed(weights, bags=bags)
        (got,) = Executor().run(program, feed=feed, fetch_list=["bags"])
        np.testing.assert_allclose(got, _ort(model, feed)[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got, _bag_by_hand(w, feed, mode), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode,weights", [("sum", True), ("mean", False), ("max", False)])
def test_embedding_bag_gradient_matches_finite_differences(mode: str, weights: bool) -> None:
    from test_onnx_gradients import _assert_gradients_match

    model, _ = _bag_model(mode, weights, dtype=np.float64, loss=True)
    feed = _bag_feed(weights, dtype=np.float64)
    feed["input"][1] = feed["input"][0]  # a row twice in a bag (a tie for max)
    feed["R"] = rng.normal(size=(feed["offsets"].size, 3))
    trainable = ["emb.weight"]
    if weights:  # the per-sample weights as a parameter, to check their gradient too
        psw = feed.pop("per_sample_weights")
        model.graph.initializer.append(numpy_helper.from_array(psw, "per_sample_weights"))
        model.graph.input.remove(next(i for i in model.graph.input if i.name == "per_sample_weights"))
        trainable.append("per_sample_weights")
    program = from_onnx(model)
    assert program.attrs["loss_name"] == "loss"
    _assert_gradients_match(lambda: from_onnx(model), feed, trainable)


def test_embedding_bag_survives_to_onnx_and_back() -> None:
    """to_onnx writes embedding_bag as an ai.hetps node; from_onnx reads it back as the same op."""
    from transpiler import to_onnx

    model, w = _bag_model("sum", True)
    exported = to_onnx(from_onnx(model))
    assert [n.domain for n in exported.graph.node if n.op_type == "embedding_bag"] == ["ai.hetps"]
    again = from_onnx(exported)
    assert again.var("emb.weight").is_sparse
    feed = _bag_feed(True)
    (got,) = Executor().run(again, feed=feed, fetch_list=["bags"])
    np.testing.assert_allclose(got, _bag_by_hand(w, feed, "sum"), rtol=1e-6, atol=1e-6)


def _if_model(cond_node: onnx.NodeProto, cond_input: bool = False) -> onnx.ModelProto:
    then = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.full((3,), 2.0, np.float32), "c")],
    )
    other = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["f"])],
        "else",
        [],
        [helper.make_tensor_value_info("f", TensorProto.FLOAT, [2, 3])],
    )
    nodes = [
        cond_node,
        helper.make_node("If", ["flag"], ["y"], name="branch", then_branch=then, else_branch=other),
        helper.make_node("Relu", ["y"], ["out"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])]
    if cond_input:
        inputs.append(helper.make_tensor_value_info("n", TensorProto.INT64, []))
    return _model(nodes, inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])])


@pytest.mark.parametrize("flag", [True, False])
def test_if_with_a_constant_condition_is_folded(flag: bool) -> None:
    model = _if_model(_const("flag", np.array(flag)))
    program = from_onnx(model)
    assert "if" not in [op.type for op in program.ops]
    assert [op.type for op in program.ops].count("add" if flag else "mul") == 1
    feed = {"x": rng.normal(size=(2, 3)).astype(np.float32)}
    (got,) = Executor().run(program, feed=feed, fetch_list=["out"])
    np.testing.assert_allclose(got, _ort(model, feed)[0], rtol=1e-6)


def test_if_on_a_static_shape_is_folded() -> None:
    """The condition computed from a statically shaped input (Shape -> Gather -> Equal)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        _const("k", np.array(1, np.int64)),
        helper.make_node("Gather", ["shape", "k"], ["d1"], axis=0),
        _const("three", np.array(3, np.int64)),
        helper.make_node("Equal", ["d1", "three"], ["flag"]),
    ]
    model = _model(
        nodes + list(_if_model(_const("unused", np.array(0))).graph.node)[1:],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])],
    )
    program = from_onnx(model)
    assert "if" not in [op.type for op in program.ops] and "add" in [op.type for op in program.ops]
    feed = {"x": rng.normal(size=(2, 3)).astype(np.float32)}
    np.testing.assert_allclose(
        Executor().run(program, feed=feed, fetch_list=["out"])[0], _ort(model, feed)[0], rtol=1e-6
    )


def test_if_on_data_is_refused_naming_the_node() -> None:
    from transpiler import UnsupportedOnnxOpsError

    model = _if_model(helper.make_node("Greater", ["n", "zero_i"], ["flag"]), cond_input=True)
    model.graph.node.insert(0, _const("zero_i", np.array(0, np.int64)))
    with pytest.raises(
        UnsupportedOnnxOpsError,
        match=r"If: branch \(its condition is not known .* graph input 'n'",
    ):
        from_onnx(model)


def _counting_loop(trips: onnx.NodeProto, dtype=np.float32, n: int | str = 3) -> onnx.ModelProto:
    """v <- tanh(v @ W + iter); every v also a scan output."""
    t = _float(dtype)
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["v_in", "W"], ["vw"]),
            helper.make_node("Cast", ["it"], ["itf"], to=t),
            helper.make_node("Add", ["vw", "itf"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["v_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["v_out"], ["scan"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("it", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", t, ["N", 3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", t, ["N", 3]),
            helper.make_tensor_value_info("scan", t, ["N", 3]),
        ],
    )
    nodes = [
        trips,
        _const("true", np.array(True)),
        helper.make_node("Loop", ["M", "true", "x"], ["v_final", "vs"], name="steps", body=body),
    ]
    w = numpy_helper.from_array((rng.normal(size=(3, 3)) * 0.5).astype(dtype), "W")
    graph = helper.make_graph(
        nodes,
        "loop",
        [helper.make_tensor_value_info("x", t, ["N", 3])],
        [
            helper.make_tensor_value_info("v_final", t, ["N", 3]),
            helper.make_tensor_value_info("vs", t, [n, "N", 3]),
        ],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_loop_with_a_constant_trip_count_is_unrolled() -> None:
    model = _counting_loop(_const("M", np.array(3, np.int64)))
    program = from_onnx(model)
    types = [op.type for op in program.ops]
    assert "loop" not in types and types.count("matmul") == 3
    feed = {"x": rng.normal(size=(5, 3)).astype(np.float32)}
    got = Executor().run(program, feed=feed, fetch_list=["v_final", "vs"])
    for g, r in zip(got, _ort(model, feed), strict=True):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_unrolled_loop_gradient_matches_finite_differences() -> None:
    from test_onnx_gradients import _assert_gradients_match

    model = _counting_loop(_const("M", np.array(2, np.int64)), dtype=np.float64, n=2)
    model.graph.node.extend([helper.make_node("ReduceSum", ["vs"], ["loss"], keepdims=0)])
    model.graph.output.insert(0, helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    feed = {"x": rng.normal(size=(2, 3))}
    _assert_gradients_match(lambda: from_onnx(model), feed, ["W"])


def test_loop_with_a_run_time_trip_count_is_refused_naming_the_node() -> None:
    from transpiler import UnsupportedOnnxOpsError

    model = _counting_loop(helper.make_node("Size", ["x"], ["M"]), n="T")
    with pytest.raises(
        UnsupportedOnnxOpsError,
        match=r"Loop: steps \(its trip count is not known .* graph input 'x'",
    ):
        from_onnx(model)


def test_embedding_bag_model_trains_heterogeneously_like_single_process() -> None:
    """EmbeddingBag -> MatMul -> Sigmoid with a bce loss: transpiled, the bag table is a sparse
    parameter-server table (pulled by rows on the cpu trainer, the MLP on gpu); simulate's losses
    and table values equal single-process SGD computed by hand from append_backward's gradients."""
    from runtime.exec.simulate import InMemoryServer, simulate
    from transpiler import TranspileConfig, append_backward, transpile

    model, _ = _bag_model("mean", False, dtype=np.float64)
    w2 = numpy_helper.from_array(rng.normal(size=(3, 1)), "w2")
    model.graph.initializer.append(w2)
    model.graph.node.extend(
        [helper.make_node("MatMul", ["bags", "w2"], ["z"]), helper.make_node("Sigmoid", ["z"], ["p"])]
    )
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("p", TensorProto.DOUBLE, ["B", 1]))
    feed = _bag_feed(False, bags=5)
    feed["label"] = np.array([[1.0], [0.0], [1.0], [1.0], [0.0]])
    batches = [feed] * 6  # one batch again and again: the loss must drop
    lr = 0.5
    plan = transpile(from_onnx(model, loss="bce"), TranspileConfig(optimizer={"type": "sgd", "lr": lr}))
    kinds = {t.name: t.kind for t in plan.tables}
    assert kinds["emb.weight"] == "sparse" and kinds["w2"] == "dense"
    server = InMemoryServer(plan)
    got = [float(x[0]) for x in simulate(plan, batches, server=server)]

    program = from_onnx(model, loss="bce")
    params_grads = append_backward(program, program.attrs["loss_name"])
    exe, want = Executor(), []
    for batch in batches:
        fetch = [program.attrs["loss_name"]] + [g for _, g in params_grads]
        out = exe.run(program, feed=batch, fetch_list=fetch)
        want.append(float(out[0]))
        for (p, _), g in zip(params_grads, out[1:], strict=True):
            exe.scope[p] -= lr * (g.to_dense(np) if hasattr(g, "to_dense") else g)
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert want[-1] < want[0]
    np.testing.assert_allclose(server.value("emb.weight"), exe.scope["emb.weight"], rtol=1e-9)


def test_scalar_initializers_are_constants_not_parameters() -> None:
    """torch's dynamo exporter stores scalar constants (a Pow's exponent, a mask's -1e9) as 0-d
    initializers; training them (as parameters) made DeepFM's loss NaN. A [1] bias stays a parameter."""
    nodes = [helper.make_node("Add", ["x", "b"], ["xb"]), helper.make_node("Pow", ["xb", "two"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [
            numpy_helper.from_array(np.float32(2.0).reshape(()), "two"),
            numpy_helper.from_array(np.array([0.5], np.float32), "b"),
        ],
    )
    program = from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert [v.name for v in program.parameters()] == ["b"]
    assert not program.var("two").trainable and "two" not in program.params  # a constant op's output
    assert [op.attrs["value"] for op in program.ops if op.type == "constant"] == [2.0]


def test_if_on_a_deep_data_chain_is_refused_without_recursion() -> None:
    """The condition's ancestry walked iteratively: a 3000-node chain from the input (deeper than
    Python's recursion limit) is found not static and refused by name."""
    from transpiler import UnsupportedOnnxOpsError

    chain = [helper.make_node("Neg", [f"v{k}"], [f"v{k + 1}"]) for k in range(3000)]
    chain[0].input[0] = "n"
    model = _if_model(helper.make_node("Greater", ["v3000", "zero_i"], ["flag"]), cond_input=True)
    for node in reversed([_const("zero_i", np.array(0, np.int64)), *chain]):
        model.graph.node.insert(0, node)
    with pytest.raises(UnsupportedOnnxOpsError, match=r"If: branch \(.*depends on graph input 'n'"):
        from_onnx(model)


def test_gather_nd_row_lookups_become_sparse_embedding_tables() -> None:
    """paddle2onnx writes index lookups as GatherND: with indices [..., 1] they read whole rows of a
    table, which then imports as an embedding lookup of a sparse table; values equal onnxruntime's,
    the gradient equals finite differences."""
    from test_onnx_gradients import _assert_gradients_match

    table = rng.normal(size=(9, 3))
    nodes = [
        helper.make_node("GatherND", ["table", "ids"], ["rows"]),
        helper.make_node("Mul", ["rows", "R"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
    ]
    inputs = [
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 2, 1]),
        helper.make_tensor_value_info("R", TensorProto.DOUBLE, ["N", 2, 3]),
    ]
    outputs = [
        helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []),
        helper.make_tensor_value_info("rows", TensorProto.DOUBLE, ["N", 2, 3]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    program = from_onnx(model)
    assert [op.type for op in program.ops if "table" in op.input_names()] == ["embedding"]
    assert program.var("table").is_sparse
    feed = {"ids": rng.integers(0, 9, (4, 2, 1)), "R": rng.normal(size=(4, 2, 3))}
    got = Executor().run(program, feed=feed, fetch_list=["loss", "rows"])
    for g, want in zip(got, _ort(model, feed), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-12)
    _assert_gradients_match(lambda: from_onnx(model), feed, ["table"])


def test_paddle2onnx_scalar_loss_model_imports_runs_and_trains() -> None:
    """A real paddle2onnx export (tests/models/exporters/export_paddle.py) whose output is its mean
    loss: declared [], computed by a Reshape to [-1] (ONNX's inference: [?]; at run time [1]). The
    import warns once naming the output, finds the loss, equals onnxruntime, and trains."""
    from pathlib import Path

    from runtime.exec.simulate import simulate
    from transpiler import TranspileConfig, transpile

    path = Path(__file__).resolve().parents[2] / "models" / "p2o_scalar_loss.onnx"
    assert [d.dim_value for d in onnx.load(path).graph.output[0].type.tensor_type.shape.dim] == []
    with pytest.warns(OnnxShapeWarning) as record:
        program = from_onnx(path)
    assert len(record) == 1 and "'fetch_name_0'" in str(record[0].message)
    assert program.var("fetch_name_0").shape == (1,) and program.attrs["loss_name"] == "fetch_name_0"
    feed = {
        "sparse": rng.integers(0, 40, (6, 3)),
        "dense": rng.normal(size=(6, 4)).astype(np.float32),
        "label": rng.integers(0, 2, (6, 1)).astype(np.float32),
    }
    (got,) = Executor().run(program, feed=feed, fetch_list=program.fetch_names)
    np.testing.assert_allclose(got, _ort(onnx.load(path), feed)[0], rtol=1e-6)
    plan = transpile(program, TranspileConfig(optimizer={"type": "sgd", "lr": 0.5}))
    losses = [x[0].item() for x in simulate(plan, [feed] * 8)]  # the loss is [1]
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.slow
def test_paddle2onnx_scalar_loss_model_trains_on_the_real_runtime() -> None:
    """Its loss has shape [1]: the trainers report it as a number (float() of a [1] array is an
    error in numpy 2.4); the losses equal simulate's."""
    from pathlib import Path

    from runtime.driver.train import train
    from runtime.exec.simulate import simulate
    from transpiler import TranspileConfig, transpile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OnnxShapeWarning)
        program = from_onnx(Path(__file__).resolve().parents[2] / "models" / "p2o_scalar_loss.onnx")
    plan = transpile(program, TranspileConfig(optimizer={"type": "sgd", "lr": 0.5}))
    feed = {
        "sparse": rng.integers(0, 40, (16, 3)),
        "dense": rng.normal(size=(16, 4)).astype(np.float32),
        "label": rng.integers(0, 2, (16, 1)).astype(np.float32),
    }
    hist = train(
        plan, [feed] * 4, epochs=1, trainers={"cpu": 1, "gpu": 1}, allow_emulation=True, progress=False
    )
    np.testing.assert_allclose(hist.loss, [x[0].item() for x in simulate(plan, [feed] * 4)], rtol=1e-5)
