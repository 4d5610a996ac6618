"""Checkpoints: a 2-shard save loads into 3 shards with identical pulls and optimizer state; a save
killed mid-way (a real SIGKILL) and a corrupted file are detected, never loaded as valid."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.ps import CheckpointError, Servers, Shard, save_shards

REPO = Path(__file__).resolve().parents[1]
SPECS = [
    {"name": "emb", "kind": "sparse", "shape": [-1, 4], "dtype": "float32",
     "initializer": {"type": "normal", "std": 0.1, "seed": 3},
     "optimizer": {"type": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,
                   "lazy_mode": 1}},
    {"name": "wide", "kind": "sparse", "shape": [1000, 1], "dtype": "float32",
     "initializer": {"type": "uniform", "seed": 4}, "optimizer": {"type": "adagrad", "lr": 0.1}},
    {"name": "fc_w", "kind": "dense", "shape": [8, 3], "dtype": "float32",
     "initializer": {"type": "xavier", "seed": 5}, "optimizer": {"type": "adagrad", "lr": 0.1}},
    {"name": "fc_b", "kind": "dense", "shape": [3], "dtype": "float32",
     "initializer": {"type": "constant", "value": 0.0}, "optimizer": {"type": "sgd", "lr": 0.1}},
]


def _train(push, steps: int = 5, seed: int = 0) -> np.ndarray:
    """Push some gradients through `push(table, grad, ids)`; the ids it touched."""
    rng = np.random.default_rng(seed)
    seen = []
    for _ in range(steps):
        ids = rng.integers(0, 10**12, size=30)   # unbounded vocab: any int64 id
        push("emb", rng.normal(size=(30, 4)).astype(np.float32), ids)
        push("wide", rng.normal(size=(30, 1)).astype(np.float32), ids % 1000)
        push("fc_w", rng.normal(size=(8, 3)).astype(np.float32), None)
        push("fc_b", rng.normal(size=3).astype(np.float32), None)
        seen.append(ids)
    return np.concatenate(seen)


def _pulls(pull, ids: np.ndarray) -> dict:
    fresh = np.arange(5, 25)  # never touched: created from the initializer on both sides
    return {"emb": pull("emb", np.concatenate([ids, fresh])), "wide": pull("wide", ids % 1000),
            "fc_w": pull("fc_w", None), "fc_b": pull("fc_b", None)}


def _same(a: dict, b: dict) -> None:
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_two_shard_checkpoint_loads_into_three_shards(tmp_path):
    with Servers(SPECS, num_shards=2, checkpoint_root=tmp_path) as two, \
            Servers(SPECS, num_shards=3, checkpoint_root=tmp_path) as three:
        c2, c3 = two.client(), three.client()
        push2 = lambda t, g, i: c2.push(t, g, i)
        pull2 = lambda t, i: c2.pull(t, i)
        c2.assign("fc_b", np.array([1, 2, 3], np.float32))  # e.g. imported weights
        ids = _train(push2)
        c2.save(tmp_path / "ckpt")
        c3.load(tmp_path / "ckpt")
        _same(_pulls(pull2, ids), _pulls(lambda t, i: c3.pull(t, i), ids))
        # optimizer state (Adam moments, beta powers, Adagrad accumulators) came along too
        _train(push2, steps=2, seed=1)
        _train(lambda t, g, i: c3.push(t, g, i), steps=2, seed=1)
        _same(_pulls(pull2, ids), _pulls(lambda t, i: c3.pull(t, i), ids))
        # and into one in-process shard
        one = Shard(SPECS)
        c2.save(tmp_path / "again")
        one.load(tmp_path / "again")
        _same(_pulls(pull2, ids), _pulls(one.pull, ids))
        files = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["files"]
        assert len(files) == 2 * 2 + 2  # two sparse tables on 2 shards + two dense tables
        c2.close()
        c3.close()


def _saved_shards(path: Path) -> list[Shard]:
    shards = [Shard(SPECS, shard=k, num_shards=2) for k in range(2)]

    def push(table, grad, ids):
        for s in shards:
            if table in s.tables:
                if ids is None:
                    s.push(table, grad)
                else:
                    from runtime.ps import shard_of

                    mine = shard_of(ids, 2) == s.shard
                    s.push(table, grad[mine], ids[mine])

    _train(push)
    save_shards(shards, path)
    return shards


KILLER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.test_ps_checkpoint import _saved_shards
real_replace, count = os.replace, []
def replace_then_die(src, dst):
    real_replace(src, dst)
    count.append(dst)
    if len(count) == 2:              # two data files written, manifest not yet
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace_then_die
_saved_shards(Path({path!r}))
"""


def test_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "ckpt"
    _saved_shards(path)                                  # a complete checkpoint first
    expected = _pulls(_loaded(path).pull, np.arange(5))
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    proc = subprocess.run([sys.executable, "-c", KILLER.format(repo=str(REPO), path=str(path))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before   # not a byte changed
    _same(_pulls(_loaded(path).pull, np.arange(5)), expected)
    stage = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.new-")]
    assert len(stage) == 1 and "manifest.json" not in os.listdir(stage[0])  # the unfinished save
    with pytest.raises(CheckpointError, match="incomplete: it has no manifest.json"):
        Shard(SPECS).load(stage[0])


def _loaded(path: Path) -> Shard:
    shard = Shard(SPECS)
    shard.load(path)
    return shard


def test_corrupted_file_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    _saved_shards(path)
    victim = next(p for p in path.iterdir() if p.suffix == ".npz")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"file '{victim.name}' .* does not match"):
        Shard(SPECS).load(path)
