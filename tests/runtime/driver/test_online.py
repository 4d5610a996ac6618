"""The online pass loop (runtime/driver/online.py) and publishing (runtime/driver/publish.py) on
real pass directories, real trainer and server processes, onnxruntime as the serving reference.

Passes are click logs where a user's click rate depends on the user; `runtime.predict` on the
pass's checkpoint is the reference the published model (full ONNX + deltas, scored by
onnxruntime) must match."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ops_registry.errors import ConfigError
from runtime import OnlineConfig, predict, train
from runtime.data.streams import PassDirectorySource, StreamStalled
from runtime.driver.online import BadPass
from runtime.driver.publish import LATEST, ServedModel, apply_delta, read_latest
from runtime.telemetry.outputs import read_metrics
from transpiler import builder as nn
from transpiler.config import TranspileConfig
from transpiler.models import wide_deep
from transpiler.plan import transpile

SCHEMA = {"label": "click", "dense": ["x"], "sparse": ["user"], "vocab": 64}
BATCH = 32


def write_pass(logs: Path, hour: int, n: int = 128, *, flip: bool = False, flag: bool = True) -> Path:
    rng = np.random.default_rng(hour)
    d = logs / f"20240101/{hour:02d}"
    d.mkdir(parents=True)
    user, x = rng.integers(0, 16, n), rng.normal(size=n)
    click = (rng.random(n) < 1 / (1 + np.exp(-(3 * (user % 2) - 1.5 + x)))).astype(int)
    if flip:
        click = 1 - click
    rows = "".join(f"{c},{v:.4f},u{u}\n" for c, v, u in zip(click, x, user, strict=True))
    (d / "part-00000.csv").write_text("click,x,user\n" + rows)
    if flag:
        (d / "_SUCCESS").write_text("")
    return d


@pytest.fixture(scope="module")
def plan():
    model = wide_deep(num_slots=1, num_dense=1, vocab=64, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.5))
    return transpile(model.main, TranspileConfig(name_devices={"*": "cpu"}))


def source(logs: Path, **kw) -> PassDirectorySource:
    return PassDirectorySource(logs, SCHEMA, batch_size=BATCH, follow=False, **kw)


def run(plan, logs, root, online=None, **kw):
    return train(
        plan,
        source(logs),
        checkpoint=root / "ck",
        trainers={"cpu": 1},
        mode="sync",
        progress=False,
        online=online,
        **kw,
    )


def batches_of(logs: Path, pass_id: str) -> list[dict]:
    src = source(logs)
    for p in src.passes():
        got = list(p.batches)
        if p.id == pass_id:
            return got
    raise AssertionError(pass_id)


def scores(served: ServedModel, batches: list[dict]) -> np.ndarray:
    return np.concatenate([served.predict(b) for b in batches])


@pytest.mark.parametrize("rows", ["all", "existing"])
def test_after_every_pass_the_published_model_plus_deltas_scores_as_predict_on_its_checkpoint(
    plan, tmp_path, rows
):
    """One pass per call (resume in between): full, delta, delta, full with full_every=3; after
    each, onnxruntime on the published chain == runtime.predict on the committed checkpoint."""
    logs = tmp_path / "logs"
    for h in range(4):
        write_pass(logs, h)
    cfg = OnlineConfig(publish=tmp_path / "pub", full_every=3, rows=rows, max_passes=1)
    kinds = []
    for h in range(4):
        hist = run(plan, logs, tmp_path, cfg, resume=tmp_path / "ck" if h else None)
        (rec,) = hist.passes
        assert rec["pass"] == f"20240101/{h:02d}" and rec["examples"] == 128 and rec["steps"] == 4
        kinds.append(rec["published"]["kind"])
        ck = tmp_path / "ck" / hist.state.checkpoint
        served = ServedModel.load(tmp_path / "pub")
        for pid in ("20240101/00", f"20240101/{h:02d}"):
            data = batches_of(logs, pid)
            np.testing.assert_allclose(scores(served, data), predict(plan, data, checkpoint=ck), atol=1e-5)
    assert kinds == ["full", "delta", "delta", "full"]
    latest = read_latest(tmp_path / "pub")
    assert latest["chain"] == ["v00000004-full"] and latest["pass"] == "20240101/03"
    assert not list((tmp_path / "pub").glob(".tmp-*"))


def test_apply_delta_inserts_replaces_and_removes_rows_by_raw_id(tmp_path):
    """The delta format by hand: ids 5 and 9 held; a delta changes 9, adds 7, removes 5."""
    d = tmp_path / "v00000002-delta"
    d.mkdir()
    np.savez(
        d / "delta.npz",
        **{
            "t0.ids": np.array([9, 7]),
            "t0.rows": np.array([[90.0], [70.0]], np.float32),
            "t0.removed": np.array([5]),
            "t1.value": np.ones((2, 2), np.float32),
        },
    )
    manifest = {"format": 1, "kind": "delta", "version": 2, "base": 1, "previous": 1, "pass": "p",
                "tables": {"emb": {"kind": "sparse", "key": "t0", "rows": 2},
                           "w": {"kind": "dense", "key": "t1", "rows": 2}}}  # fmt: skip
    (d / "manifest.json").write_text(json.dumps(manifest))
    tables = {"emb": (np.array([5, 9]), np.array([[5.0], [9.0]], np.float32)), "w": np.zeros((2, 2))}
    out = apply_delta(tables, d)
    np.testing.assert_array_equal(out["emb"][0], [7, 9])
    np.testing.assert_array_equal(out["emb"][1], [[70.0], [90.0]])
    np.testing.assert_array_equal(out["w"], np.ones((2, 2)))
    assert tables["emb"][0].tolist() == [5, 9]  # the input is left alone
