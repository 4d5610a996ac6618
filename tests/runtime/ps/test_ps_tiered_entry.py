"""Admission (`entry`) and eviction by pushes (`evict_after`) on disk tables (runtime/ps/tiered.py):
each row's push clock of its last touch (EntryLast) is part of its disk record, rows on disk count
as existing for admission, and rows only on disk expire as those in RAM do. Reference: the RAM
`SparseTable` with the same rules (runtime/ps/entry.py), whose behaviour tests/runtime/ps/
test_ps_entry.py checks by hand, under random pull / push sequences with a budget small enough that
rows spill and come back; checkpoints round-trip into disk and RAM tables and other shard counts."""

from dataclasses import replace

import numpy as np
import pytest

from runtime.ps import Shard, SparseTable, make_table, save_shards
from runtime.ps.sharding import shard_of
from runtime.ps.tiered import TieredSparseTable, budget_for_rows
from transpiler.tables import TableSpec

DIM = 3
INIT = {"type": "uniform", "low": -0.5, "high": 0.5, "seed": 5}
RULES = {
    "count+evict": dict(entry={"type": "count", "threshold": 2}, evict_after=8),
    "probability": dict(entry={"type": "probability", "p": 0.5, "seed": 3}),
    "evict only": dict(evict_after=6),
}


def spec(vocab: int = -1, disk: bool = True, **rules) -> TableSpec:
    s = TableSpec(
        "emb", "sparse", [vocab, DIM], initializer=INIT, optimizer={"type": "adagrad", "lr": 0.1}, **rules
    )
    rows = 30 if vocab < 0 else 40  # RAM tier rows (the budget adds RocksDB's share and the index)
    return replace(s, storage="disk", memory_budget=budget_for_rows(s, rows)) if disk else s


def same_state(ram: SparseTable, disk: TieredSparseTable) -> None:
    a, b = ram.state_dict(), disk.state_dict()
    order = np.argsort(a["ids"])
    assert set(a) == set(b), (sorted(a), sorted(b))
    for k, want in a.items():
        per_row = want.shape[:1] == a["ids"].shape and k not in ("WaitIds", "WaitCount", "WaitSeen")
        np.testing.assert_array_equal(b[k], want[order] if per_row else want, err_msg=k)


def drive(tables, steps: int, seed: int) -> None:
    """The same random pulls and pushes on every table; their pulled rows must agree."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        ids = np.unique(rng.zipf(1.2, 30) % 400).astype(np.int64)
        pulled = [t.pull(ids) for t in tables]
        for p in pulled[1:]:
            np.testing.assert_array_equal(p, pulled[0], err_msg=f"step {step}")
        grad = rng.normal(size=(ids.size, DIM)).astype(np.float32)
        for t in tables:
            t.push(grad, ids)


@pytest.mark.parametrize("rules", list(RULES.values()), ids=list(RULES))
@pytest.mark.parametrize("vocab", [400, -1], ids=["direct-index", "unbounded"])
def test_random_sequences_match_the_ram_table(rules, vocab):
    ram, disk = SparseTable(spec(vocab, disk=False, **rules)), make_table(spec(vocab, **rules))
    assert isinstance(disk, TieredSparseTable)
    drive([ram, disk], 150, seed=1)
    assert disk.stats.evicted > 0 and disk.stats.disk_hits > 0  # rows went to disk and came back
    assert disk.resident() <= disk.max_rows
    assert len(disk) == len(ram) and disk.table_counts()["evicted"] == ram.table_counts()["evicted"]
    if rules.get("evict_after"):
        assert ram.table_counts()["evicted"] > 0  # expiry happened, on disk rows too
    probe = np.arange(400)
    np.testing.assert_array_equal(disk.peek(probe), ram.peek(probe))
    same_state(ram, disk)
    disk.close()


def test_save_load_and_shard_checkpoints_keep_the_clocks(tmp_path):
    rules = RULES["count+evict"]
    ram = SparseTable(spec(disk=False, **rules))
    disk = make_table(spec(**rules))
    drive([ram, disk], 60, seed=2)
    disk.save(tmp_path / "saved")
    back = make_table(spec(**rules))
    back.load(tmp_path / "saved")
    same_state(ram, back)
    drive([ram, disk, back], 60, seed=3)  # the loaded table admits and expires as the others
    same_state(ram, back)
    shards = [Shard([spec(**rules)], shard=k, num_shards=2) for k in range(2)]
    rng = np.random.default_rng(4)
    for _ in range(40):
        ids = np.unique(rng.integers(0, 300, 40))
        grad = rng.normal(size=(ids.size, DIM)).astype(np.float32)
        for k, s in enumerate(shards):
            mine = shard_of(ids, 2) == k
            s.pull("emb", ids[mine])
            s.push("emb", grad[mine], ids[mine])
    save_shards(shards, tmp_path / "ckpt")
    want = {k: s.tables["emb"].state_dict() for k, s in enumerate(shards)}
    for disk_target, n in ((True, 3), (False, 3), (True, 2)):
        loaded = [Shard([spec(disk=disk_target, **rules)], shard=k, num_shards=n) for k in range(n)]
        for s in loaded:
            s.load(tmp_path / "ckpt")
        rows = {i for w in want.values() for i in w["ids"].tolist()}
        waiting = {i for w in want.values() for i in w["WaitIds"].tolist()}
        got = [s.tables["emb"].state_dict() for s in loaded]
        assert {i for g in got for i in g["ids"].tolist()} == rows
        assert {i for g in got for i in g["WaitIds"].tolist()} == waiting
        assert {int(g["EntryClock"][0]) for g in got} == {int(w["EntryClock"][0]) for w in want.values()}
        for s in loaded + shards[:0]:
            s.close()
    for t in (disk, back):
        t.close()
    for s in shards:
        s.close()
