"""The Plan as an artefact: save -> load -> simulate is identical, sub-programs export to ONNX that
onnx.checker accepts, draw writes a PNG, summary reports boundaries and tables."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from runtime import simulate
from transpiler import Plan, TranspileConfig, models, transpile
from transpiler import builder as nn


@pytest.fixture(scope="module")
def dlrm():
    m = models.dlrm(
        num_slots=3, vocab=30, dim=4, bag=3, num_dense=5, bottom=(8,), top=(8,), optimizer=nn.Adagrad(0.05)
    )
    rng = np.random.default_rng(3)
    batches = [
        {
            **{f"slot_{i}": rng.integers(0, 30, (8, 3)) for i in range(3)},
            "dense": rng.normal(size=(8, 5)).astype("float32"),
            "label": (rng.random((8, 1)) < 0.5).astype("float32"),
        }
        for _ in range(5)
    ]
    return m, batches


def test_save_load_simulate_is_identical(dlrm, tmp_path):
    m, batches = dlrm
    plan = transpile(m.main, TranspileConfig(mode="async", num_servers=2))
    plan.save(tmp_path / "plan")
    loaded = Plan.load(tmp_path / "plan")
    assert loaded.config == plan.config and loaded.tables == plan.tables
    assert loaded.channels == plan.channels and loaded.placement == plan.placement
    assert {t: p.to_json() for t, p in loaded.programs.items()} == {
        t: p.to_json() for t, p in plan.programs.items()
    }
    loaded.verify()
    a, b = simulate(plan, batches), simulate(loaded, batches)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    meta = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert meta["trainer_types"] == ["cpu", "gpu"] and meta["loss_name"] == m.loss.name
    with pytest.raises(FileNotFoundError, match="no plan.json"):
        Plan.load(tmp_path)


def test_params_travel_in_params_npz(tmp_path):
    """A program carrying parameter values (as ONNX / Paddle imports do) starts the tables from them."""
    m = models.wide_deep(num_slots=2, vocab=10, dim=2, num_dense=2, hidden=(4,), optimizer=nn.SGD(0.1))
    m.main.params = {"fc_0.w_0": np.full((6, 4), 0.5, "float32")}
    plan = transpile(m.main)
    assert plan.table("fc_0.w_0").initializer is None
    plan.save(tmp_path)
    loaded = Plan.load(tmp_path)
    np.testing.assert_array_equal(loaded.params["fc_0.w_0"], m.main.params["fc_0.w_0"])
    batch = {
        "sparse": np.array([[1, 2]]),
        "dense": np.ones((1, 2), "float32"),
        "label": np.ones((1, 1), "float32"),
    }
    x, y = simulate(loaded, [batch], fetch_list=["concat_0.tmp", "gemm_0.tmp"])[0]
    np.testing.assert_allclose(y, x @ m.main.params["fc_0.w_0"], rtol=1e-6)  # bias starts at 0


def test_to_onnx_passes_checker(dlrm, tmp_path):
    m, _ = dlrm
    plan = transpile(m.main)
    paths = plan.to_onnx(tmp_path)
    assert [p.name for p in paths] == ["cpu.onnx", "gpu.onnx"]
    for p in paths:
        model = onnx.load(str(p))
        onnx.checker.check_model(model)
        custom = {n.op_type for n in model.graph.node if n.domain == "ai.hetps"}
        assert {"send", "recv"} <= custom and custom & {"pull_sparse", "pull_dense"}, (p, custom)


def test_draw_writes_png_and_summary_lists_boundaries(dlrm, tmp_path):
    m, _ = dlrm
    plan = transpile(m.main)
    out = plan.draw(tmp_path / "plan.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    text = plan.summary()
    assert "trainer cpu:" in text and "trainer gpu:" in text
    for c in plan.channels:
        assert c["tensor"] in text
    assert "emb_0.w_0                sparse 30 x 4 float32  adagrad(lr=0.05)" in text
