"""The shell path of a new user, command by command: a CSV click log and a schema ->
`hetps train --model` (which writes the plan directory and the fitted feature pipeline) ->
`hetps eval` -> `hetps predict` -> `hetps export --inference` -> onnxruntime on raw values (dense
numbers as they are, categorical ids from `runtime.data.encode`), with the same scores; and the
fast checks of the commands around it."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from runtime.cli.app import main

HEADER = "user_id,item_id,gender,age,genres,rating"
SCHEMA = """\
label: rating
label_threshold: 4
dense: [age]
transform: standardize
sparse: [user_id, item_id, gender]
multi: {genres: "|"}
max_len: 3
vocab: 5000
missing: {age: 35}
"""


def _log(path, rows: int, seed: int) -> list[str]:
    teacher = np.random.default_rng(99)  # one teacher for the training and the test file
    ub, ib = teacher.normal(0, 1.5, 40), teacher.normal(0, 1.5, 30)  # what the wide part learns fast
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        u, i = rng.integers(0, 40), rng.integers(0, 30)
        g = sorted(rng.choice(4, rng.integers(1, 3), replace=False))
        score = ub[u] + ib[i] + rng.normal(0, 0.5)
        age = "" if rng.random() < 0.1 else str(rng.integers(18, 70))  # missing ages: filled with 35
        lines.append(f"{u},{i},{'FM'[u % 2]},{age},{'|'.join('abcd'[k] for k in g)},{int(score > 0) + 3}")
    path.write_text("\n".join([HEADER, *lines]) + "\n")
    return lines


@pytest.mark.slow
def test_csv_to_served_model_scores_identically(tmp_path, capsys):
    ort = pytest.importorskip("onnxruntime")
    from runtime.data import encode

    d = tmp_path
    (d / "schema.yaml").write_text(SCHEMA)
    _log(d / "train.csv", 1600, 0)
    test = _log(d / "test.csv", 300, 1)
    (d / "one.csv").write_text(f"{HEADER}\n{test[7]}\n")
    s = ["--schema", str(d / "schema.yaml")]
    train = ["train", "--data", str(d / "train.csv"), *s, "--model", "wide_deep", "--epochs", "2"]
    train += [
        "--eval-data",
        str(d / "test.csv"),
        "--checkpoint",
        str(d / "ckpt"),
        "--batch-size",
        "200",
        "--lr",
        "0.05",
    ]
    train += [
        "--trainers",
        "cpu=1,gpu=1",
        "--allow-emulation",
        "--no-progress",
        "--dim",
        "4",
        "--hidden",
        "16",
    ]
    assert main(train) == 0
    out = capsys.readouterr().out
    assert "missing values filled (by column): {'age':" in out and "held-out AUC" in out
    plan = str(d / "ckpt" / "plan")
    ck = ["--checkpoint", str(d / "ckpt")]
    assert main(["eval", plan, *ck, "--data", str(d / "test.csv"), "--group", "user_id"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["examples"] == 300 and res["auc"] > 0.6 and 0.5 < res["calibration"] < 2 and "gauc" in res
    assert main(["predict", plan, *ck, "--data", str(d / "test.csv"), "-o", str(d / "s.npy")]) == 0
    assert main(["predict", plan, *ck, "--data", str(d / "one.csv"), "-o", str(d / "one.npy")]) == 0
    scores, one = np.load(d / "s.npy"), np.load(d / "one.npy")
    assert one[0, 0] == scores[7, 0]  # a row scores the same alone as inside its file
    assert main(["export", plan, *ck, "--inference", "-o", str(d / "model.onnx")]) == 0
    sess = ort.InferenceSession(str(d / "model.onnx"))
    records = list(csv.DictReader((d / "test.csv").open()))
    feeds = encode(records, d / "model.features.json")
    served = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})[0]
    np.testing.assert_allclose(served, scores, rtol=1e-6, atol=1e-7)
    assert {i.name for i in sess.get_inputs()} >= {"age", "sparse", "genres"}  # age: raw years


def test_transpile_from_a_schema_and_the_commands_around_it(tmp_path, capsys):
    d = tmp_path
    (d / "s.yaml").write_text(SCHEMA.replace("transform: standardize", "transform: log1p"))
    _log(d / "t.csv", 50, 2)
    args = ["transpile", "deepfm", "--schema", str(d / "s.yaml"), "--out", str(d / "plan"), "--dim", "4"]
    assert main(args) == 0
    assert (d / "plan" / "features.json").is_file() and "deepfm: dim 4" in capsys.readouterr().out
    # eval / predict read the data by the plan's features.json: no --schema needed
    assert main(["predict", str(d / "plan"), "--data", str(d / "t.csv"), "-o", str(d / "p.csv")]) == 0
    assert len(np.loadtxt(d / "p.csv")) == 50
    assert main(["transpile", "dlrm", "--out", str(d / "x")]) == 2
    assert "add --schema" in capsys.readouterr().err
    # the trainer counts are checked before the devices, and say how to get a CPU-only plan
    run = [
        "train",
        str(d / "plan"),
        "--data",
        str(d / "t.csv"),
        "--schema",
        str(d / "s.yaml"),
        "--steps",
        "1",
    ]
    assert main([*run, "--trainers", "cpu=2"]) == 2
    assert "trainer types ['cpu', 'gpu']" in capsys.readouterr().err
    (d / "bad.yaml").write_text("num_servers: two\n")
    assert main(["transpile", "wide_deep", "--schema", str(d / "s.yaml"), "--out", str(d / "p2")]) == 0
    capsys.readouterr()
    bad = [
        "transpile",
        "dlrm",
        "--schema",
        str(d / "s.yaml"),
        "--out",
        str(d / "p3"),
        "--config",
        str(d / "bad.yaml"),
    ]
    assert main(bad) == 2
    assert "'num_servers': expected int" in capsys.readouterr().err


def test_a_plan_without_a_loss_says_nothing_trains(tmp_path, capsys):
    from pathlib import Path

    onnx_model = Path(__file__).resolve().parents[3] / "tutorials" / "models" / "wide_deep.onnx"
    assert main(["transpile", str(onnx_model), "--out", str(tmp_path / "p")]) == 0
    err = capsys.readouterr().err
    assert "nothing will train" in err and "--loss bce" in err
    run = ["train", str(tmp_path / "p"), "--data", "synthetic", "--steps", "2", "--allow-emulation"]
    assert main(run) == 2
    assert "nothing to train" in capsys.readouterr().err
