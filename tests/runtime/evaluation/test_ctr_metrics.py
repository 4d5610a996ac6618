"""CTR metrics against references computed by hand: AUC as the fraction of (positive, negative)
pairs ranked right (ties half), log loss and calibration from their definitions, GAUC as the
impression-weighted mean of per-group pair counts; and `evaluate(group=, slice_by=)` on a model,
grouped by the raw values of the CSV file (not the hashed ids)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.data import open_dataset
from runtime.data.models import build_model
from runtime.evaluation.evaluate import evaluate, predict
from runtime.evaluation.metrics import auc, calibration, gauc, logloss, sliced
from transpiler import builder as nn
from transpiler import transpile


def _pairs_auc(y, p) -> float:
    pos, neg = p[y == 1], p[y == 0]
    if not len(pos) or not len(neg):
        return float("nan")
    wins = sum(float(a > b) + 0.5 * float(a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def _groups_auc(y, p, g) -> float:
    num = den = 0.0
    for v in set(g.tolist()):
        m = g == v
        a = _pairs_auc(y[m], p[m])
        if a == a:
            num, den = num + a * m.sum(), den + m.sum()
    return num / den


def test_metrics_match_hand_references():
    rng = np.random.default_rng(3)
    y = (rng.random(300) < 0.3).astype(float)
    p = np.round(np.clip(0.3 * y + rng.random(300) * 0.7, 0, 1), 2)  # rounded: ties
    g = rng.integers(0, 12, 300)
    g[g == 5] = 6  # a group that may be one class only stays in the data
    assert auc(y, p) == pytest.approx(_pairs_auc(y, p), abs=1e-12)
    q = np.clip(p, 1e-15, 1 - 1e-15)
    ref_ll = -np.mean([np.log(b) if t else np.log(1 - b) for t, b in zip(y, q, strict=True)])
    assert logloss(y, p) == pytest.approx(ref_ll, rel=1e-12)
    assert calibration(y, p) == pytest.approx(p.sum() / y.sum(), rel=1e-12)
    assert gauc(y, p, g) == pytest.approx(_groups_auc(y, p, g), abs=1e-12)
    g1 = np.zeros(300, int)
    g1[:3] = 1  # a group of one class: left out of GAUC
    y1 = y.copy()
    y1[:3] = 1
    assert gauc(y1, p, g1) == pytest.approx(_pairs_auc(y1[3:], p[3:]), abs=1e-12)
    s = sliced(y, p, g % 2, {0: "even", 1: "odd"})
    assert set(s) == {"even", "odd"}
    assert s["odd"]["examples"] == int((g % 2).sum())
    assert s["odd"]["auc"] == pytest.approx(_pairs_auc(y[g % 2 == 1], p[g % 2 == 1]), abs=1e-12)


def test_evaluate_gauc_and_slices_by_raw_column_values(tmp_path):
    rng = np.random.default_rng(0)
    lines = ["user,item,age,y"]
    for _ in range(240):
        u = rng.integers(0, 8)
        click = int(rng.random() < 0.2 + 0.07 * u)
        lines.append(f"u{u},{rng.integers(0, 20)},{rng.integers(20, 60)},{click}")
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    schema = {"label": "y", "dense": ["age"], "sparse": ["user", "item"], "vocab": 500}
    ds = open_dataset(tmp_path / "d.csv", schema, 50)
    m = build_model("wide_deep", ds.schema, ds.feed_shapes(), dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1))
    plan = transpile(m.main)
    got = evaluate(plan, ds, group="user", slice_by="user")
    p = predict(plan, ds).reshape(-1)
    rows = [r.split(",") for r in lines[1:]]
    users = np.array([r[0] for r in rows])
    y = np.array([float(r[3]) for r in rows])
    assert got["gauc"] == pytest.approx(_groups_auc(y, p, users), abs=1e-9)
    assert got["logloss"] == pytest.approx(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)), rel=1e-6)
    assert got["calibration"] == pytest.approx(p.astype(np.float64).mean() / y.mean(), rel=1e-12)
    assert sorted(got["slices"]) == sorted(set(users.tolist()))
    u3 = users == "u3"
    assert got["slices"]["u3"]["examples"] == int(u3.sum())
    assert got["slices"]["u3"]["auc"] == pytest.approx(_pairs_auc(y[u3], p[u3]), abs=1e-9)
    with pytest.raises(ValueError, match="cannot group or slice by 'age'"):
        evaluate(plan, ds, group="age")
