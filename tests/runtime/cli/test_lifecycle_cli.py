"""`hetps train --checkpoint --checkpoint-every --resume --eval-data --eval-every`, `hetps eval`,
`hetps predict`, `hetps export --inference` (issue 15, item 8), run as a user would."""

from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.cli.app import main
from runtime.data import SyntheticCTR
from runtime.driver.checkpoints import checkpoints
from runtime.telemetry.outputs import read_metrics
from transpiler import builder as nn
from transpiler.models import wide_deep

BATCH = 64


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("life")
    wide_deep(num_slots=4, vocab=100, dim=4, hidden=(8,), optimizer=nn.Adam(lr=0.02)).main.save(
        tmp / "wd.json"
    )
    assert main(["transpile", str(tmp / "wd.json"), "--out", str(tmp / "plan")]) == 0
    run = [
        "train",
        str(tmp / "plan"),
        "--data",
        "synthetic",
        "--batch-size",
        str(BATCH),
        "--allow-emulation",
        "--trainers",
        "cpu=1,gpu=1",
        "--checkpoint",
        str(tmp / "ckpt"),
        "--checkpoint-every",
        "3",
        "--eval-data",
        "synthetic:seed=0",
        "--eval-batches",
        "2",
        "--eval-every",
        "3",
        "--no-progress",
    ]
    assert main([*run, "--steps", "6", "--metrics", str(tmp / "a.jsonl")]) == 0
    assert main([*run, "--steps", "9", "--resume", str(tmp / "ckpt"), "--metrics", str(tmp / "b.jsonl")]) == 0
    return tmp


def test_train_saves_evaluates_and_resumes(session, capsys):
    assert [p.name for p in checkpoints(session / "ckpt")] == ["step-00000006", "step-00000009"]
    first = [r for r in read_metrics(session / "a.jsonl") if r["kind"] in ("step", "eval")]
    second = [r for r in read_metrics(session / "b.jsonl") if r["kind"] in ("step", "eval")]
    assert [r["step"] for r in first if r["kind"] == "eval"] == [3, 6]
    assert [r["step"] for r in second if r["kind"] == "step"] == [6, 7, 8]  # resumed at step 6
    assert [r["step"] for r in second if r["kind"] == "eval"] == [9]


def test_predict_eval_and_the_inference_export_agree(session, capsys):
    ort = pytest.importorskip("onnxruntime")
    ck, plan = str(session / "ckpt"), str(session / "plan")
    data = ["--data", "synthetic:seed=0", "--batch-size", str(BATCH), "--batches", "2"]
    capsys.readouterr()
    assert main(["eval", plan, "--checkpoint", ck, *data]) == 0
    res = json.loads(capsys.readouterr().out)
    assert main(["predict", plan, "--checkpoint", ck, *data, "-o", str(session / "s.npy")]) == 0
    assert main(["predict", plan, "--checkpoint", ck, *data, "-o", str(session / "s.csv")]) == 0
    assert main(["export", plan, "--checkpoint", ck, "--inference", "-o", str(session / "m.onnx")]) == 0
    scores = np.load(session / "s.npy")
    np.testing.assert_allclose(
        np.loadtxt(session / "s.csv", delimiter=",").reshape(scores.shape), scores, rtol=1e-7
    )
    # the same held-out batches, scored by onnxruntime on the export
    gen = SyntheticCTR(vocab=100, num_slots=4)
    batches = [gen.batch(10**6 + i, BATCH) for i in range(2)]
    sess = ort.InferenceSession(str(session / "m.onnx"), providers=["CPUExecutionProvider"])
    onnx_scores = np.concatenate(
        [sess.run(None, {"sparse": b["sparse"], "dense": b["dense"]})[0] for b in batches]
    )
    np.testing.assert_allclose(scores, onnx_scores, rtol=1e-5, atol=1e-6)
    y, p = np.concatenate([b["label"] for b in batches]).ravel(), onnx_scores.ravel().astype(np.float64)
    assert res["examples"] == y.size
    assert res["loss"] == pytest.approx(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)), rel=1e-5)
    # ... and the final held-out evaluation of training saw the same tables
    final = [r for r in read_metrics(session / "b.jsonl") if r["kind"] == "eval"][-1]
    assert final["loss"] == pytest.approx(res["loss"], rel=1e-6)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checkpoint-every", "3"], "--checkpoint-every N needs --checkpoint DIR"),
        (["--eval-every", "3"], "--eval-every N needs --eval-data"),
        (["--eval-group", "sparse"], "--eval-group COLUMN needs --eval-data"),
        (["--eval-slice", "sparse"], "--eval-slice COLUMN needs --eval-data"),
    ],
)
def test_lifecycle_options_without_their_partner_exit_2(session, argv, message, capsys):
    rc = main(
        ["train", str(session / "plan"), "--data", "synthetic", "--steps", "2", "--allow-emulation", *argv]
    )
    assert rc == 2 and message in capsys.readouterr().err


def test_predict_names_the_file_types_it_writes(session, capsys):
    rc = main(["predict", str(session / "plan"), "--data", "synthetic", "-o", str(session / "s.txt")])
    assert rc == 2 and "name a .npy or .csv file" in capsys.readouterr().err


def test_resume_from_a_directory_without_checkpoints_fails_with_the_reason(session, capsys):
    rc = main(
        [
            "train",
            str(session / "plan"),
            "--data",
            "synthetic",
            "--steps",
            "2",
            "--allow-emulation",
            "--resume",
            str(session),
        ]
    )
    assert rc == 1 and "holds no complete checkpoint" in capsys.readouterr().err


def test_train_eval_group_and_slice_record_the_held_out_gauc(session, capsys):
    from test_lifecycle import auc_by_hand, gauc_by_hand

    from runtime.evaluation.evaluate import predict
    from transpiler.plan import Plan

    ck, metrics = session / "ckpt-gauc", session / "gauc.jsonl"
    argv = ["train", str(session / "plan"), "--data", "synthetic", "--batch-size", str(BATCH)]
    argv += ["--allow-emulation", "--trainers", "cpu=1,gpu=1", "--steps", "2", "--no-progress"]
    argv += ["--eval-data", "synthetic:seed=0", "--eval-batches", "2", "--eval-group", "sparse"]
    argv += ["--eval-slice", "sparse", "--checkpoint", str(ck), "--metrics", str(metrics)]
    assert main(argv) == 0
    assert "gauc" in capsys.readouterr().out
    (final,) = [r for r in read_metrics(metrics) if r["kind"] == "eval"]
    gen = SyntheticCTR(vocab=100, num_slots=4)
    batches = [gen.batch(10**6 + i, BATCH) for i in range(2)]
    p = predict(Plan.load(session / "plan"), batches, ck).ravel().astype(np.float64)
    y = np.concatenate([b["label"] for b in batches]).ravel()
    first = np.concatenate([b["sparse"] for b in batches])[:, 0]
    assert final["gauc"] == pytest.approx(gauc_by_hand(y, p, first), abs=1e-6)
    (v, *_) = [v for v in np.unique(first) if 0 < y[first == v].sum() < (first == v).sum()]
    rows = first == v
    assert final["slices"][str(v)]["examples"] == int(rows.sum())
    assert final["slices"][str(v)]["auc"] == pytest.approx(auc_by_hand(y[rows], p[rows]), abs=1e-6)
