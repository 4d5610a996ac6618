"""A parameter server against an insider — a process that holds a run's data key but is not the
client it claims to be — and against growth without bound: each refused with a clear error, the
legitimate clients unaffected."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.ps import Limits, PSError, Servers, Shard
from transpiler.tables import TableSpec

DIM = 4
ONE = {"type": "constant", "value": 1.0}
SGD = {"type": "sgd", "lr": 0.5}
EMB = TableSpec(name="emb", kind="sparse", shape=[-1, DIM], dtype="float32", initializer=ONE, optimizer=SGD)


# -- an unbounded table: a per-shard memory cap ---------------------------------------------------
def test_fresh_ids_past_the_shards_memory_cap_are_refused_naming_shard_and_table():
    # Before the fix every pull of fresh ids added rows (about 200 MB per 1M ids) without a total cap.
    per_row = DIM * 4 + 16  # a row of float32 (SGD keeps no state) and its share of the index
    shard = Shard([EMB], shard=1, num_shards=2, limits=Limits(max_memory_bytes=200_000))
    got = 0
    with pytest.raises(PSError) as e:
        for k in range(100):  # 1 000 fresh ids a request
            shard.pull("emb", np.arange(1000) * 2 + 1 + 2000 * k)
            got = len(shard.tables["emb"])
    assert "pull of table 'emb' on shard 1 refused" in str(e.value)
    assert "past max_memory_bytes=200000" in str(e.value) and "storage='disk'" in str(e.value)
    assert 0 < got * per_row <= 200_000  # rows up to the cap were served, the first one past it refused
    assert len(shard.tables["emb"]) == got  # a refusal creates no row
    np.testing.assert_array_equal(shard.pull("emb", np.array([1])), np.ones((1, DIM), np.float32))


def test_the_memory_cap_defaults_to_what_the_machine_has_and_refuses_a_table_too_large_to_start():
    big = TableSpec(name="w", kind="dense", shape=[1 << 20, 1 << 20], dtype="float32", initializer=ONE)
    with pytest.raises(PSError, match=r"shard 0 cannot start: its tables need 4398\.05 GB \(table 'w'"):
        Shard([big, EMB])
    with pytest.raises(PSError, match="max_memory_bytes"):
        Shard(
            [TableSpec(name="w", kind="dense", shape=[64, 64], dtype="float32")],
            limits=Limits(max_memory_bytes=1000),
        )


def test_a_shard_process_that_cannot_start_says_why():
    big = TableSpec(name="w", kind="dense", shape=[1 << 20, 1 << 20], dtype="float32", initializer=ONE)
    with pytest.raises(PSError, match="shard 0 failed to start: PSError: shard 0 cannot start"):
        Servers([big])
