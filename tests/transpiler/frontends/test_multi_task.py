"""Multi-task training: several label feeds, a loss per task with weights, one backward over the
weighted sum, per-task AUC, and evaluate / predict / the servable export per task.

References are independent of hetps: torch's own SGD steps on the same batch (saved by
tests/models/exporters/export_torch.py as `<model>_torch_steps.npz`, so no torch is needed here),
onnxruntime on the exported files, losses and AUCs written out in numpy (the AUC by counting
ordered pairs, not by ranks as runtime.evaluation.metrics does).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from runtime import Executor, evaluate, export, predict
from runtime.exec.simulate import simulate
from transpiler import OnnxImportError, TranspileConfig, from_onnx, transpile
from transpiler import builder as nn
from transpiler.models import esmm, mmoe
from transpiler.tasks import tasks_of

DIR = Path(__file__).resolve().parents[2] / "models" / "exporters"
VOCAB, SLOTS, DENSE = 40, 3, 4  # as in export_torch.py
OUTPUTS = {"esmm": {"ctr": "click", "ctcvr": "buy"}, "mmoe": {"ctr": "click", "cvr": "like"}}
ESMM_LOSSES = {"ctr": ("bce", "click"), "ctcvr": ("bce", "buy")}


def _losses(model: str) -> dict[str, tuple[str, str]]:
    return {out: ("bce", label) for out, label in OUTPUTS[model].items()}


def _ort(path: Path, feed: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feed.items() if k in names})


def _bce(p: np.ndarray, y: np.ndarray) -> float:
    p = p.astype(np.float64)
    return float(np.mean(-(y * np.maximum(np.log(p), -100) + (1 - y) * np.maximum(np.log(1 - p), -100))))


def _pair_auc(y: np.ndarray, s: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties counted half: every pair compared."""
    y, s = y.reshape(-1) > 0.5, s.reshape(-1).astype(np.float64)
    pos, neg = s[y][:, None], s[~y][None, :]
    return float(((pos > neg).sum() + 0.5 * (pos == neg).sum()) / (pos.size * neg.size))


def _batch(n: int, seed: int, labels: list[str]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feed = {
        "sparse": rng.integers(0, VOCAB, (n, SLOTS)),
        "dense": rng.normal(size=(n, DENSE)).astype(np.float32),
    }
    return feed | {lab: rng.integers(0, 2, (n, 1)).astype(np.float32) for lab in labels}


@pytest.mark.parametrize("model", ["esmm", "mmoe"])
@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_training_follows_torch_own_steps(model: str, exporter: str) -> None:
    """Plain SGD on the summed task losses, transpiled (embedding on a PS table, towers on gpu):
    the total and each task's loss before every step equal torch's on the same batch."""
    ref = np.load(DIR / f"{model}_torch_steps.npz")
    program = from_onnx(DIR / f"{model}_{exporter}.onnx", losses=_losses(model))
    plan = transpile(program, TranspileConfig(optimizer={"type": "sgd", "lr": 0.2}))
    feed = {k: ref[k] for k in ["sparse", "dense", *OUTPUTS[model].values()]}
    task_losses = [f"loss_{o}" for o in OUTPUTS[model]]
    got = simulate(plan, [feed] * len(ref["loss"]), fetch_list=[plan.loss_name, *task_losses])
    np.testing.assert_allclose([float(s[0]) for s in got], ref["loss"], rtol=2e-5)
    for k, name in enumerate(task_losses, start=1):
        np.testing.assert_allclose([float(s[k]) for s in got], ref[name], rtol=2e-5)


def test_weights_scale_the_task_losses() -> None:
    path = DIR / "esmm_ts.onnx"
    program = from_onnx(path, losses=ESMM_LOSSES, weights={"ctcvr": 0.25})
    assert [(t.name, t.pred, t.label, t.weight) for t in tasks_of(program)] == [
        ("ctr", "ctr", "click", 1.0),
        ("ctcvr", "ctcvr", "buy", 0.25),
    ]
    feed = _batch(32, 0, ["click", "buy"])
    feed["buy"] *= feed["click"]
    ctr, ctcvr = _ort(path, feed)
    (loss,) = Executor().run(program, feed=feed, fetch_list=[program.attrs["loss_name"]])
    want = _bce(ctr, feed["click"]) + 0.25 * _bce(ctcvr, feed["buy"])
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_bad_losses_are_refused_by_name() -> None:
    path = DIR / "esmm_ts.onnx"
    with pytest.raises(OnnxImportError, match=r"\['cvr'\].*outputs are \['ctr', 'ctcvr'\]"):
        from_onnx(path, losses={"cvr": ("bce", "buy")})
    with pytest.raises(OnnxImportError, match="must be \\(loss, label\\)"):
        from_onnx(path, losses={"ctr": "bce"})
    with pytest.raises(OnnxImportError, match="weights name \\['ctcvr'\\]"):
        from_onnx(path, losses={"ctr": ("bce", "click")}, weights={"ctcvr": 2.0})
    with pytest.raises(OnnxImportError, match="replaces loss="):
        from_onnx(path, loss="bce", losses=ESMM_LOSSES)
    with pytest.raises(OnnxImportError, match="already a variable"):
        from_onnx(path, losses={"ctr": ("bce", "dense"), "ctcvr": ("bce", "buy")})


def test_evaluate_predict_and_export_per_task(tmp_path: Path) -> None:
    """Without a checkpoint the plan scores with the file's own weights: onnxruntime on the file
    is the reference for predict's columns, evaluate's per-task AUC and the servable export."""
    path = DIR / "mmoe_dynamo.onnx"
    plan = transpile(
        from_onnx(path, losses=_losses("mmoe")), TranspileConfig(optimizer={"type": "sgd", "lr": 0.1})
    )
    held = [_batch(64, s, ["click", "like"]) for s in range(3)]
    ref = [_ort(path, b) for b in held]
    want = {t: np.concatenate([r[k] for r in ref]) for k, t in enumerate(["ctr", "cvr"])}
    got = predict(plan, held)
    assert got.shape == (192, 2)  # a column per task, in Plan.tasks order
    np.testing.assert_allclose(got, np.concatenate([want["ctr"], want["cvr"]], axis=1), rtol=1e-5, atol=1e-6)
    res = evaluate(plan, held)
    labels = {t: np.concatenate([b[lab] for b in held]) for t, lab in OUTPUTS["mmoe"].items()}
    for t in ("ctr", "cvr"):
        assert res[f"auc_{t}"] == pytest.approx(_pair_auc(labels[t], want[t]), abs=1e-9)
    assert res["auc"] == res["auc_ctr"]
    total = np.mean([_bce(r[0], b["click"]) + _bce(r[1], b["like"]) for r, b in zip(ref, held, strict=True)])
    assert res["loss"] == pytest.approx(total, rel=1e-5)
    out = export(plan, tmp_path / "mmoe.onnx")
    model = onnx.load(str(out))
    assert [o.name for o in model.graph.output] == ["ctr", "cvr"]
    assert sorted(i.name for i in model.graph.input) == ["dense", "sparse"]  # no label feeds
    served = _ort(out, held[0])
    np.testing.assert_allclose(served[0], ref[0][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(served[1], ref[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [esmm, mmoe])
def test_builder_models_are_multi_task(make) -> None:
    """The builder's ESMM / MMOE: one loss = the tasks' BCEs summed (numpy by hand from the
    fetched predictions); pCTCVR = pCTR x pCVR; embeddings sparse, experts / towers dense; trains."""
    m = make(num_slots=SLOTS, vocab=VOCAB, dim=4, num_dense=DENSE, weights=None, optimizer=nn.SGD(lr=0.1))
    plan = transpile(m.main)
    names = list(m.preds)
    assert plan.tasks == names and [t.kind for t in plan.tables if "emb" in t.name] == ["sparse"]
    assert {t.kind for t in plan.tables if "emb" not in t.name} == {"dense"}
    labels = [tk.label for tk in tasks_of(m.main)]
    feed = _batch(64, 1, labels)
    if make is esmm:
        feed["buy"] *= feed["click"]
    exe = Executor()
    exe.run(m.startup)
    fetched = exe.run(m.main, feed=feed, fetch_list=[m.loss.name, *[p.name for p in m.preds.values()]])
    loss, preds = float(fetched[0]), fetched[1:]
    np.testing.assert_allclose(
        loss, sum(_bce(p, feed[lab]) for p, lab in zip(preds, labels, strict=True)), rtol=1e-5
    )
    if make is esmm:
        assert np.all(preds[1] <= preds[0] + 1e-7)  # pCTCVR = pCTR x pCVR <= pCTR
    losses = [float(s[0]) for s in simulate(plan, [feed] * 10)]
    assert losses[-1] < losses[0], losses


def test_real_runtime_reports_each_task_auc(tmp_path: Path) -> None:
    """Trainer and server processes with lr 0 (the weights stay the file's): each step's per-task
    AUC in the History, the metrics file and TensorBoard equals the AUC of onnxruntime's
    predictions on that batch."""
    from test_telemetry import read_tensorboard

    from runtime import train
    from runtime.telemetry.outputs import read_metrics

    path = DIR / "esmm_dynamo.onnx"
    plan = transpile(
        from_onnx(path, losses=ESMM_LOSSES), TranspileConfig(optimizer={"type": "sgd", "lr": 0.0})
    )
    data = [_batch(128, 10 + s, ["click", "buy"]) for s in range(4)]
    hist = train(
        plan,
        data,
        epochs=1,
        trainers={"cpu": 1, "gpu": 1},
        allow_emulation=True,
        progress=False,
        metrics=str(tmp_path / "run.jsonl"),
        tensorboard=str(tmp_path / "tb"),
    )
    want = {
        t: [_pair_auc(b[lab], _ort(path, b)[k]) for b in data]
        for k, (t, lab) in enumerate(OUTPUTS["esmm"].items())
    }
    assert sorted(hist.task_auc) == ["ctcvr", "ctr"]
    for t in want:
        np.testing.assert_allclose(hist.task_auc[t], want[t], atol=1e-9)
    assert hist.auc == hist.task_auc["ctr"]
    steps = [r for r in read_metrics(tmp_path / "run.jsonl") if r["kind"] == "step"]
    np.testing.assert_allclose([r["auc_ctcvr"] for r in steps], want["ctcvr"], atol=1e-9)
    board = read_tensorboard(tmp_path / "tb")
    np.testing.assert_allclose([v for _, v in board["auc/ctcvr"]], want["ctcvr"], rtol=1e-6)


def test_cli_transpile_with_a_loss_per_output(tmp_path: Path, capsys) -> None:
    from runtime.cli.app import main
    from transpiler import Plan

    out = tmp_path / "plan"
    argv = [
        "transpile",
        str(DIR / "esmm_ts.onnx"),
        "--losses",
        "ctr=bce:click,ctcvr=bce:buy:0.5",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    plan = Plan.load(out)
    assert plan.tasks == ["ctr", "ctcvr"]
    assert [t.weight for p in plan.programs.values() for t in tasks_of(p)] == [1.0, 0.5]
    assert main(["transpile", str(DIR / "esmm_ts.onnx"), "--losses", "ctr=bce", "--out", str(out)]) == 2
    assert "expected OUTPUT=LOSS:LABEL[:WEIGHT]" in capsys.readouterr().err
    assert (
        main(
            [
                "transpile",
                str(DIR / "esmm_ts.onnx"),
                "--losses",
                "ctr=bce:c",
                "--loss",
                "bce",
                "--out",
                str(out),
            ]
        )
        == 2
    )
