"""Data readers and the AUC metric against hand-computed references."""

import zlib

import numpy as np
import pytest

from runtime.data import ArrayReader, CriteoReader, SyntheticCTR
from runtime.evaluation.metrics import auc
from runtime.exec.device import array_module, cuda_available


def test_criteo_reader_parses_and_shards(tmp_path):
    rows = []
    for i in range(5):
        ints = [str(i), "", "-3"] + ["7"] * 10
        cats = [f"c{i}"] + [""] * 25
        rows.append("\t".join([str(i % 2)] + ints + cats))
    path = tmp_path / "day_0.txt"
    path.write_text("\n".join(rows) + "\n")
    batches = list(CriteoReader(path, vocab=1000, batch_size=2, shard=(1, 2)))  # lines 1 and 3
    assert len(batches) == 1
    b = batches[0]
    assert b["label"].ravel().tolist() == [1.0, 1.0]
    np.testing.assert_allclose(b["dense"][:, 0], np.log1p([1.0, 3.0]), rtol=1e-6)
    assert b["dense"][0, 1] == 0.0 and b["dense"][0, 2] == 0.0  # empty and negative -> 0
    assert b["sparse"][0, 0] == zlib.crc32(b"0:c1") % 1000
    assert b["sparse"][1, 5] == zlib.crc32(b"5:") % 1000


def test_criteo_reader_rejects_malformed(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="40"):
        list(CriteoReader(path, vocab=10, batch_size=4))


def test_array_reader_shards_cover_everything_once():
    arrays = {"x": np.arange(10)}
    seen = [b["x"] for i in range(3) for b in ArrayReader(arrays, 2, shard=(i, 3))]
    assert sorted(np.concatenate(seen).tolist()) == list(range(10))


def test_synthetic_is_deterministic_and_learnable():
    d = SyntheticCTR(vocab=500, seed=3)
    a, b = d.batch(4, 64), d.batch(4, 64)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert a["sparse"].max() < 500 and a["sparse"].min() >= 0
    assert d.teacher_auc(5000) > 0.8


def test_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    p = np.round(rng.random(200), 1)  # many ties
    pos, neg = p[y == 1], p[y == 0]
    ref = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        len(pos) * len(neg)
    )
    assert auc(y, p) == pytest.approx(ref, abs=1e-12)


@pytest.mark.skipif(cuda_available(), reason="this machine has a CUDA device")
def test_gpu_trainer_needs_explicit_emulation():
    with pytest.raises(RuntimeError, match="allow_emulation"):
        array_module("gpu")
    xp, desc = array_module("gpu", allow_emulation=True)
    assert xp is np and "EMULATED" in desc
