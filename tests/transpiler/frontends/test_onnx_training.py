"""Training exported ONNX models as they come: a batch fixed by the exporter, a loss written as raw
Log/Sigmoid ops (its prediction found for the AUC), the opt-in log clamp, and the CLI around them
(the stable evaluation of those logs, on by default: test_onnx_stable_log.py).

References are independent of hetps: onnxruntime on the original fixed-batch graph (in slices of
its batch), numpy for the BCE and a rank-sum AUC written here.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from assets import MODELS
from onnx import TensorProto, helper

from runtime import Executor
from runtime.cli.app import main
from runtime.data import SyntheticCTR
from runtime.telemetry.outputs import read_metrics
from transpiler import OnnxImportError, Plan, from_onnx

TORCH = MODELS / "widedeep_bce_ts.onnx"
PRED = "/Sigmoid_output_0"


def ort_run(model: onnx.ModelProto, feed: dict, outputs: list[str]) -> list[np.ndarray]:
    """onnxruntime on `model`, fetching `outputs` (intermediate values made graph outputs)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    known = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in outputs if n not in known)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(outputs, feed)


def in_fours(model: onnx.ModelProto, feed: dict, outputs: list[str]) -> list[np.ndarray]:
    """The fixed-batch-4 graph run by onnxruntime on consecutive slices of 4, results stacked."""
    n = len(next(iter(feed.values())))
    parts = [ort_run(model, {k: v[i : i + 4] for k, v in feed.items()}, outputs) for i in range(0, n, 4)]
    return [np.stack([p[k] for p in parts]) for k in range(len(outputs))]


def batch(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    return SyntheticCTR(vocab=1000, seed=seed, sparse_name="a", dense_name="b", label_name="c").batch(0, n)


def rank_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Mann-Whitney AUC: the share of (positive, negative) pairs ordered right, ties count half."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    return float(
        ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
        / (len(pos) * len(neg))
    )


def test_fixed_batch_is_made_dynamic_and_computes_what_the_graph_does():
    model = onnx.load(TORCH)
    program = from_onnx(model)
    assert program.var("a").shape == (-1, 26) and program.var("c").shape == (-1, 1)
    feed = batch(32)
    loss, pred = Executor().run(program, feed=feed, fetch_list=["36", PRED])
    ref_loss, ref_pred = in_fours(model, feed, ["36", PRED])
    np.testing.assert_allclose(pred, ref_pred.reshape(32, 1), rtol=1e-5, atol=1e-7)
    assert float(loss) == pytest.approx(float(ref_loss.mean()), rel=1e-5)  # mean of equal-size means
    kept = from_onnx(model, dynamic_batch=False)
    assert kept.var("a").shape == (4, 26)


def test_a_batch_written_into_a_reshape_stays_fixed_and_says_why():
    from transpiler.frontends.onnx.batch import free_batch

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2, 3])
    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [4, 2, 3])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="r")], "g", [x], [y], [shape]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    same, what = free_batch(model)
    assert same is model and what.fixed == 4 and not what.freed
    assert "Reshape node r" in what.why_not and "exactly 4 examples" in what.message()
    assert from_onnx(model).var("x").shape == (4, 6)


def test_the_prediction_of_a_raw_bce_is_found_and_is_what_the_loss_reads():
    """score_names names the tensor p and label y with loss = -mean(y log p + (1-y) log(1-p))."""
    program = from_onnx(TORCH)
    pred, label = program.attrs["score_names"]
    assert label == "c"
    feed = batch(16, seed=3)
    (p,) = Executor().run(program, feed=feed, fetch_list=[pred])
    y = feed["c"]
    (ref_loss,) = in_fours(onnx.load(TORCH), feed, ["36"])
    bce = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert bce == pytest.approx(float(ref_loss.mean()), rel=1e-5)


def test_pred_must_be_upstream_of_the_loss():
    assert from_onnx(TORCH, pred="/Add_1_output_0").attrs["score_names"] == ["/Add_1_output_0", "c"]
    with pytest.raises(OnnxImportError, match="not a value the loss"):
        from_onnx(TORCH, pred="no_such_value")


def test_log_clamp_bounds_the_logs_of_a_saturated_prediction():
    feed = batch(8, seed=1)
    feed["b"] = feed["b"] * 1e3  # logits of hundreds: sigmoid is exactly 0 or 1 in float32
    (p,) = in_fours(onnx.load(TORCH), feed, [PRED])
    p = p.reshape(8, 1)
    assert ((p == 0) | (p == 1)).any()
    y, eps = feed["c"], 1e-7
    expected = -np.mean(y * np.log(np.maximum(p, eps)) + (1 - y) * np.log(np.maximum(1 - p, eps)))
    (raw,) = Executor().run(from_onnx(TORCH, stable_log=False), feed=feed, fetch_list=["36"])
    assert not np.isfinite(raw) or np.isnan(raw)
    clamped_program = from_onnx(TORCH, log_clamp=eps, stable_log=False)  # stable_log leaves no Log to clamp
    (clamped,) = Executor().run(clamped_program, feed=feed, fetch_list=["36"])
    assert float(clamped) == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(OnnxImportError, match="not to an attached"):
        from_onnx(MODELS / "wide_deep.onnx", loss="bce", log_clamp=eps)


def test_cli_trains_the_torch_export_with_its_default_batch_and_reports_its_auc(tmp_path, capsys):
    plan = tmp_path / "plan"
    assert (
        main(
            [
                "transpile",
                str(TORCH),
                "--out",
                str(plan),
                "--clamp-log",
                "1e-7",
                "--optimizer",
                "adam",
                "--lr",
                "0.01",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "optimizer: adam(lr=0.01) for every trained parameter" in out
    assert "float32[-1, 208]  832 B" in out  # bytes per example, not per exported batch of 4
    assert {t.optimizer.type for t in Plan.load(plan).tables if t.optimizer} == {"adam"}
    metrics = tmp_path / "run.jsonl"
    assert (
        main(
            [
                "train",
                str(plan),
                "--data",
                "synthetic",
                "--feeds",
                "sparse=a,dense=b,label=c",
                "--steps",
                "3",
                "--trainers",
                "cpu=1,gpu=1",
                "--micro-batches",
                "1",
                "--allow-emulation",
                "--metrics",
                str(metrics),
                "--no-progress",
            ]
        )
        == 0
    )  # --batch-size: the default 512
    assert "AUC 0." in capsys.readouterr().out
    steps = [r for r in read_metrics(metrics) if r["kind"] == "step"]
    assert steps[0]["examples"] == 512
    # step 0 scores the untrained model: its AUC is onnxruntime's predictions ranked by hand
    feed = batch(512)
    (p,) = in_fours(onnx.load(TORCH), feed, [PRED])
    assert steps[0]["auc"] == pytest.approx(rank_auc(feed["c"].reshape(-1), p.reshape(-1)), abs=1e-6)
    assert all(r["auc"] is not None and 0 < r["auc"] < 1 for r in steps)


def test_cli_names_the_batch_size_a_fixed_batch_plan_needs(tmp_path, capsys):
    plan = str(tmp_path / "plan")
    assert main(["transpile", str(TORCH), "--out", plan, "--fixed-batch"]) == 0
    capsys.readouterr()
    argv = [
        "train",
        plan,
        "--data",
        "synthetic",
        "--feeds",
        "sparse=a,dense=b,label=c",
        "--steps",
        "1",
        "--allow-emulation",
        "--trainers",
        "cpu=2,gpu=1",
        "--micro-batches",
        "4",
    ]
    assert main(argv) == 2
    assert "--batch-size must be 4 x 2 cpu reader(s) x 4 micro-batch(es) = 32" in capsys.readouterr().err
    # without --micro-batches: train's default, one per cpu reader here (2 readers feed 1 gpu trainer)
    assert main(argv[:-2]) == 2
    assert "--batch-size must be 4 x 2 cpu reader(s) x 1 micro-batch(es) = 8" in capsys.readouterr().err


def test_train_optimizer_options_replace_the_plans_table_optimizers(tmp_path, capsys):
    from runtime.cli.app import set_optimizer

    plan_dir = tmp_path / "plan"
    assert main(["transpile", str(TORCH), "--out", str(plan_dir)]) == 0
    assert (
        "optimizer: adam(lr=0.01) for every trained parameter (the model carries none; the default"
        in capsys.readouterr().out
    )
    plan = Plan.load(plan_dir)
    assert set_optimizer(plan, "adagrad", 0.1).startswith("adagrad(")
    for t in plan.tables:
        if t.optimizer:
            assert t.optimizer.type == "adagrad" and t.optimizer.hyper["lr"] == 0.1
            assert t.optimizer.state["Moment"].shape == list(t.shape)


def test_bytes_per_example_are_per_example_when_the_batch_stays_fixed():
    """A plan kept at the export's batch of 4 reported 3328 B "per example" for [4, 208] float32."""
    from transpiler import transpile

    plan = transpile(from_onnx(TORCH, dynamic_batch=False))
    flat = next(c for c in plan.channels if c["tensor"] == "/Flatten_output_0")
    assert flat["shape"] == [4, 208] and flat["bytes_per_example"] == 208 * 4
    assert "float32[4, 208]  832 B" in plan.summary()
