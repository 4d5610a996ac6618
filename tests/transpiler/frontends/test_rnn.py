"""ONNX GRU and LSTM (ops_registry/rnn.py) against independent references.

1. Forward: single-node models built with onnx.helper, run by from_onnx + Executor and by
   onnxruntime, over directions x sequence_lens (absent / ragged, with an empty sequence) x
   initial states x linear_before_reset (GRU) or peepholes (LSTM) x bias; float32, 1e-5; `clip`,
   LSTM `input_forget`. Layout 1 (which onnxruntime refuses) against the same weights at layout 0;
   output subsets.
2. Gradients of every float input (X, W, R, B, initial_h, initial_c, P) of float64 models against
   central finite differences (tests/test_onnx_gradients.py's helper), the loss any subset of
   Y / Y_h / Y_c.
3. A DIEN-style model (embedding lookups, a GRU over the behaviour sequence, attention scores over
   its states, a second GRU over the attention-weighted states, an MLP, a sigmoid): its forward
   equals onnxruntime's, its gradients finite differences, and it trains transpiled and simulated
   (the lookups on cpu, the GRUs on gpu) with the loss going down.

ONNX's own GRU / LSTM node cases run in tests/test_onnx_conformance.py (it takes every case whose
ops are covered).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_onnx_gradients import _assert_gradients_match

from ops_registry import get_op
from runtime import Executor
from runtime.exec.device import cuda_available
from runtime.exec.simulate import simulate
from transpiler import TranspileConfig, from_onnx, transpile

T, B, IN, H = 5, 4, 3, 2
LENS = np.array([5, 2, 0, 3], dtype=np.int32)  # ragged, one sequence empty
SLOTS = {
    "GRU": ("X", "W", "R", "B", "sequence_lens", "initial_h"),
    "LSTM": ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"),
}
OUTS = {"GRU": ("Y", "Y_h"), "LSTM": ("Y", "Y_h", "Y_c")}


def _values(
    op: str,
    *,
    direction: str,
    lens: bool,
    init: bool,
    bias: bool,
    peep: bool = False,
    layout: int = 0,
    dtype=np.float32,
    seed: int = 0,
    steps: int = T,
    batch: int = B,
) -> dict:
    """Random inputs of one GRU / LSTM node, by slot (absent optional inputs left out)."""
    rng = np.random.default_rng(seed)
    d, g = (2 if direction == "bidirectional" else 1), (3 if op == "GRU" else 4)

    def r(*shape):
        return rng.uniform(-1, 1, shape).astype(dtype)

    v = {
        "X": r(steps, batch, IN) if layout == 0 else r(batch, steps, IN),
        "W": r(d, g * H, IN),
        "R": r(d, g * H, H),
    }
    if bias:
        v["B"] = r(d, 2 * g * H)
    if lens:
        v["sequence_lens"] = LENS[:batch] if steps == T else np.minimum(LENS[:batch], steps)
    state = (d, batch, H) if layout == 0 else (batch, d, H)
    if init:
        v["initial_h"] = r(*state)
        if op == "LSTM":
            v["initial_c"] = r(*state)
    if peep:
        v["P"] = r(d, 3 * H)
    return v


def _node(op: str, values: dict, attrs: dict, outputs) -> onnx.NodeProto:
    names = [s if s in values else "" for s in SLOTS[op]]
    while not names[-1]:
        names.pop()
    return helper.make_node(op, names, list(outputs), name=op.lower(), hidden_size=H, **attrs)


def _vi(name: str, a: np.ndarray) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)


def _model(op: str, values: dict, attrs: dict, outputs=None, inits: tuple = ()) -> onnx.ModelProto:
    """One node; `inits`: the slots stored as initializers (trainable parameters), the rest fed."""
    outputs = list(outputs or OUTS[op])
    node = _node(op, values, attrs, outputs)
    ort_outs = _ort_shapes(op, values, attrs)
    graph = helper.make_graph(
        [node],
        op,
        [_vi(k, a) for k, a in values.items() if k not in inits],
        [
            helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(values["X"].dtype), ort_outs[o])
            for o in outputs
            if o
        ],
        [numpy_helper.from_array(values[k], k) for k in inits],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _ort_shapes(op: str, values: dict, attrs: dict) -> dict:
    d = 2 if attrs.get("direction") == "bidirectional" else 1
    x = values["X"].shape
    if attrs.get("layout", 0):
        return {"Y": [x[0], x[1], d, H], "Y_h": [x[0], d, H], "Y_c": [x[0], d, H]}
    return {"Y": [x[0], d, x[1], H], "Y_h": [d, x[1], H], "Y_c": [d, x[1], H]}


def _ort(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def _ours(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    program = from_onnx(model, dynamic_batch=False)
    return Executor().run(program, feed=feed, fetch_list=[o.name for o in model.graph.output])


DIRECTIONS = ("forward", "reverse", "bidirectional")
GRU_GRID = list(itertools.product(DIRECTIONS, (False, True), (False, True), (0, 1), (False, True)))
LSTM_GRID = list(itertools.product(DIRECTIONS, (False, True), (False, True), (False, True), (False, True)))


def _grid_id(p) -> str:
    d, lens, init, x, bias = p
    return f"{d}-{'lens' if lens else 'full'}-{'h0' if init else 'zero'}-{x}-{'B' if bias else 'noB'}"


@pytest.mark.parametrize("p", GRU_GRID, ids=[_grid_id(p) for p in GRU_GRID])
def test_gru_forward_equals_onnxruntime(p) -> None:
    direction, lens, init, lbr, bias = p
    v = _values("GRU", direction=direction, lens=lens, init=init, bias=bias, seed=len(GRU_GRID))
    model = _model("GRU", v, {"direction": direction, "linear_before_reset": lbr})
    got = _ours(model, v)
    for g, want in zip(got, _ort(model, v), strict=True):
        assert g.shape == want.shape and g.dtype == want.dtype
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
    if lens:  # nothing past a sequence's length (2 for sequence 1, 0 for sequence 2)
        assert not got[0][2:, :, 1].any() and not got[0][:, :, 2].any() and not got[1][:, 2].any()


@pytest.mark.parametrize("p", LSTM_GRID, ids=[_grid_id(p) for p in LSTM_GRID])
def test_lstm_forward_equals_onnxruntime(p) -> None:
    direction, lens, init, peep, bias = p
    v = _values("LSTM", direction=direction, lens=lens, init=init, bias=bias, peep=peep, seed=3)
    model = _model("LSTM", v, {"direction": direction})
    for got, want in zip(_ours(model, v), _ort(model, v), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


SUBSETS = [
    ("GRU", ("", "Y_h")),
    ("GRU", ("Y",)),
    ("LSTM", ("", "Y_h")),
    ("LSTM", ("Y",)),
    ("LSTM", ("", "", "Y_c")),
    ("LSTM", ("", "Y_h", "Y_c")),
]


@pytest.mark.parametrize("op,outputs", SUBSETS)
def test_output_subsets(op: str, outputs) -> None:
    v = _values(op, direction="bidirectional", lens=True, init=True, bias=True, seed=5)
    attrs = {"direction": "bidirectional"}
    model = _model(op, v, attrs, outputs)
    full = dict(zip(OUTS[op], _ort(_model(op, v, attrs), v), strict=True))
    got = _ours(model, v)
    assert len(got) == len([o for o in outputs if o])
    for name, g in zip([o for o in outputs if o], got, strict=True):
        np.testing.assert_allclose(g, full[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_layout_1_is_layout_0_transposed(op: str, direction: str) -> None:
    """onnxruntime refuses layout 1; the same weights at layout 0 (checked above) are the reference."""
    v = _values(op, direction=direction, lens=True, init=True, bias=True, layout=1, peep=op == "LSTM")
    v0 = dict(v, X=v["X"].swapaxes(0, 1))
    for s in ("initial_h", "initial_c"):
        if s in v:
            v0[s] = v[s].swapaxes(0, 1)
    extra = {"linear_before_reset": 1} if op == "GRU" else {}
    got = _ours(_model(op, v, {"direction": direction, "layout": 1, **extra}), v)
    want = _ort(_model(op, v0, {"direction": direction, **extra}), v0)
    np.testing.assert_allclose(got[0], want[0].transpose(2, 0, 1, 3), rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(g, w.swapaxes(0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "op,attrs,named",
    [
        ("GRU", {"activations": ["Relu", "Tanh"]}, "activations"),
        ("LSTM", {"activations": ["Sigmoid", "Tanh", "Relu"]}, "activations"),
        ("GRU", {"clip": -1.0}, "clip"),
        (
            "LSTM",
            {
                "activations": ["Sigmoid", "Tanh", "Tanh", "Sigmoid", "Tanh", "Relu"],
                "direction": "bidirectional",
            },
            "activations",
        ),
    ],
)
def test_unimplemented_attributes_are_refused_by_name(op: str, attrs: dict, named: str) -> None:
    v = _values(op, direction="forward", lens=False, init=False, bias=True)
    with pytest.raises(Exception, match=named):
        _ours(_model(op, v, attrs), v)


@pytest.mark.parametrize(
    "op,direction,lbr",
    [("GRU", d, lbr) for d in DIRECTIONS for lbr in (0, 1)] + [("LSTM", d, 0) for d in DIRECTIONS],
)
def test_clip_equals_onnxruntime(op: str, direction: str, lbr: int) -> None:
    v = _values(op, direction=direction, lens=True, init=True, bias=True, peep=op == "LSTM", seed=9)
    attrs = {"direction": direction, "clip": 0.4, **({"linear_before_reset": lbr} if op == "GRU" else {})}
    model = _model(op, v, attrs)
    got, want = _ours(model, v), _ort(model, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    unclipped = _ours(_model(op, v, {k: a for k, a in attrs.items() if k != "clip"}), v)
    assert np.abs(unclipped[0] - got[0]).max() > 1e-2  # the bound was reached


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_lstm_input_forget_equals_onnxruntime(direction: str) -> None:
    v = _values("LSTM", direction=direction, lens=True, init=True, bias=True, peep=True, seed=10)
    model = _model("LSTM", v, {"direction": direction, "input_forget": 1})
    got, want = _ours(model, v), _ort(model, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert np.abs(_ours(_model("LSTM", v, {"direction": direction}), v)[0] - got[0]).max() > 1e-2


def test_default_activations_spelled_out_are_accepted() -> None:
    v = _values("LSTM", direction="bidirectional", lens=False, init=False, bias=False)
    attrs = {"direction": "bidirectional", "activations": ["Sigmoid", "Tanh", "Tanh"] * 2}
    model = _model("LSTM", v, attrs)
    np.testing.assert_allclose(_ours(model, v)[0], _ort(model, v)[0], rtol=1e-5, atol=1e-6)


# -- gradients --------------------------------------------------------------------------------------
def _loss_model(op: str, values: dict, attrs: dict, outputs) -> tuple[onnx.ModelProto, dict, list[str]]:
    """The node with its float inputs as initializers and loss = sum_k sum(out_k * R_k) over the
    outputs used; (model, feed, trainable names)."""
    inits = tuple(k for k in values if k != "sequence_lens")
    base = _model(op, values, attrs, outputs, inits)
    feed = {k: a for k, a in values.items() if k not in inits}
    ys = _ours(base, feed)
    rng = np.random.default_rng(11)
    nodes, terms = list(base.graph.node), []
    for o, y in zip([o for o in outputs if o], ys, strict=True):
        feed[f"R_{o}"] = rng.normal(size=y.shape)
        nodes += [
            helper.make_node("Mul", [o, f"R_{o}"], [f"m_{o}"]),
            helper.make_node("ReduceSum", [f"m_{o}"], [f"s_{o}"], keepdims=0),
        ]
        terms.append(f"s_{o}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    inputs = list(base.graph.input) + [_vi(f"R_{o}", feed[f"R_{o}"]) for o in outputs if o]
    loss = helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])
    graph = helper.make_graph(nodes, op, inputs, [loss], list(base.graph.initializer))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), feed, list(inits)


GRAD_CASES = [
    *[
        ("GRU", d, lens, {"linear_before_reset": lbr}, ("Y", "Y_h"), 0)
        for d in DIRECTIONS
        for lens in (False, True)
        for lbr in (0, 1)
    ],
    *[("LSTM", d, lens, {}, ("Y", "Y_h", "Y_c"), 0) for d in DIRECTIONS for lens in (False, True)],
    ("GRU", "bidirectional", True, {}, ("", "Y_h"), 0),
    ("GRU", "reverse", True, {"linear_before_reset": 1}, ("Y",), 1),
    ("LSTM", "bidirectional", True, {}, ("", "", "Y_c"), 0),
    ("LSTM", "reverse", True, {}, ("", "Y_h"), 1),
    ("GRU", "bidirectional", True, {"clip": 0.6}, ("Y", "Y_h"), 0),
    ("GRU", "forward", True, {"clip": 0.6, "linear_before_reset": 1}, ("Y", "Y_h"), 0),
    ("LSTM", "bidirectional", True, {"clip": 0.6}, ("Y", "Y_h", "Y_c"), 0),
    ("LSTM", "bidirectional", True, {"input_forget": 1}, ("Y", "Y_h", "Y_c"), 0),
    ("LSTM", "forward", True, {"input_forget": 1, "clip": 0.6}, ("Y", "", "Y_c"), 0),
]


def _grad_id(c) -> str:
    lbr = "".join(f"{k}-" for k in ("linear_before_reset", "clip", "input_forget") if c[3].get(k))
    return f"{c[0]}-{c[1]}-{'lens' if c[2] else 'full'}-{lbr}{'+'.join(o for o in c[4] if o)}-layout{c[5]}"


@pytest.mark.parametrize("case", GRAD_CASES, ids=_grad_id)
def test_gradients_match_finite_differences(case) -> None:
    op, direction, lens, extra, outputs, layout = case
    v = _values(
        op,
        direction=direction,
        lens=lens,
        init=True,
        bias=True,
        peep=op == "LSTM",
        layout=layout,
        dtype=np.float64,
        seed=13,
        steps=4,
        batch=3,
    )
    model, feed, trainable = _loss_model(op, v, {"direction": direction, "layout": layout, **extra}, outputs)
    if layout == 0:  # the float64 forward is onnxruntime's float32 one to float32 precision
        v32 = {k: a.astype(np.float32) if a.dtype == np.float64 else a for k, a in v.items()}
        want = _ort(_model(op, v32, {"direction": direction, **extra}), v32)
        for g, w in zip(_ours(_model(op, v, {"direction": direction, **extra}), v), want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    _assert_gradients_match(lambda: from_onnx(model, dynamic_batch=False), feed, trainable)


def test_two_nodes_omitting_y_get_distinct_hidden_outputs() -> None:
    """The gradient needs each node's Y even when the graph omits it: two such nodes must not share
    one name for it."""
    v = _values("GRU", direction="forward", lens=True, init=False, bias=True, seed=7)
    nodes = [_node("GRU", v, {}, ["", "h1"]), _node("GRU", v, {}, ["", "h2"])]
    nodes[1].name = "gru2"
    nodes.append(helper.make_node("Add", ["h1", "h2"], ["s"]))
    graph = helper.make_graph(
        nodes,
        "two",
        [_vi(k, a) for k, a in v.items()],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, B, H])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    program = from_onnx(model, dynamic_batch=False)
    ys = [op.outputs["Y"][0] for op in program.global_block().ops if op.type == "gru"]
    assert len(set(ys)) == 2, ys
    np.testing.assert_allclose(_ours(model, v)[0], _ort(model, v)[0], rtol=1e-5, atol=1e-6)


# -- a DIEN-style model -----------------------------------------------------------------------------
VOCAB, DIM, SEQ, HID, DENSE = 30, 4, 6, 5, 3


def _dien(dtype=np.float32, seed: int = 0) -> onnx.ModelProto:
    """DIEN's shape, in ONNX: behaviour ids [N, SEQ] and a target id [N] looked up in one table; a
    GRU over the behaviour sequence (sequence_lens = the history's lengths); attention scores of its
    states against the projected target, masked softmax over the sequence; a second GRU (reverse,
    linear_before_reset, as torch exports nn.GRU) over the attention-weighted states, its last state
    only (AIGRU); an MLP over [that state, the target, dense features]; a sigmoid -> prob [N, 1]."""
    rng = np.random.default_rng(seed)

    def p(name, *shape, scale=0.5):
        return numpy_helper.from_array((rng.normal(size=shape) * scale).astype(dtype), name)

    def c(name, values):
        return numpy_helper.from_array(np.array(values, dtype=np.int64), name)

    n = helper.make_node
    nodes = [
        n("Gather", ["emb", "hist"], ["he"]),
        n("Gather", ["emb", "target"], ["te"]),
        n("Transpose", ["he"], ["x1"], perm=[1, 0, 2]),
        n("GRU", ["x1", "W1", "R1", "B1", "hist_len"], ["y1", ""], hidden_size=HID, name="interest"),
        n("Squeeze", ["y1", "axis1"], ["s1"]),  # [SEQ, N, HID]
        n("MatMul", ["te", "Wq"], ["q"]),  # [N, HID]
        n("Mul", ["s1", "q"], ["sq"]),
        n("ReduceSum", ["sq", "axis2"], ["score"], keepdims=0),
        n("Transpose", ["score"], ["score_t"], perm=[1, 0]),  # [N, SEQ]
        n("Sub", ["mask", "one"], ["neg"]),
        n("Mul", ["neg", "big"], ["pen"]),
        n("Add", ["score_t", "pen"], ["masked"]),
        n("Softmax", ["masked"], ["att"], axis=1),
        n("Transpose", ["att"], ["att_t"], perm=[1, 0]),
        n("Unsqueeze", ["att_t", "axis2"], ["att3"]),
        n("Mul", ["s1", "att3"], ["x2"]),
        n(
            "GRU",
            ["x2", "W2", "R2", "B2", "hist_len"],
            ["", "h2"],
            hidden_size=HID,
            direction="reverse",
            linear_before_reset=1,
            name="evolution",
        ),
        n("Squeeze", ["h2", "axis0"], ["final"]),
        n("Concat", ["final", "te", "dense"], ["feat"], axis=1),
        n("Gemm", ["feat", "M1", "c1"], ["m1"]),
        n("Relu", ["m1"], ["a1"]),
        n("Gemm", ["a1", "M2", "c2"], ["logit"]),
        n("Sigmoid", ["logit"], ["prob"]),
    ]
    inits = [
        p("emb", VOCAB, DIM),
        p("W1", 1, 3 * HID, DIM),
        p("R1", 1, 3 * HID, HID),
        p("B1", 1, 6 * HID),
        p("Wq", DIM, HID),
        p("W2", 1, 3 * HID, HID),
        p("R2", 1, 3 * HID, HID),
        p("B2", 1, 6 * HID),
        p("M1", HID + DIM + DENSE, 8),
        p("c1", 8),
        p("M2", 8, 1),
        p("c2", 1),
        c("axis0", [0]),
        c("axis1", [1]),
        c("axis2", [2]),
        numpy_helper.from_array(np.array(1.0, dtype), "one"),
        numpy_helper.from_array(np.array(1e4, dtype), "big"),
    ]
    ft = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [
        helper.make_tensor_value_info("hist", TensorProto.INT64, ["N", SEQ]),
        helper.make_tensor_value_info("hist_len", TensorProto.INT32, ["N"]),
        helper.make_tensor_value_info("mask", ft, ["N", SEQ]),
        helper.make_tensor_value_info("target", TensorProto.INT64, ["N"]),
        helper.make_tensor_value_info("dense", ft, ["N", DENSE]),
    ]
    graph = helper.make_graph(
        nodes, "dien", inputs, [helper.make_tensor_value_info("prob", ft, ["N", 1])], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _dien_feed(batch: int, seed: int, dtype=np.float32) -> dict:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, SEQ + 1, batch).astype(np.int32)
    return {
        "hist": rng.integers(0, VOCAB, (batch, SEQ)),
        "hist_len": lens,
        "mask": (np.arange(SEQ) < lens[:, None]).astype(dtype),
        "target": rng.integers(0, VOCAB, batch),
        "dense": rng.normal(size=(batch, DENSE)).astype(dtype),
    }


def test_dien_forward_equals_onnxruntime() -> None:
    model = _dien()
    onnx.checker.check_model(model, full_check=True)
    program = from_onnx(model)
    assert {op.type for op in program.global_block().ops} >= {"gru", "embedding"}
    feed = _dien_feed(7, seed=1)
    (got,) = Executor().run(program, feed=feed, fetch_list=program.fetch_names)
    (want,) = _ort(model, feed)
    assert got.shape == want.shape == (7, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dien_gradients_match_finite_differences() -> None:
    model = _dien(np.float64)
    feed = _dien_feed(5, seed=2, dtype=np.float64)
    feed["label"] = np.random.default_rng(3).integers(0, 2, (5, 1)).astype(np.float64)
    program = from_onnx(model, loss="bce")
    trainable = [v.name for v in program.parameters() if v.trainable]
    assert {"emb", "W1", "R1", "B1", "W2", "R2", "B2", "Wq"} <= set(trainable)
    _assert_gradients_match(lambda: from_onnx(model, loss="bce"), feed, trainable, sample=10)


def test_dien_trains_heterogeneously() -> None:
    """Transpiled (the table on a parameter server, its lookups on cpu, the GRUs and the MLP on gpu)
    and simulated: the loss goes down."""
    plan = transpile(from_onnx(_dien(), loss="bce"), TranspileConfig(optimizer={"type": "sgd", "lr": 0.3}))
    assert {"cpu", "gpu"} <= set(plan.programs)
    assert [t.name for t in plan.tables if t.kind == "sparse"] == ["emb"]
    gru_devices = {op.device for op in plan.programs["gpu"].global_block().ops if op.type.startswith("gru")}
    assert gru_devices == {"gpu"}
    assert not any(op.type.startswith("gru") for op in plan.programs["cpu"].global_block().ops)
    feed = _dien_feed(16, seed=4)
    feed["label"] = np.random.default_rng(5).integers(0, 2, (16, 1)).astype(np.float32)
    losses = [float(x[0]) for x in simulate(plan, [feed] * 15)]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.skipif(not cuda_available(), reason="no CUDA device (cupy)")
@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_kernels_on_cupy_match_numpy(op: str) -> None:
    """The forward and gradient kernels on cupy (the gpu trainers' namespace) equal numpy's."""
    import cupy

    v = _values(op, direction="bidirectional", lens=True, init=True, bias=True, peep=op == "LSTM")
    opdef, grad = get_op(op.lower()), get_op(f"{op.lower()}_grad")
    attrs = {**opdef.attrs, "direction": "bidirectional", "linear_before_reset": 1}
    outs = opdef.kernel(np, dict(v), attrs)
    rng = np.random.default_rng(1)
    gins = {
        **v,
        **{f"{s}@OUT": a for s, a in outs.items()},
        **{f"{s}@GRAD": rng.normal(size=a.shape).astype(np.float32) for s, a in outs.items()},
    }
    for kernel, ins in ((opdef.kernel, v), (grad.kernel, gins)):
        want = kernel(np, dict(ins), attrs)
        got = kernel(cupy, {k: cupy.asarray(a) for k, a in ins.items()}, attrs)
        assert sorted(got) == sorted(want)
        for slot, w in want.items():
            np.testing.assert_allclose(cupy.asnumpy(got[slot]), w, rtol=1e-4, atol=1e-5, err_msg=slot)
