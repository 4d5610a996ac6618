"""The feature pipeline travels with the model: stats fitted on the training file only, a row scored
the same alone or in any file, through `predict` and through onnxruntime on the raw-value export
(`encode` for the categorical ids, hashed as an independent pure-Python FNV-1a says)."""

from __future__ import annotations

import numpy as np
import pytest

from ops_registry.errors import ConfigError
from runtime.data import open_dataset
from runtime.data.files.features import encode, find_features, save_features
from runtime.data.files.schema import Schema
from runtime.data.models import build_model
from runtime.evaluation.evaluate import export, predict
from transpiler import builder as nn
from transpiler import transpile

HEADER = "user,item,age,clicks,genres,y"
SCHEMA = {
    "label": "y",
    "dense": ["age", "clicks"],
    "transform": {"age": "standardize", "clicks": "log1p"},
    "sparse": ["user", "item"],
    "multi": {"genres": "|"},
    "max_len": 3,
    "vocab": 97,
    "missing": {"age": 30, "clicks": 0},
}


def _rows(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        age = "" if i % 7 == 3 else str(int(rng.integers(18, 70)))
        g = "|".join(rng.choice(["a", "b", "c", "d"], rng.integers(0, 3), replace=False))
        out.append(f"u{rng.integers(0, 30)},{rng.integers(0, 50)},{age},{rng.integers(0, 9)},{g},{i % 2}")
    return out


def _write(path, rows):
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    return path


def _fnv_id(column: str, value: str, vocab: int) -> int:
    h = 0xCBF29CE484222325
    for b in column.encode() + b"\x1f" + value.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return 1 + h % (vocab - 1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("features")
    train_rows, test_rows = _rows(200, 0), _rows(40, 1)
    train = open_dataset(_write(d / "train.csv", train_rows), SCHEMA, 64, check=True)
    m = build_model(
        "wide_deep", train.schema, train.feed_shapes(), dim=4, hidden=(8,), optimizer=nn.Adam(lr=0.1)
    )
    plan = transpile(m.main)
    save_features(d / "ckpt", train.schema)  # what train(checkpoint=...) keeps beside the checkpoints
    return d, plan, train, train_rows, test_rows


def test_stats_are_the_training_files_with_fill(model):
    d, _, train, rows, _ = model
    ages = np.array([float(r.split(",")[2]) if r.split(",")[2] else 30.0 for r in rows])
    ((mean, std),) = [(m, s) for c, m, s in train.schema.stats if c == "age"]
    np.testing.assert_allclose([mean, std], [ages.mean(), ages.std()], rtol=1e-12)
    assert train.filled == {"age": sum(1 for r in rows if not r.split(",")[2])}
    assert find_features(d / "ckpt").stats == train.schema.stats


def test_row_scores_the_same_alone_in_any_file_and_in_onnxruntime(model):
    ort = pytest.importorskip("onnxruntime")
    d, plan, _, _, test_rows = model
    ck = d / "ckpt"
    schema = dict(SCHEMA)  # opened as a user would: the eval file's own stats would be measured
    whole = predict(plan, open_dataset(_write(d / "test.csv", test_rows), schema, 16), features=ck)
    for i in (3, 10):
        alone = predict(plan, open_dataset(_write(d / f"one{i}.csv", [test_rows[i]]), schema, 4), features=ck)
        assert alone[0, 0] == whole[i, 0]
    path = export(plan, d / "model.onnx", features=ck)
    assert path.with_suffix(".features.json").is_file()
    sess = ort.InferenceSession(str(path))
    names = [c for c in HEADER.split(",")]
    records = [dict(zip(names, r.split(","), strict=True)) for r in test_rows]
    feeds = encode(records, path.with_suffix(".features.json"))
    inputs = [i.name for i in sess.get_inputs()]
    assert {"age", "clicks", "sparse", "genres"} <= set(inputs) <= set(feeds)  # raw dense columns
    got = sess.run(None, {k: feeds[k] for k in inputs})[0]
    np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-7)
    # raw values straight from a serving system: numbers as numbers, a missing age as None
    rec = {"user": "u4", "item": 7, "age": None, "clicks": 3, "genres": "b|a", "y": 0}
    text = {k: "" if v is None else str(v) for k, v in rec.items()}
    _write(d / "rec.csv", [",".join(text[c] for c in names)])
    ref = predict(plan, open_dataset(d / "rec.csv", schema, 1), features=ck)
    one = encode([rec], ck)
    np.testing.assert_allclose(sess.run(None, {k: one[k] for k in inputs})[0], ref, rtol=1e-6, atol=1e-7)


def test_encode_hashes_as_fnv1a_by_hand(model):
    d = model[0]
    fitted = find_features(d / "ckpt")
    got = encode([{"user": "u7", "item": 12, "age": 40, "clicks": 1, "genres": "a|c"}], fitted)
    assert got["sparse"].tolist() == [[_fnv_id("user", "u7", 97), _fnv_id("item", "12", 97)]]
    assert got["genres"].tolist() == [[_fnv_id("genres", "a", 97), _fnv_id("genres", "c", 97), 0]]
    assert got["genres_len"].tolist() == [[2]]
    assert got["age"].tolist() == [[40.0]]


def test_missing_policy_error_names_file_row_column(tmp_path):
    rows = _rows(20, 2)
    f = _write(tmp_path / "t.csv", rows)
    schema = {**SCHEMA, "missing": {"age": "error"}}
    with pytest.raises(ConfigError, match=r"t\.csv \(data rows 1\.\.20\).*'age'.*row 4"):
        open_dataset(f, schema, 8)
    bad_label = [*rows[:5], rows[5].rsplit(",", 1)[0] + ",", *rows[6:]]
    with pytest.raises(ConfigError, match=r"t2\.csv.*label column 'y'|t2\.csv.*'y'.*row 6"):
        open_dataset(_write(tmp_path / "t2.csv", bad_label), {**SCHEMA, "missing": {}}, 8, check=True)
    with pytest.raises(ConfigError, match="missing: age: 'two'"):
        Schema.from_dict({**SCHEMA, "missing": {"age": "two"}})


def test_schema_given_must_match_the_fitted_one(model):
    d, plan, _, _, test_rows = model
    other = {**SCHEMA, "vocab": 101}
    with pytest.raises(ConfigError, match=r"differs.*\['vocab'\]"):
        predict(plan, open_dataset(_write(d / "t3.csv", test_rows), other, 8), features=d / "ckpt")
