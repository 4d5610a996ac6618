"""Delta checkpoints (runtime/ps/delta.py) and rows changed since a mark (runtime/ps/changes.py).

Reference: the same pull/push sequence checkpointed with full saves only; restored tables must be
identical, array by array, to those of the delta chain (RAM, tiered, admission + eviction tables;
same and other shard counts). The changed ids are checked against the ids the test itself sent."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from runtime.ps import make_table
from runtime.ps.checkpoint import read_manifest
from runtime.ps.shard import Shard, save_shards
from runtime.ps.sharding import shard_of
from runtime.ps.tiered_store import EngineMemory
from transpiler.tables import TableSpec

ENGINE_FLOOR = EngineMemory.of_budget(1).nbytes  # RocksDB's share of a budget under 8 MiB (tiered_store)

INIT = {"type": "uniform", "low": -0.1, "high": 0.1, "seed": 3}
BASE = TableSpec("emb", "sparse", [-1, 4], initializer=INIT, optimizer={"type": "adagrad", "lr": 0.1})
KINDS = {
    "ram": BASE,
    "disk": replace(BASE, storage="disk", memory_budget=ENGINE_FLOOR + 16000),
    "entry": replace(BASE, entry={"type": "count", "threshold": 2}, evict_after=6),
    "disk-entry": replace(
        BASE,
        storage="disk",
        memory_budget=ENGINE_FLOOR + 16000,
        entry={"type": "count", "threshold": 2},
        evict_after=6,
    ),
    "life": replace(
        BASE,
        storage="disk",
        memory_budget=ENGINE_FLOOR + 16000,
        lifecycle={"ttl_passes": 2, "delete_threshold": 0.05},
    ),
}


def run(spec, root, shards=2, saves=5, seed=0, restart=False):
    """Train shards on a fixed random stream, saving root/step-i after each of `saves` rounds;
    `restart`: before each round but the first, new shards load the last save (an online pass)."""
    group = [Shard([spec], shard=k, num_shards=shards) for k in range(shards)]
    rng = np.random.default_rng(seed)
    for i in range(saves):
        if restart and i:
            for s in group:
                s.close()
            group = [Shard([spec], shard=k, num_shards=shards) for k in range(shards)]
            for s in group:
                s.load(root / f"step-{i - 1}")
        for _ in range(4):
            ids = np.unique(rng.zipf(1.3, 40) % 3000 + (1 << 62) * rng.integers(0, 2))
            grad = rng.normal(size=(ids.size, 4)).astype(np.float32)
            for k, s in enumerate(group):
                mine = shard_of(ids, shards) == k
                s.pull("emb", ids[mine])
                s.push("emb", grad[mine], ids[mine])
                if s.tables["emb"].life is not None:
                    s.tables["emb"].show_click(ids[mine], rng.random(int(mine.sum())) < 0.3)
        for s in group:  # a pass end (rows removed by their lifecycle)
            if s.tables["emb"].life is not None:
                s.tables["emb"].shrink()
        if i == 2:  # rows dropped between saves must be dropped on restore too
            for k, s in enumerate(group):
                gone = np.arange(0, 3000, 7)
                s.tables["emb"].remove(gone[shard_of(gone, shards) == k])
        save_shards(group, root / f"step-{i}")
    return group


def state(path, spec, shards=1):
    out = []
    for k in range(shards):
        s = Shard([spec], shard=k, num_shards=shards)
        s.load(path)
        d = s.tables["emb"].state_dict()
        order = np.argsort(d["ids"])
        per_row = {"ids", "Param", "Moment", "EntryLast", "Show", "Click", "Unseen"}
        out.append({key: (a[order] if key in per_row else a) for key, a in d.items()})
        s.close()
    return out


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.slow) if k == "disk" else k for k in sorted(KINDS)]
)  # (life is a tiered table too)
def test_a_delta_chain_restores_the_tables_a_full_save_run_restores(tmp_path, kind):
    spec = KINDS[kind]
    full = run(spec, tmp_path / "full")
    chain = run(replace(spec, delta_every=3), tmp_path / "chain")
    for s in (*full, *chain):
        s.close()
    for i in range(5):
        doc = read_manifest(tmp_path / "chain" / f"step-{i}")
        deltas = sorted({e.get("delta", 0) for e in doc["files"]})
        assert deltas == list(range(i % 3 + 1))  # full at 0 and 3; deltas between
        for shards in (1, 3) if i == 4 else (2,):
            same(
                state(tmp_path / "full" / f"step-{i}", spec, shards),
                state(tmp_path / "chain" / f"step-{i}", spec, shards),
            )
    for i in range(4):  # older checkpoints removed (a run's keep): the newer ones stay whole
        shutil.rmtree(tmp_path / "chain" / f"step-{i}")
    same(state(tmp_path / "full" / "step-4", spec, 2), state(tmp_path / "chain" / "step-4", spec, 2))


@pytest.mark.parametrize("kind", ["ram", "life"])
def test_the_chain_goes_on_after_a_load_by_as_many_shards_and_restores_as_full_saves(tmp_path, kind):
    """Shards restarted before every round from the last save (as the online loop's servers):
    full at 0 and 3, deltas between, the same tables as full saves of the unrestarted run."""
    spec = KINDS[kind]
    for s in run(spec, tmp_path / "full"):
        s.close()
    for s in run(replace(spec, delta_every=3), tmp_path / "chain", restart=True):
        s.close()
    for i in range(5):
        doc = read_manifest(tmp_path / "chain" / f"step-{i}")
        assert sorted({e.get("delta", 0) for e in doc["files"]}) == list(range(i % 3 + 1))
        same(
            state(tmp_path / "full" / f"step-{i}", spec, 2), state(tmp_path / "chain" / f"step-{i}", spec, 2)
        )


def test_a_load_by_another_shard_count_makes_the_next_save_full(tmp_path):
    spec = replace(KINDS["ram"], delta_every=5)
    s = Shard([spec], shard=0, num_shards=2)
    s.push("emb", np.ones((4, 4), np.float32), s_ids(2))
    save_shards([s, Shard([spec], shard=1, num_shards=2)], tmp_path / "a")
    one = Shard([spec])
    one.load(tmp_path / "a")
    one.push("emb", np.ones((1, 4), np.float32), s_ids(2)[:1])
    save_shards([one], tmp_path / "b")
    assert all("delta" not in e for e in read_manifest(tmp_path / "b")["files"])
    same2 = Shard([spec], shard=0, num_shards=2)
    same2.load(tmp_path / "a")
    same2.push("emb", np.ones((1, 4), np.float32), s_ids(2)[:1])
    save_shards([same2, Shard([spec], shard=1, num_shards=2)], tmp_path / "c")
    assert any(e.get("delta") == 1 for e in read_manifest(tmp_path / "c")["files"])


def s_ids(shards):
    """Four ids that shard 0 of `shards` holds."""
    ids = np.arange(200)
    return ids[shard_of(ids, shards) == 0][:4]


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_a_pass_end_is_replayed_on_load_not_written_row_by_row(tmp_path, storage):
    """ttl_passes 2. Pass 1 pushes rows 0-499, then a full save; pass 2 pushes 4 rows: its delta
    holds those 4 and Shrinks = 1, and restores the 497 others one unseen pass older (2, by
    hand); pass 3 pushes nothing: those 497 are gone, and the restore (base + 2 deltas) is the live
    table, row for row."""
    spec = replace(BASE, lifecycle={"ttl_passes": 2}, delta_every=5)
    if storage == "disk":
        spec = replace(spec, storage="disk", memory_budget=ENGINE_FLOOR + 16000)
    s = Shard([spec])
    for lo in range(0, 500, 100):
        s.push("emb", np.ones((100, 4), np.float32), np.arange(lo, lo + 100))
    s.tables["emb"].shrink()
    save_shards([s], tmp_path / "a")
    touched = np.array([3, 10, 499, 1000])
    s.push("emb", np.ones((4, 4), np.float32), touched)
    s.tables["emb"].shrink()
    save_shards([s], tmp_path / "b")
    (d,) = [e for e in read_manifest(tmp_path / "b")["files"] if e.get("delta")]
    with np.load(tmp_path / "b" / d["file"]) as z:
        assert z["ids"].tolist() == touched.tolist() and z["Shrinks"].tolist() == [1]
    b = state(tmp_path / "b", spec)[0]
    assert b["ids"].size == 501 and b["Unseen"].tolist().count(2.0) == 497
    assert b["Unseen"][np.isin(b["ids"], touched)].tolist() == [1.0] * 4
    assert s.tables["emb"].shrink() == 497
    save_shards([s], tmp_path / "c")
    c = state(tmp_path / "c", spec)[0]
    assert c["ids"].tolist() == touched.tolist()
    same([c], [state_of(s)])
    s.close()


def state_of(s: Shard) -> dict:
    d = s.tables["emb"].state_dict()
    order = np.argsort(d["ids"])
    return {k: a[order] if a.shape[:1] == order.shape else a for k, a in d.items()}


def test_a_delta_holds_the_rows_touched_since_the_save_before(tmp_path):
    spec = replace(KINDS["ram"], delta_every=10)
    s = Shard([spec])
    s.push("emb", np.ones((500, 4), np.float32), np.arange(500))
    save_shards([s], tmp_path / "a")
    touched = np.array([3, 10, 499, 1000])
    s.push("emb", np.ones((4, 4), np.float32), touched)
    save_shards([s], tmp_path / "b")
    doc = json.loads((tmp_path / "b" / "manifest.json").read_text())
    (d,) = [e for e in doc["files"] if e.get("delta")]
    with np.load(tmp_path / "b" / d["file"]) as z:
        assert z["ids"].tolist() == touched.tolist() and z["Deleted"].size == 0
    base = next(e for e in doc["files"] if "delta" not in e)
    assert (tmp_path / "a" / base["file"]).stat().st_ino == (tmp_path / "b" / base["file"]).stat().st_ino


def test_a_failed_or_removed_previous_save_makes_the_next_save_full(tmp_path):
    s = Shard([replace(KINDS["ram"], delta_every=5)])
    s.push("emb", np.ones((5, 4), np.float32), np.arange(5))
    save_shards([s], tmp_path / "a")
    shutil.rmtree(tmp_path / "a")
    s.push("emb", np.ones((1, 4), np.float32), np.arange(1))
    save_shards([s], tmp_path / "b")
    assert all("delta" not in e for e in read_manifest(tmp_path / "b")["files"])
    assert state(tmp_path / "b", KINDS["ram"])[0]["ids"].tolist() == list(range(5))


@pytest.mark.parametrize("kind", ["ram", "disk"])
def test_changed_since_a_mark_lists_the_rows_written_and_removed(kind):
    t = make_table(KINDS[kind])
    for lo in range(0, 300, 50):  # (the tiered table's RAM tier holds 71 rows: most go to disk)
        t.push(np.ones((50, 4), np.float32), np.arange(lo, lo + 50))
    t.mark("publish")
    t.push(np.ones((3, 4), np.float32), np.array([5, 250, 7000]))
    t.assign(np.zeros((1, 4), np.float32), np.array([8000]))
    t.remove(np.array([6, 7000, 99999]))
    got = t.changed_since("publish")
    assert got.ids.tolist() == [5, 250, 8000]
    assert set(got.removed.tolist()) - {99999} == {6, 7000}  # (99999: never a row; may be listed)
    assert sorted(t.ids().tolist()) == sorted({*range(300), 8000} - {6})  # RAM and disk rows
    rows = t.rows_of(got.ids)
    np.testing.assert_array_equal(rows["Param"], t.peek(got.ids))
    t.mark("publish")
    assert t.changed_since("publish").ids.size == 0
    with pytest.raises(KeyError, match="no mark 'other'"):
        t.changed_since("other")
