"""The stable evaluation of a binary cross-entropy written as raw ops (on by default in from_onnx):
`Log(Sigmoid(z))` -> `-Softplus(-z)`, `Log(1 - Sigmoid(z))` -> `-Softplus(z)`.

References are independent of hetps: onnxruntime on the graph as written (moderate inputs), the
float64 truth written here by hand (log-sigmoid as min(z, 0) - log1p(exp(-|z|)), its gradient
sigmoid(z) - y) on saturated inputs where onnxruntime gives -inf / NaN, central differences.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from assets import MODELS
from onnx import helper, numpy_helper
from test_onnx_gradients import _assert_gradients_match
from test_onnx_models import _ctr_feed, _ort, _to_float64

from runtime import Executor
from runtime.cli.app import main
from runtime.telemetry.outputs import read_metrics
from transpiler import append_backward, from_onnx
from transpiler.frontends.onnx.loss import stable_logs, unclamped_logs

TORCH = MODELS / "widedeep_bce_ts.onnx"
N, K = 8, 3
# how the graph writes the `1` of `1 - Sigmoid(z)`, and whether the Logs read the Sigmoid through an Identity
ONES = {
    "constant_scalar": ("constant", ()),  # torch's TorchScript export
    "initializer_scalar": ("initializer", ()),
    "initializer_broadcast": ("initializer", (1, 1)),
    "initializer_rank3": ("initializer", (1, 1, 1)),  # Sub's output is [1, N, 1]
    "identity": ("identity", ()),
}


def bce_graph(ones: str, dtype: type = np.float32) -> onnx.ModelProto:
    """loss = -mean(y * Log(Sigmoid(z)) + (1 - y) * Log(1 - Sigmoid(z))), z = x @ W (W trainable)."""
    kind, shape = ONES[ones]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    one = numpy_helper.from_array(np.ones(shape, dtype), "one")
    w = numpy_helper.from_array(np.random.default_rng(0).uniform(-1, 1, (K, 1)).astype(dtype), "W")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["p"]),
        helper.make_node("Identity", ["p"], ["p_id"]),
        helper.make_node("Log", ["p_id" if kind == "identity" else "p"], ["log_p"]),
        helper.make_node("Sub", ["one", "p"], ["q"]),
        helper.make_node("Log", ["q"], ["log_q"]),
        helper.make_node("Sub", ["one", "y"], ["ny"]),
        helper.make_node("Mul", ["y", "log_p"], ["a"]),
        helper.make_node("Mul", ["ny", "log_q"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Neg", ["s"], ["n"]),
        helper.make_node("ReduceMean", ["n"], ["loss"], keepdims=0),
    ]
    inits = [w]
    if kind == "constant":
        nodes.insert(0, helper.make_node("Constant", [], ["one"], value=one))
    else:
        inits.append(one)
    graph = helper.make_graph(
        nodes,
        "bce",
        [
            helper.make_tensor_value_info("x", elem, ["N", K]),
            helper.make_tensor_value_info("y", elem, ["N", 1]),
        ],
        [helper.make_tensor_value_info("loss", elem, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feed(scale: float, dtype: type = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "x": (rng.uniform(-1, 1, (N, K)) * scale).astype(dtype),
        "y": rng.integers(0, 2, (N, 1)).astype(dtype),
    }


def truth(model: onnx.ModelProto, f: dict) -> tuple[float, np.ndarray]:
    """(the BCE, d BCE / d W) in float64, by hand."""
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W")).astype(np.float64)
    x, y = f["x"].astype(np.float64), f["y"].astype(np.float64)
    z = x @ w

    def log_sigmoid(v):
        return np.minimum(v, 0) - np.log1p(np.exp(-np.abs(v)))

    loss = -np.mean(y * log_sigmoid(z) + (1 - y) * log_sigmoid(-z))
    p = np.where(z >= 0, 1 / (1 + np.exp(-np.abs(z))), np.exp(-np.abs(z)) / (1 + np.exp(-np.abs(z))))
    return float(loss), x.T @ (p - y) / len(y)


def ort_loss(model: onnx.ModelProto, f: dict) -> float:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return float(sess.run(["loss"], f)[0])


@pytest.mark.parametrize("ones", sorted(ONES))
def test_both_logs_are_rewritten_and_equal_onnxruntime_on_moderate_inputs(ones):
    model = bce_graph(ones)
    _, done = stable_logs(model, "loss")
    assert [d.pattern for d in done] == ["log(sigmoid(z))", "log(1 - sigmoid(z))"]
    f = feed(2.0)
    (got,) = Executor().run(from_onnx(model), feed=f, fetch_list=["loss"])
    assert float(got) == pytest.approx(ort_loss(model, f), rel=1e-6)


@pytest.mark.parametrize("ones", sorted(ONES))
def test_saturated_logits_give_the_float64_truth_where_onnxruntime_gives_inf_or_nan(ones):
    model = bce_graph(ones)
    f = feed(300.0)  # logits of hundreds: float32 sigmoid is exactly 0 or 1
    assert not np.isfinite(ort_loss(model, f))
    want_loss, want_grad = truth(model, f)
    program = from_onnx(model)
    grads = dict(append_backward(program, "loss"))
    got_loss, got_grad = Executor().run(program, feed=f, fetch_list=["loss", grads["W"]])
    assert float(got_loss) == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5)
    (raw,) = Executor().run(from_onnx(model, stable_log=False), feed=f, fetch_list=["loss"])
    assert not np.isfinite(raw)  # the opt-out keeps the exported ops


@pytest.mark.parametrize("scale", [1.0, 20.0])
def test_gradient_of_the_rewrite_matches_finite_differences(scale):
    model = bce_graph("constant_scalar", np.float64)
    f = feed(scale, np.float64)
    _assert_gradients_match(lambda: from_onnx(model), f, ["W"])
    _, want_grad = truth(model, f)
    program = from_onnx(model)
    (got,) = Executor().run(program, feed=f, fetch_list=[dict(append_backward(program, "loss"))["W"]])
    np.testing.assert_allclose(got, want_grad, rtol=1e-9)


def test_other_logs_are_left_alone():
    model = bce_graph("initializer_scalar")
    half = next(t for t in model.graph.initializer if t.name == "one")
    half.CopyFrom(numpy_helper.from_array(np.array(0.5, np.float32), "one"))  # Log(0.5 - p): not 1 - p
    rewritten, done = stable_logs(model, "loss")
    assert [d.pattern for d in done] == ["log(sigmoid(z))"]
    assert unclamped_logs(rewritten, "loss") == 1
    clipped = bce_graph("constant_scalar")
    clipped.graph.node.insert(2, helper.make_node("Clip", ["p"], ["p_clip"]))
    next(n for n in clipped.graph.node if n.output[0] == "log_p").input[0] = "p_clip"
    assert [d.pattern for d in stable_logs(clipped, "loss")[1]] == ["log(1 - sigmoid(z))"]


def test_the_torch_exports_two_logs_are_found_and_announced(caplog):
    model = onnx.load(TORCH)
    rewritten, done = stable_logs(model, "36")
    assert sorted(str(d) for d in done) == [
        "/Log: log(sigmoid(z)) -> -softplus(-z)",
        "/Log_1: log(1 - sigmoid(z)) -> -softplus(z)",
    ]
    assert unclamped_logs(model, "36") == 2 and unclamped_logs(rewritten, "36") == 0
    assert not any(n.op_type == "Sub" and n.output[0] == "/Sub_output_0" for n in rewritten.graph.node)
    with caplog.at_level(logging.INFO, logger="hetps.onnx"):
        program = from_onnx(TORCH)
    assert program.attrs["score_names"] == ["/Sigmoid_output_0", "c"]  # still scored on the Sigmoid
    (line,) = [r.getMessage() for r in caplog.records if "stable_log" in r.getMessage()]
    assert "2 Log node(s)" in line and "--no-stable-log" in line
    assert not any("no clamp" in r.getMessage() for r in caplog.records)


def test_clamp_applies_to_the_logs_the_rewrite_leaves(caplog):
    model = bce_graph("initializer_scalar")
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.array(0.5, np.float32), "one"))
    f = feed(300.0)
    with caplog.at_level(logging.WARNING, logger="hetps.onnx"):
        program = from_onnx(model, log_clamp=1e-7)
    assert any("1 Log node(s)" in r.getMessage() and "Clip" in r.getMessage() for r in caplog.records)
    x, y = f["x"].astype(np.float64), f["y"].astype(np.float64)
    w = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    z = x @ w
    p = 1 / (1 + np.exp(-z))
    log_p = np.minimum(z, 0) - np.log1p(np.exp(-np.abs(z)))
    want = -np.mean(y * log_p + (0.5 - y) * np.log(np.maximum(0.5 - p, 1e-7)))  # the graph's `1` is 0.5 here
    (got,) = Executor().run(program, feed=f, fetch_list=["loss"])
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_cli_trains_the_torch_export_with_pure_defaults_and_reports_a_finite_auc(tmp_path, capsys):
    """Before stable_log, these defaults hit a NaN loss (the shard's NaN rejection) by step ~20."""
    plan = tmp_path / "plan"
    assert main(["transpile", str(TORCH), "--out", str(plan)]) == 0
    metrics = tmp_path / "run.jsonl"
    argv = ["train", str(plan), "--data", "synthetic", "--feeds", "sparse=a,dense=b,label=c", "--steps", "40",
            "--allow-emulation", "--metrics", str(metrics), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "AUC 0." in capsys.readouterr().out
    steps = [r for r in read_metrics(metrics) if r["kind"] == "step"]
    assert len(steps) == 40
    assert all(np.isfinite(r["loss"]) and r["auc"] is not None and 0 < r["auc"] < 1 for r in steps)


def test_no_stable_log_with_an_attached_loss_is_a_usage_error(tmp_path, capsys):
    model = str(MODELS / "wide_deep.onnx")
    argv = ["transpile", model, "--loss", "bce", "--no-stable-log", "--out", str(tmp_path / "plan")]
    assert main(argv) == 2
    assert "--no-stable-log apply to a loss inside the model" in capsys.readouterr().err


def test_the_rewritten_torch_export_round_trips_closer_to_the_float64_truth():
    """to_onnx of the default import carries the Softplus form; onnxruntime on it is within 1e-6 of
    the float64 graph, where the export as written is off by up to 4e-5 in float32."""
    from transpiler.exporters.onnx import to_onnx

    exported = to_onnx(from_onnx(TORCH))
    onnx.checker.check_model(exported, full_check=True)
    assert "Softplus" in {n.op_type for n in exported.graph.node}
    m64 = _to_float64(onnx.load(TORCH))
    for seed in range(3):
        feed = _ctr_feed("widedeep_bce_ts.onnx", seed, 4)
        feed64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feed.items()}
        np.testing.assert_allclose(_ort(exported, feed)[0], _ort(m64, feed64)[0], rtol=1e-6)
