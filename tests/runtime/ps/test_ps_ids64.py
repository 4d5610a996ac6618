"""64-bit ids end to end: raw FNV-1a 64 hashes from a schema (no modulo), unbounded tables that take
any 64-bit id (uint64 exactly), `TranspileConfig.unbounded`, the existing-rows export by default.

References: FNV-1a written out byte by byte here; the birthday-problem expectation of the modulo
form's collisions; SGD on a numpy dict of rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from ops_registry import init_rows
from runtime.data.files import fnv
from runtime.data.files.schema import Schema
from runtime.ps import PSError, make_table
from runtime.ps.tiered_store import EngineMemory
from transpiler import TranspileConfig, transpile
from transpiler import builder as nn
from transpiler.models import wide_deep
from transpiler.tables import TableSpec

ENGINE_FLOOR = EngineMemory.of_budget(1).nbytes  # RocksDB's share of a budget under 8 MiB (tiered_store)

MASK = (1 << 64) - 1


def fnv1a_64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


def test_hash64_ids_are_the_raw_fnv1a_64_hash_as_int64_bits():
    values = ["", "a", "user-17", "Café", "x" * 40]
    col = pa.array(values, pa.string())
    got = fnv.ids(col, b"c\x1f", 1, 0)
    want = [fnv1a_64(b"c\x1f" + v.encode()) for v in values]
    assert got.dtype == np.int64 and got.view(np.uint64).tolist() == want
    assert (got < 0).any() or max(want) < 1 << 63  # ids past 2^63 keep their bits (negative int64)
    schema = Schema.from_dict({"label": "y", "sparse": ["c"], "hash64": True, "vocab": 10})
    assert schema.ids(col, "c").view(np.uint64).tolist() == want  # no modulo: vocab sizes nothing
    with pytest.raises(ValueError, match="hash64 must be true or false"):
        Schema.from_dict({"label": "y", "sparse": ["c"], "hash64": "yes"})


def test_ten_million_distinct_values_collide_never_in_64_bits_and_often_modulo_a_million():
    n, vocab = 10_000_000, 1_000_000
    col = pc.cast(pa.array(np.arange(n, dtype=np.int64)), pa.string())  # 10^7 distinct values
    raw = np.sort(fnv.ids(col, b"item\x1f", 1, 0))
    assert np.count_nonzero(raw[1:] == raw[:-1]) == 0  # 64-bit: no two values share an id
    mod = np.sort(fnv.ids(col, b"item\x1f", 1, vocab))
    collisions = n - (np.count_nonzero(mod[1:] != mod[:-1]) + 1)
    m = vocab - 1  # ids [1, vocab)
    expected = n - m * (1 - (1 - 1 / m) ** n)  # values that land on an id taken already
    print(f"collisions of {n} distinct values: 64-bit 0, modulo {vocab} {collisions}")
    assert collisions == pytest.approx(expected, rel=1e-3)


def spec(vocab=-1, init=None, opt=None):
    return TableSpec(
        "emb",
        "sparse",
        [vocab, 3],
        initializer=init or {"type": "uniform", "low": -0.1, "high": 0.1, "seed": 5},
        optimizer=opt or {"type": "sgd", "lr": 0.5},
    )


@pytest.mark.parametrize("storage", [None, "disk"])
def test_an_unbounded_table_takes_every_64_bit_id_exactly(tmp_path, storage):
    s = spec()
    if storage:
        from dataclasses import replace

        s = replace(s, storage="disk", memory_budget=ENGINE_FLOOR + 4096)
    t = make_table(s)
    ids = np.array([MASK, 1 << 63, 0, 12345, MASK - 1], np.uint64)
    rng = np.random.default_rng(0)
    ref = {int(i): init_rows(s.initializer, (1, 3), "float32", [int(i) & MASK])[0] for i in ids}
    for _ in range(3):  # pushes on uint64 ids and on the same bits as int64 reach the same rows
        g = rng.normal(size=(ids.size, 3)).astype(np.float32)
        t.push(g, ids if _ % 2 else ids.view(np.int64))
        for i, row in zip(ids.tolist(), g, strict=True):
            ref[i] = ref[i] - np.float32(0.5) * row
    np.testing.assert_allclose(t.pull(ids), np.stack([ref[i] for i in ids.tolist()]), rtol=1e-6)
    got = t.state_dict()["ids"]
    assert sorted(got.view(np.uint64).tolist()) == sorted(ref)
    frozen = make_table(TableSpec("w", "sparse", [-1, 2]))
    with pytest.raises(PSError, match="rows \\[18446744073709551615\\] were never assigned"):
        frozen.pull(np.array([MASK], np.uint64))


def test_a_bounded_table_names_a_huge_uint64_id_as_it_is():
    t = make_table(spec(vocab=100))
    with pytest.raises(PSError, match="18446744073709551615"):
        t.pull(np.array([3, MASK], np.uint64))


def test_transpile_marks_the_embedding_tables_unbounded():
    m = wide_deep(num_slots=2, vocab=50, dim=4, hidden=(4,), optimizer=nn.SGD(lr=0.1))
    plan = transpile(m.main, TranspileConfig(unbounded=True))
    sparse = [t for t in plan.tables if t.kind == "sparse"]
    assert sparse and all(t.shape[0] == -1 for t in sparse)
    assert all(t.shape[0] > 0 for t in plan.tables if t.kind == "dense")
    one = sparse[0].name
    plan = transpile(m.main, TranspileConfig(unbounded=[one]))
    assert {t.name: t.shape[0] for t in plan.tables if t.kind == "sparse"}[one] == -1
    with pytest.raises(ValueError, match="not sparse tables"):
        transpile(m.main, TranspileConfig(unbounded=["nope"]))
    with pytest.raises(ValueError, match="unbounded must be"):
        TranspileConfig(unbounded="all")


class Hashed64:
    """SyntheticCTR batches whose ids are spread over all 64 bits (an odd multiplier, mod 2^64)."""

    def __init__(self):
        from runtime.data import SyntheticCTR

        self.base = SyntheticCTR(vocab=50, num_slots=2)

    def batch(self, i, n):
        b = dict(self.base.batch(i, n))
        with np.errstate(over="ignore"):
            b["sparse"] = (b["sparse"].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
        return b


def test_an_unbounded_plan_trains_on_64_bit_ids_and_exports_the_existing_rows(tmp_path):
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from runtime.driver.train import train
    from runtime.evaluation.evaluate import export, predict, remap_ids

    m = wide_deep(num_slots=2, vocab=50, dim=4, hidden=(4,), optimizer=nn.SGD(lr=0.1))
    plan = transpile(m.main, TranspileConfig(unbounded=True))
    data, ckpt = Hashed64(), tmp_path / "ckpt"
    run = dict(batch_size=16, trainers={"cpu": 1, "gpu": 1}, allow_emulation=True, progress=False)
    hist = train(plan, data, steps=2, checkpoint=str(ckpt), **run)
    path = export(plan, tmp_path / "model.onnx", checkpoint=str(ckpt))  # unbounded: existing rows
    with np.load(tmp_path / "model.ids.npz") as z:
        ids = z["sparse"]
    seen = np.unique(np.concatenate([data.batch(i, 16)["sparse"] for i in range(2)]))
    np.testing.assert_array_equal(ids, seen)
    assert (seen < 0).any()  # ids past 2^63 trained and exported
    for name in (t.name for t in plan.tables if t.kind == "sparse"):  # per-shard counts in the history
        assert hist.tables[name]["shards"] == [
            {"rows": seen.size, "admitted": seen.size, "evicted": 0, "spilled": 0}
        ]
    batch = data.batch(0, 16)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, remap_ids({"sparse": ids}, {"sparse": batch["sparse"], "dense": batch["dense"]}))[0]
    np.testing.assert_allclose(got, predict(plan, [batch], checkpoint=str(ckpt)), rtol=1e-5, atol=1e-6)


def test_transpile_sets_delta_checkpoints_and_the_lifecycle_on_sparse_tables_only():
    m = wide_deep(num_slots=2, vocab=50, dim=4, hidden=(4,), optimizer=nn.SGD(lr=0.1))
    cfg = TranspileConfig(checkpoint_delta_every=4, lifecycle={"ttl_passes": 3})
    plan = transpile(m.main, cfg)
    for t in plan.tables:
        sparse = t.kind == "sparse"
        assert (t.delta_every, t.lifecycle) == ((4, {"ttl_passes": 3}) if sparse else (None, None))
        assert TableSpec.from_dict(t.to_dict()) == t


def test_hetps_transpile_unbounded_writes_unbounded_embedding_tables(tmp_path):
    from runtime.cli.app import main
    from transpiler.plan import Plan

    wide_deep(num_slots=2, vocab=50, dim=4, hidden=(4,), optimizer=nn.SGD(lr=0.1)).main.save(tmp_path / "wd")
    assert main(["transpile", str(tmp_path / "wd.json"), "--out", str(tmp_path / "p"), "--unbounded"]) == 0
    tables = Plan.load(tmp_path / "p").tables
    assert {t.shape[0] for t in tables if t.kind == "sparse"} == {-1}
    assert all(t.shape[0] > 0 for t in tables if t.kind == "dense")


class HashedU64(Hashed64):
    """Hashed64's batches with the ids as uint64 (a data source's raw 64-bit hashes, many >= 2^63)."""

    def batch(self, i, n):
        b = super().batch(i, n)
        b["sparse"] = b["sparse"].view(np.uint64)
        return b


def test_uint64_feeds_at_and_above_2_63_train_unbounded_tables_and_export(tmp_path):
    """A uint64 id feed read only by unbounded tables' lookups takes ids >= 2^63 (bounded: refused,
    tests/runtime/driver/test_clear_errors.py): trained, checkpointed and exported as the same
    64-bit ids, and the training equals the int64-bits run of the same ids."""
    from runtime.driver.train import train
    from runtime.evaluation.evaluate import export

    m = wide_deep(num_slots=2, vocab=50, dim=4, hidden=(4,), optimizer=nn.SGD(lr=0.1))
    plan = transpile(m.main, TranspileConfig(unbounded=True))
    data, ckpt = HashedU64(), tmp_path / "ckpt"
    seen = np.unique(np.concatenate([data.batch(i, 16)["sparse"].ravel() for i in range(3)]))
    assert seen.dtype == np.uint64 and (seen >= np.uint64(1 << 63)).any()
    run = dict(batch_size=16, trainers={"cpu": 1, "gpu": 1}, allow_emulation=True, progress=False)
    hist = train(plan, data, steps=3, checkpoint=str(ckpt), return_params=False, **run)
    ref = train(plan, Hashed64(), steps=3, **run)  # the same ids as int64 bits
    np.testing.assert_array_equal(hist.loss, ref.loss)
    export(plan, tmp_path / "model.onnx", checkpoint=str(ckpt))
    with np.load(tmp_path / "model.ids.npz") as z:
        np.testing.assert_array_equal(np.sort(z["sparse"].view(np.uint64)), seen)
