"""A checkpoint loads into the same model placed differently (another TranspileConfig: one trainer
type instead of two), and is refused, saying why, for a model whose ops differ."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from runtime.driver.checkpoints import check_resume, run_state
from runtime.evaluation.evaluate import evaluate
from runtime.ps import Shard
from runtime.ps import checkpoint as ps_checkpoint
from runtime.ps.checkpoint import CheckpointError
from transpiler import TranspileConfig, transpile
from transpiler import builder as nn
from transpiler.models import wide_deep

CPU_ONLY = TranspileConfig(
    trainer_types=["cpu"], category_map={"io": "cpu", "sparse": "cpu", "dense": "cpu", "loss": "cpu"}
)


def _save(plan, path, seed: int):
    """A train-style checkpoint of `plan` holding random table values (no training needed)."""
    shard = Shard(plan.tables)
    rng = np.random.default_rng(seed)
    for t in plan.tables:
        tab = shard.tables[t.name]
        value = rng.normal(0, 0.1, t.shape).astype(np.float32)
        tab.assign(value, *(() if t.kind == "dense" else (np.arange(t.shape[0]),)))
    stage = ps_checkpoint.begin(path)
    files = shard.save(stage)
    ps_checkpoint.finish(stage, path, plan.tables, files, run=asdict(run_state(plan, 3, None, {})))
    return path


def test_checkpoint_loads_into_another_placement(tmp_path):
    m = wide_deep(vocab=50, num_slots=3, num_dense=2, hidden=(8,), optimizer=nn.Adam(lr=0.01))
    two, one = transpile(m.main), transpile(m.main, CPU_ONLY)
    assert sorted(two.programs) == ["cpu", "gpu"] and sorted(one.programs) == ["cpu"]
    ck = _save(two, tmp_path / "step-00000003", 0)
    rng = np.random.default_rng(1)
    data = [
        {
            "sparse": rng.integers(0, 50, (16, 3)),
            "dense": rng.normal(size=(16, 2)).astype(np.float32),
            "label": (rng.random((16, 1)) < 0.4).astype(np.float32),
        }
        for _ in range(3)
    ]
    assert check_resume(one, ck).step == 3
    assert evaluate(one, data, checkpoint=ck) == evaluate(two, data, checkpoint=ck)
    other = wide_deep(vocab=50, num_slots=3, num_dense=2, hidden=(8,), optimizer=nn.Adam(lr=0.01), dim=4)
    with pytest.raises(CheckpointError, match="shape"):
        check_resume(transpile(other.main, CPU_ONLY), ck)
