"""The memory a tiered table (runtime/ps/tiered.py) holds stays inside its memory budget: the split
of the budget between RocksDB's block cache, its memtables, the id index and the RAM tier, checked
against figures computed by hand, then against what the engine and the RAM arrays hold after a
stream that spills; and (slow) the resident memory growth of a child process running the benchmark's
Zipf stream on 2 million rows under 16 MiB."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.ps import make_table
from runtime.ps.tiered import BudgetSplit
from transpiler.tables import TableSpec

MiB = 1 << 20
INIT = {"type": "uniform", "low": -0.05, "high": 0.05, "seed": 1}
BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "tiered_table.py"


def spec(vocab: int, budget: str) -> TableSpec:
    opt = {"type": "adagrad", "lr": 0.01}
    return TableSpec(
        "emb", "sparse", [vocab, 16], initializer=INIT, optimizer=opt, storage="disk", memory_budget=budget
    )


@pytest.mark.parametrize(
    "vocab, direct, row_bytes",
    [
        (-1, 0, 128 + 8 + 16),  # unbounded: the sorted index, 16 bytes a resident row
        (2_000_000, 0, 128 + 8 + 16),  # a direct index of 8 MB would take over 1/8 of 16 MiB
        (200_000, 800_000, 128 + 8),  # 4 bytes x 200 000 ids: within 1/8, counted in the budget
    ],
)
def test_budget_split_is_hand_computed_and_its_parts_sum_within_the_budget(vocab, direct, row_bytes):
    # 16 MiB, Adagrad dim 16: a record is Param + Moment = 2 x 16 float32 = 128 bytes, + 8 (LRU stamp).
    # RocksDB: block cache max(1 MiB, 16 MiB / 32) = 1 MiB, two memtables of max(256 KiB, 512 KiB).
    t = make_table(spec(vocab, "16MiB"))
    try:
        split = t.split
        assert split.engine.block_cache == 1 * MiB and split.engine.write_buffer == 512 << 10
        assert split.direct_index == direct and split.row_bytes == row_bytes
        ram_tier = 16 * MiB - 1 * MiB - 2 * (512 << 10) - direct
        assert split.ram_tier == ram_tier and t.max_rows == ram_tier // row_bytes
        assert split.engine.nbytes + split.direct_index + split.ram_tier == 16 * MiB
        rng = np.random.default_rng(0)
        for _ in range(30):  # random batches that spill to disk and come back
            ids = np.unique(rng.integers(0, 2_000_000 if vocab < 0 else vocab, 30_000))
            t.pull(ids)
            t.push(np.full((ids.size, 16), 1e-3, np.float32), ids)
        assert t.stats.evicted > 0 and t.stats.disk_hits > 0
        assert t.memory_bytes() <= split.ram_tier + split.direct_index  # rows, state, stamps, index
        db = t.store.db  # RocksDB's own counts
        assert db.property_int_value("rocksdb.block-cache-usage") <= split.engine.block_cache
        # A memtable is switched after the write that fills it, and an eviction is one WriteBatch of
        # 10% of max_rows rows + the request's new rows (30 000 at most here; 128-byte record, 8-byte
        # key, ~10% memtable overhead): the memtables may hold that much more than their share
        # (outside the budget; docs/tables.md).
        evict = (t.max_rows - int(0.9 * t.max_rows) + 30_000) * (128 + 8) * 11 // 10
        memtables = db.property_int_value("rocksdb.cur-size-all-mem-tables")
        assert memtables <= 2 * (split.engine.write_buffer + evict)
    finally:
        t.close()


def test_a_loaded_table_keeps_its_block_cache_share(tmp_path):
    """A table loaded from a saved directory opens an existing RocksDB store: its block cache is
    still its budget's share (not RocksDB's default 8 MiB from the store's OPTIONS file)."""
    t = make_table(spec(-1, "16MiB"))
    try:
        ids = np.arange(40_000)
        t.push(np.full((ids.size, 16), 1e-3, np.float32), ids)
        t.save(tmp_path / "saved")
        t.load(tmp_path / "saved")
        capacity = t.store.db.property_int_value("rocksdb.block-cache-capacity")
        assert capacity == t.split.engine.block_cache == 1 * MiB
        assert t.peek(ids[:5]).shape == (5, 16) and len(t) == 40_000
    finally:
        t.close()


def test_budget_split_scales_and_caps_the_memtables():
    engine = BudgetSplit.of(4 << 30, -1, 136).engine  # 4 GiB: cache 128 MiB, memtables capped
    assert engine.block_cache == 128 * MiB and engine.write_buffer == 64 * MiB
    assert BudgetSplit.of(64 * MiB, -1, 136).engine.nbytes == 2 * MiB + 2 * 2 * MiB


@pytest.mark.slow
def test_child_resident_memory_growth_stays_within_budget():
    # 2 million rows, dim 16, Adagrad under 16 MiB: the benchmark's child process measures its own
    # anonymous resident memory (RssAnon, after malloc_trim) before the table is made and after the
    # fill and the Zipf steps. Allowed: 1.25 x budget + 8 MiB fixed (the engine's table readers and
    # threads, numpy/allocator slack of the request arrays).
    cmd = [sys.executable, str(BENCH), "--one", "disk", "2000000", "--budget", "16MiB", "--steps", "10"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["evicted"] > 0 and 0 < r["hit_rate"] < 1  # the RAM tier was full and spilled
    assert r["rss_growth_mib"] <= 1.25 * 16 + 8, r
