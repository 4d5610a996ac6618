"""Tiered sparse tables (runtime/ps/tiered.py): rows in RocksDB under a RAM tier bounded by a memory
budget. Under random pull / push / add / assign sequences with a budget small enough that rows
spill to disk and come back, every pulled row equals, bit for bit, an independent dict-of-rows model
applying SGD / Adagrad by hand and the RAM `SparseTable`; checkpoints round-trip (table-level and
through shards, into another shard count); bad budgets, corrupt stores and closing behave."""

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ops_registry import init_rows
from runtime.ps import PSError, Shard, SparseTable, make_table, save_shards
from runtime.ps.tiered import TieredSparseTable, budget_for_rows, parse_bytes
from transpiler.tables import TableSpec

DIM = 4
INIT = {"type": "uniform", "low": -0.5, "high": 0.5, "seed": 7}


def spec(opt: dict, vocab: int = 600, rows: int | None = 64, **kw) -> TableSpec:
    s = TableSpec("emb", "sparse", [vocab, DIM], initializer=INIT, optimizer=opt, **kw)
    if rows is None:
        return s
    return replace(s, storage="disk", memory_budget=budget_for_rows(s, rows))  # (RAM tier: `rows` rows)


class DictModel:
    """id -> row and optimizer state, the formulas written out (ops_registry/optimizer.py)."""

    def __init__(self, opt: dict) -> None:
        self.opt, self.rows, self.moment = opt, {}, {}

    def row(self, i: int) -> np.ndarray:
        if i not in self.rows:
            self.rows[i] = init_rows(INIT, (600, DIM), "float32", np.array([i]))[0]
            self.moment[i] = np.zeros(DIM, np.float32)
        return self.rows[i]

    def pull(self, ids: np.ndarray) -> np.ndarray:
        return np.stack([self.row(int(i)) for i in ids])

    def push(self, grad: np.ndarray, ids: np.ndarray) -> None:  # ids distinct
        lr = self.opt["lr"]
        for i, g in zip(ids.tolist(), grad, strict=True):
            p = self.row(i)
            if self.opt["type"] == "sgd":
                self.rows[i] = p - (lr * g).astype(np.float32)
            else:
                m = self.moment[i] + g * g
                self.moment[i] = m
                self.rows[i] = p - (lr * g / (np.sqrt(m) + self.opt["epsilon"])).astype(np.float32)


@pytest.mark.parametrize(
    "opt",
    [{"type": "sgd", "lr": 0.1}, {"type": "adagrad", "lr": 0.05, "epsilon": 1e-6}],
    ids=["sgd", "adagrad"],
)
def test_random_sequences_match_hand_model_and_ram_table(opt):
    model, ram, tiered = DictModel(opt), SparseTable(spec(opt, rows=None)), make_table(spec(opt))
    assert isinstance(tiered, TieredSparseTable) and tiered.max_rows == 64
    rng = np.random.default_rng(1)
    for step in range(120):
        ids = np.unique(rng.zipf(1.3, 40) % 600).astype(np.int64)  # distinct, skewed
        want = model.pull(ids)
        np.testing.assert_array_equal(ram.pull(ids), want)
        np.testing.assert_array_equal(tiered.pull(ids), want, err_msg=f"step {step}")
        grad = rng.normal(size=(ids.size, DIM)).astype(np.float32)
        model.push(grad, ids)
        ram.push(grad, ids)
        tiered.push(grad, ids)
        assert tiered.resident() <= tiered.max_rows
        assert tiered.memory_bytes() - tiered.index.nbytes() <= tiered.budget
    every = np.array(sorted(model.rows))
    np.testing.assert_array_equal(tiered.peek(every), model.pull(every))
    assert len(tiered) == len(ram) == len(model.rows)
    st = tiered.stats
    assert st.evicted > 0 and st.disk_hits > 0 and st.hit_rate < 1, st
    assert (
        tiered.store.multi_gets <= 2 * 120 and tiered.store.write_batches <= 2 * 120
    )  # batched: one per request at most
    tiered.close()


@pytest.mark.parametrize("vocab", [600, -1], ids=["direct-index", "row-index"])
def test_adam_add_assign_peek_with_repeated_ids_match_ram_table(vocab):
    opt = {"type": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": 1}
    ram, tiered = SparseTable(spec(opt, vocab, rows=None)), make_table(spec(opt, vocab, rows=50))
    rng = np.random.default_rng(2)
    for step in range(150):
        ids = rng.integers(0, 400, 30)  # repeats within a request
        op = step % 5
        if op == 3:
            delta = rng.normal(size=(ids.size, DIM)).astype(np.float32)
            ram.add(delta, ids)
            tiered.add(delta, ids)
        elif op == 4:
            u = np.unique(ids)
            values = rng.normal(size=(u.size, DIM)).astype(np.float32)
            ram.assign(values, u)
            tiered.assign(values, u)
        else:
            np.testing.assert_array_equal(tiered.pull(ids), ram.pull(ids), err_msg=f"step {step}")
            grad = rng.normal(size=(ids.size, DIM)).astype(np.float32)
            ram.push(grad, ids)
            tiered.push(grad, ids)
        assert tiered.resident() <= tiered.max_rows
    probe = np.arange(0, 500)  # includes ids never touched: the initializer's rows, created by neither
    np.testing.assert_array_equal(tiered.peek(probe), ram.peek(probe))
    assert len(tiered) == len(ram)
    a, b = ram.state_dict(), tiered.state_dict()
    order = np.argsort(a["ids"])
    for k in a:
        want = a[k][order] if k in ("ids", "Param", "Moment1", "Moment2") else a[k]
        np.testing.assert_array_equal(b[k], want, err_msg=k)
    tiered.close()


def test_save_load_round_trip_and_training_continues(tmp_path):
    opt = {"type": "adagrad", "lr": 0.05, "epsilon": 1e-6}
    ram, tiered = SparseTable(spec(opt, rows=None)), make_table(spec(opt))
    rng = np.random.default_rng(3)

    def train(tables, steps):
        for _ in range(steps):
            ids = rng.integers(0, 600, 40)
            grad = rng.normal(size=(ids.size, DIM)).astype(np.float32)
            pulled = [t.pull(ids) for t in tables]
            for p in pulled[1:]:
                np.testing.assert_array_equal(p, pulled[0])
            for t in tables:
                t.push(grad, ids)

    train([ram, tiered], 40)
    tiered.save(tmp_path / "t")
    tiered.save(tmp_path / "t")  # replaces the previous save
    assert sorted(os.listdir(tmp_path)) == ["t"]  # no staging directory left behind
    assert sorted(os.listdir(tmp_path / "t")) == ["meta.json", "rows"]
    back = make_table(spec(opt))
    back.load(tmp_path / "t")
    assert len(back) == len(ram) and back.resident() == 0
    probe = np.arange(600)
    np.testing.assert_array_equal(back.peek(probe), ram.peek(probe))
    train([ram, tiered, back], 30)  # the loaded table trains on exactly as the others
    tiered.close()
    back.close()


def test_shard_checkpoint_loads_into_another_shard_count_and_into_ram_tables(tmp_path):
    opt = {"type": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": 1}
    disk = spec(opt, vocab=-1, rows=40)
    ref = SparseTable(spec(opt, vocab=-1, rows=None))
    shards = [Shard([disk], shard=k, num_shards=2) for k in range(2)]
    rng = np.random.default_rng(4)
    from runtime.ps.sharding import shard_of

    for _ in range(30):
        ids = np.unique(rng.integers(0, 300, 50))
        grad = rng.normal(size=(ids.size, DIM)).astype(np.float32)
        ref.push(grad, ids)
        for k, s in enumerate(shards):
            mine = shard_of(ids, 2) == k
            s.push("emb", grad[mine], ids[mine])
    save_shards(shards, tmp_path / "ckpt")
    save_shards(shards, tmp_path / "ckpt")  # over an existing checkpoint
    doc = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert {e["store"] for e in doc["files"]} == {"tiered"}
    probe = np.arange(300)
    ram = spec(opt, vocab=-1, rows=None)
    for target, n in ((disk, 3), (disk, 2), (ram, 3), (ram, 2)):
        loaded = [Shard([target], shard=k, num_shards=n) for k in range(n)]
        for s in loaded:
            s.load(tmp_path / "ckpt")
        got = np.zeros((probe.size, DIM), np.float32)
        for k, s in enumerate(loaded):
            mine = shard_of(probe, n) == k
            got[mine] = s.pull("emb", probe[mine], peek=True)
        np.testing.assert_array_equal(got, ref.peek(probe))
        assert sum(len(s.tables["emb"]) for s in loaded) == len(ref)
        for s in loaded:
            s.close()
    for s in shards:
        s.close()


def test_request_larger_than_budget_is_refused_naming_table_and_budget():
    t = make_table(spec({"type": "sgd", "lr": 0.1}, rows=10))
    t.pull(np.arange(10))  # exactly the budget: fine
    with pytest.raises(PSError, match=r"'emb'.*11 distinct rows.*memory_budget \d+ bytes"):
        t.pull(np.arange(11))
    with pytest.raises(PSError, match="holds no row"):
        make_table(replace(t.spec, memory_budget=8))
    with pytest.raises(PSError, match="needs a memory_budget"):
        make_table(replace(t.spec, memory_budget=None))
    with pytest.raises(PSError, match="'emb'.*memory_budget 'lots'"):
        make_table(replace(t.spec, memory_budget="lots"))
    dense = TableSpec("w", "dense", [3, 3], initializer=INIT, storage="disk", memory_budget=100)
    with pytest.raises(PSError, match="storage 'disk' is for sparse tables"):
        make_table(dense)
    with pytest.raises(ValueError, match="storage 'ssd' must be"):
        replace(t.spec, storage="ssd")
    t.close()


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("100000") == parse_bytes(100000) == 100000
    assert parse_bytes("2k") == 2000 and parse_bytes("2KiB") == 2048
    for bad in ("", "-1", "4XB", 0, True, 1.5):
        with pytest.raises(ValueError, match="memory_budget"):
            parse_bytes(bad)


def test_spec_round_trip_keeps_storage_fields():
    s = spec({"type": "sgd", "lr": 0.1})
    d = s.to_dict()
    assert d["storage"] == "disk" and TableSpec.from_dict(d) == s
    assert "storage" not in spec({"type": "sgd", "lr": 0.1}, rows=None).to_dict()  # plan files unchanged


def test_corrupt_store_is_refused_naming_its_path(tmp_path):
    t = make_table(spec({"type": "sgd", "lr": 0.1}, rows=10))
    for lo in range(0, 100, 10):
        t.push(np.ones((10, DIM), np.float32), np.arange(lo, lo + 10))
    t.save(tmp_path / "t")
    (tmp_path / "t" / "meta.json").write_text("{not json")
    with pytest.raises(PSError, match=r"t'?: meta.json is missing or corrupt"):
        t.load(tmp_path / "t")
    t.save(tmp_path / "t")
    (tmp_path / "t" / "rows" / "CURRENT").write_text("garbage\n")
    with pytest.raises(PSError, match=f"{tmp_path}.*rows/CURRENT has .* truncated or corrupt"):
        make_table(t.spec).load(tmp_path / "t")  # (meta.json's sizes and hashes catch it first)
    # a value of the wrong size inside the live engine (another layout, or a torn write)
    t.store.db.put((5).to_bytes(8, "big"), b"short")
    t.cold += 1
    with pytest.raises(PSError, match=f"{t.path}.*wrong size"):
        t.pull(np.array([5]))
    t.close()


def test_close_removes_engine_files_but_not_saves(tmp_path):
    t = make_table(spec({"type": "sgd", "lr": 0.1}, rows=10))
    t.push(np.ones((10, DIM), np.float32), np.arange(10))
    t.pull(np.arange(10, 20))  # evicts the first ten to disk
    path = Path(t.path)
    assert path.is_dir() and t.disk_bytes() > 0
    t.save(tmp_path / "t")
    t.close()
    t.close()  # idempotent
    assert not path.exists()
    back = TieredSparseTable(t.spec, store_dir=str(tmp_path))
    assert Path(back.path).parent == tmp_path
    back.load(tmp_path / "t")
    want = init_rows(INIT, (600, DIM), "float32", np.arange(10)) + np.float32(-0.1)
    np.testing.assert_array_equal(back.peek(np.arange(10)), want)
    assert len(back) == 20
    back.close()


def test_server_processes_serve_save_and_load_a_disk_table(tmp_path):
    from runtime.ps import Servers

    opt = {"type": "adagrad", "lr": 0.05, "epsilon": 1e-6}
    disk, ref = spec(opt, rows=30), SparseTable(spec(opt, rows=None))
    rng = np.random.default_rng(5)
    with (
        Servers([disk], num_shards=2, checkpoint_root=tmp_path) as two,
        Servers([disk], num_shards=3, checkpoint_root=tmp_path) as three,
    ):
        c2, c3 = two.client(), three.client()
        for _ in range(25):
            ids = np.unique(rng.integers(0, 600, 40))
            np.testing.assert_array_equal(c2.pull("emb", ids), ref.pull(ids))
            grad = rng.normal(size=(ids.size, DIM)).astype(np.float32)
            c2.push("emb", grad, ids)
            ref.push(grad, ids)
        c2.save(tmp_path / "ckpt")
        c3.load(tmp_path / "ckpt")
        for lo in range(0, 600, 40):  # (a request of more distinct rows than a budget holds is refused)
            probe = np.arange(lo, lo + 40)
            np.testing.assert_array_equal(c3.pull("emb", probe), ref.pull(probe))
        with pytest.raises(PSError, match="distinct rows, more than memory_budget"):
            c3.pull("emb", np.arange(600))
        c2.close()
        c3.close()


@pytest.mark.parametrize("unbounded", [False, True])
def test_load_state_counts_rows_overlapping_the_disk_exactly(unbounded):
    """load_state skips its existence multi-get when no stored id lies in the new ids' range (one
    seek): batches below, above, straddling and inside the rows on disk (and, unbounded, ids at and
    above 2^63, whose engine keys sort after 2^63 - 1) give len() = the count of a Python set."""
    vocab = -1 if unbounded else 600
    t = TieredSparseTable(spec({"type": "sgd", "lr": 0.1}, vocab=vocab, rows=8))
    base = (1 << 63) - 20 if unbounded else 0
    held: set[int] = set()
    for lo, hi in [(100, 140), (0, 10), (200, 230), (90, 110), (120, 125), (139, 160), (10, 90)]:
        ids = (np.arange(lo, hi, dtype=np.uint64) + np.uint64(base)).view(np.int64)
        param = np.full((ids.size, DIM), lo, np.float32)
        t.load_state({"ids": ids, "Param": param})
        held |= set(ids.tolist())
        assert len(t) == len(held)
    got = t.state_dict()
    assert sorted(got["ids"].tolist()) == sorted(held)
    t.close()


@pytest.mark.parametrize("vocab", [600, -1], ids=["direct-index", "row-index"])
@pytest.mark.parametrize("asked", ["keyword", "spec"])
def test_eviction_is_in_place_and_the_lru_order_survives_it(vocab, asked):
    """Evictions reuse the RAM arrays (no compaction copy, capacity max_rows), and what stays
    resident is what an LRU of max_rows rows written out by hand keeps: the 90% most recent (the
    policy asked for by keyword, or by the spec's `tier_policy` through `make_table`)."""
    opt = {"type": "sgd", "lr": 0.1}
    ram = SparseTable(spec(opt, vocab, rows=None))
    if asked == "keyword":
        t = TieredSparseTable(spec(opt, vocab, rows=50), policy="lru")
    else:
        t = make_table(TableSpec.from_dict(replace(spec(opt, vocab, rows=50), tier_policy="lru").to_dict()))
    assert t.policy == "lru"
    rows0, last = t.rows, {}
    rng = np.random.default_rng(3)
    for step in range(60):
        ids = np.unique(rng.integers(0, 300, 12))
        np.testing.assert_array_equal(t.pull(ids), ram.pull(ids), err_msg=f"step {step}")
        grad = rng.normal(size=(ids.size, DIM)).astype(np.float32)
        ram.push(grad, ids)
        t.push(grad, ids)
        last.update(dict.fromkeys(ids.tolist(), step))
        resident = set(t.index.ids_by_slot().tolist())
        assert t.rows is rows0 and t.rows.shape[0] == t.max_rows == 50
        newest = sorted(last, key=last.get)[-len(resident) :]  # (ties: one request's rows)
        assert {i for i in newest if last[i] > last[newest[0]]} <= resident <= set(last)
    assert t.stats.evicted > 100
    np.testing.assert_array_equal(t.peek(np.arange(300)), ram.peek(np.arange(300)))
    t.close()


@pytest.mark.parametrize("vocab", [1000, -1], ids=["direct-index", "row-index"])
def test_index_relocate_matches_a_dict(vocab):
    from runtime.ps.index import make_index

    index, model, rng = make_index(vocab), {}, np.random.default_rng(4)
    for _ in range(40):
        new = rng.choice(1000, 30, replace=False)
        slots, _, _ = index.find_or_add(new)
        for i, s in zip(new.tolist(), slots.tolist(), strict=True):
            assert model.setdefault(i, s) == s
        ids = np.array(list(model))
        gone = rng.choice(ids, min(10, ids.size), replace=False)
        n, k = len(model), gone.size
        by_slot = {s: i for i, s in model.items()}
        holes = sorted(model[i] for i in gone.tolist() if model[i] < n - k)
        movers = [by_slot[s] for s in range(n - k, n) if by_slot[s] not in set(gone.tolist())]
        index.relocate(gone, np.array(movers, np.int64), np.array(holes, np.int64))
        for i in gone.tolist():
            del model[i]
        model.update(zip(movers, holes, strict=True))
        probe = np.arange(1000)
        assert index.find(probe).tolist() == [model.get(i, -1) for i in range(1000)]
        assert (
            sorted(model.values())
            == list(range(len(model)))
            == sorted(index.find(ids[np.isin(ids, list(model))]).tolist())
        )
        assert len(index) == len(model)


def _resident_after(t: TieredSparseTable, requests: list[list[int]]) -> set[int]:
    for ids in requests:
        t.pull(np.array(ids))
    return set(t.index.ids_by_slot().tolist())


def test_lfu_keeps_the_rows_of_most_hits_and_breaks_ties_by_recency():
    """A RAM tier of 10 rows: ids 0-4 pulled 3 times each, then 5, 6, 7, 8, 9 once each (one request
    each), then a request of 2 new ids: 12 rows > 10, so 12 - 9 = 3 rows go, the fewest hits and,
    among those, the least recent: 5, 6, 7 (LRU would drop three of 0-4, the least recent). Every
    row then reads as in the RAM table, the evicted ones from disk."""
    opt = {"type": "sgd", "lr": 0.1}
    ram, t = SparseTable(spec(opt, rows=None)), TieredSparseTable(spec(opt, rows=10), age_every=1000)
    assert t.max_rows == 10 and t.policy == "lfu"
    requests = [[0, 1, 2, 3, 4]] * 3 + [[5], [6], [7], [8], [9], [10, 11]]
    assert _resident_after(t, requests) == {0, 1, 2, 3, 4, 8, 9, 10, 11}
    for ids in (np.arange(6), np.arange(6, 12)):  # (a request holds at most 10 rows)
        grad = np.linspace(-1, 1, ids.size * DIM, dtype=np.float32).reshape(ids.size, DIM) * (ids[0] + 1)
        ram.push(grad, ids)
        t.push(grad, ids)
    np.testing.assert_array_equal(t.peek(np.arange(20)), ram.peek(np.arange(20)))
    t.close()


def test_lfu_aging_halves_hit_counts_every_age_every_requests():
    """age_every=4: id 0 pulled at requests 1-3 (3 hits), id 1 at request 4, after which every count
    is halved (id 0: 1, id 1: 0); id 2 at request 5, ids 3-9 at 6 (1 hit each), then 2 new ids: the
    3 victims are id 1 (0 hits), then of the 1-hit rows the least recent, id 0 (request 3) and id 2
    (5). Without the halving id 0 (3 hits) would stay and one of 3-9 would go."""
    t = TieredSparseTable(spec({"type": "sgd", "lr": 0.1}, rows=10), age_every=4)
    requests = [[0]] * 3 + [[1], [2], [3, 4, 5, 6, 7, 8, 9], [10, 11]]
    assert _resident_after(t, requests) == set(range(3, 12))
    t.close()
    t = TieredSparseTable(spec({"type": "sgd", "lr": 0.1}, rows=10), age_every=1000)
    resident = _resident_after(t, requests)
    assert {0, 10, 11} <= resident and not resident & {1, 2} and len(resident) == 9
    t.close()


def test_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(PSError, match="'lfu', 'lru'"):
        TieredSparseTable(spec({"type": "sgd", "lr": 0.1}, rows=10), policy="fifo")
    with pytest.raises(PSError, match="'lfu', 'lru'"):
        make_table(replace(spec({"type": "sgd", "lr": 0.1}, rows=10), tier_policy="fifo"))
    with pytest.raises(PSError, match="age_every 0"):
        make_table(replace(spec({"type": "sgd", "lr": 0.1}, rows=10), tier_age_every=0))
