"""In-process tables: the id index, per-id row initialisation, compact storage, sharding rules."""

from dataclasses import replace

import numpy as np
import pytest

from ops_registry import init_rows
from runtime.ps import PSError, Shard, make_table, place_dense, shard_of
from runtime.ps.index import DirectIndex, RowIndex, make_index
from transpiler.tables import TableSpec

INIT = {"type": "uniform", "low": -0.1, "high": 0.1, "seed": 7}


def _sparse(vocab=-1, dim=3, opt=None):
    return TableSpec(
        name="emb",
        kind="sparse",
        shape=[vocab, dim],
        dtype="float32",
        initializer=INIT,
        optimizer=opt or {"type": "sgd", "lr": 0.5},
    )


@pytest.mark.parametrize(
    "make, low, high", [(RowIndex, -(2**40), 2**40), (lambda: DirectIndex(2**18), 0, 2**18)]
)
def test_indexes_agree_with_a_dict(make, low, high):
    rng = np.random.default_rng(0)
    index, ref = make(), {}
    for n in [10, 3000, 5000, 1, 20000, 700] * 3:  # RowIndex: crosses its delta -> main merge
        ids = rng.integers(low, high, size=n)
        slots, new_ids, new_slots = index.find_or_add(ids)
        want_new = sorted({int(i) for i in ids} - set(ref))
        assert new_ids.tolist() == want_new
        ref.update((i, s) for i, s in zip(want_new, new_slots.tolist(), strict=True))
        assert slots.tolist() == [ref[int(i)] for i in ids]
    probe = rng.integers(low, high, size=2000)
    assert index.find(probe).tolist() == [ref.get(int(i), -1) for i in probe]
    assert sorted(ref.values()) == list(range(len(ref))) == list(range(len(index)))
    assert index.ids_by_slot().tolist() == [i for i, _ in sorted(ref.items(), key=lambda kv: kv[1])]


def test_a_known_moderate_vocab_gets_the_direct_index():
    assert isinstance(make_index(100_000), DirectIndex)
    assert isinstance(make_index(-1), RowIndex) and isinstance(make_index(2**40), RowIndex)


def test_rows_are_seeded_per_id_whatever_the_order_or_shard_count():
    vocab = 500
    whole = init_rows(INIT, (vocab, 3), "float32")  # what one process makes for the whole table
    ids = np.random.default_rng(1).permutation(vocab)
    table = make_table(_sparse(vocab))
    for chunk in np.array_split(ids, 7):
        np.testing.assert_array_equal(table.pull(chunk), whole[chunk])
    shards = [Shard([_sparse(vocab)], shard=k, num_shards=3) for k in range(3)]
    owner = shard_of(ids, 3)
    for k, s in enumerate(shards):
        np.testing.assert_array_equal(s.pull("emb", ids[owner == k][::-1]), whole[ids[owner == k][::-1]])


def test_sparse_sgd_on_growing_storage_matches_a_dense_table():
    vocab, rng = 20000, np.random.default_rng(2)
    table, dense = make_table(_sparse(vocab)), init_rows(INIT, (vocab, 3), "float32").astype(np.float64)
    for step in range(30):  # new ids keep arriving, so storage grows many times
        ids = rng.integers(0, min(vocab, 200 * (step + 1) ** 2), size=1500)
        g = rng.normal(size=(1500, 3)).astype(np.float32)
        table.push(g, ids)
        np.add.at(dense, ids, -0.5 * g.astype(np.float64))
    seen = np.unique(table.state_dict()["ids"])
    np.testing.assert_allclose(table.pull(seen), dense[seen], rtol=1e-5, atol=1e-6)
    assert len(table) == seen.size < vocab


@pytest.mark.parametrize("opt", [{"type": "sgd", "lr": 0.5}, {"type": "adagrad", "lr": 0.5, "epsilon": 1e-6}])
def test_pushes_of_sorted_distinct_ids_and_of_sorted_repeats_match_numpy(opt):
    """Sorted distinct ids (what PSClient sends) take the plain indexed-add path; sorted ids with a
    repeat must still accumulate both rows. Reference: numpy by hand, in float64."""
    vocab, rng = 1000, np.random.default_rng(3)
    table = make_table(_sparse(vocab, opt=opt))
    dense = init_rows(INIT, (vocab, 3), "float32").astype(np.float64)
    moment = np.zeros_like(dense)
    pushes = [
        np.unique(rng.integers(0, vocab, 300)),
        np.array([5, 7, 7, 9]),
        np.unique(rng.integers(0, 50, 40)),
    ]
    for ids in pushes:
        g = rng.normal(size=(ids.size, 3)).astype(np.float32)
        table.push(g, ids)
        summed = np.zeros_like(dense)
        np.add.at(summed, ids, g.astype(np.float64))
        rows = np.unique(ids)
        if opt["type"] == "sgd":
            dense[rows] -= 0.5 * summed[rows]
        else:
            moment[rows] += summed[rows] ** 2
            dense[rows] -= 0.5 * summed[rows] / (np.sqrt(moment[rows]) + 1e-6)
    seen = np.unique(table.state_dict()["ids"])
    np.testing.assert_allclose(table.pull(seen), dense[seen], rtol=1e-5, atol=1e-6)


def test_ids_hash_evenly_over_shards_and_dense_tables_balance_by_size():
    counts = np.bincount(shard_of(np.arange(0, 80000, 8), 4), minlength=4)  # strided ids
    assert counts.min() > 0.22 * 10000
    specs = [
        TableSpec(name=n, kind="dense", shape=[s])
        for n, s in [("a", 100), ("b", 60), ("c", 50), ("d", 10), ("e", 5)]
    ]
    assert place_dense(specs, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}


@pytest.mark.parametrize(
    "spec, message",
    [
        (replace(_sparse(), kind="ragged"), "kind 'ragged' is not 'dense' or 'sparse'"),
        (replace(_sparse(), shape=[10]), r"shape \[10\] must be \[vocab or -1, dim\]"),
        (replace(_sparse(), dtype="int32"), "dtype int32 is not a float type"),
        (replace(_sparse(), initializer={"type": "xavier"}), "xavier initializer needs a known vocab"),
        (_sparse(opt={"type": "rmsprop", "lr": 0.1}), "needs 'type' in"),
        (_sparse(opt={"type": "adam", "lr": 0.1, "beta3": 0.5}), "bad adam hyper-parameters"),
    ],
)
def test_malformed_specs_name_the_table_and_field(spec, message):
    with pytest.raises(PSError, match=message):
        make_table(spec)


def test_plan_form_specs_state_init_placement_imported_values_and_frozen_tables():
    """Specs as the transpiler writes them: optimizer state inits, a fixed shard, no initializer
    (imported weights, assigned before use), no optimizer (frozen)."""
    adagrad = {
        "type": "adagrad",
        "lr": 0.1,
        "epsilon": 1e-6,
        "state": {"Moment": {"out": "MomentOut", "shape": [4, 2], "init": 0.5}},
    }
    specs = [
        TableSpec(
            name="w",
            kind="dense",
            shape=[4, 2],
            dtype="float32",
            initializer=None,
            optimizer=adagrad,
            sharding={"by": "table", "shard": 1, "num_shards": 2},
        ),
        TableSpec(
            name="big",
            kind="dense",
            shape=[100],
            dtype="float32",
            initializer={"type": "constant", "value": 1.0},
            optimizer=None,
        ),
        replace(_sparse(50), initializer=None),
    ]
    assert place_dense(specs, 2) == {"w": 1, "big": 0}
    shard = Shard(specs, shard=1, num_shards=2)
    assert sorted(shard.tables) == ["emb", "w"]
    with pytest.raises(PSError, match="'w' has no initializer and no value yet"):
        shard.pull("w")
    with pytest.raises(PSError, match=r"'emb' has no initializer and rows \[7\] were never assigned"):
        shard.pull("emb", np.array([7]))
    w0 = np.arange(8, dtype=np.float32).reshape(4, 2)
    shard.assign("w", w0)
    shard.assign("emb", np.ones((2, 3), np.float32), np.array([7, 9]))
    np.testing.assert_array_equal(shard.pull("emb", np.array([9, 7])), np.ones((2, 3)))
    g = np.full((4, 2), 0.5, np.float32)
    shard.push("w", g)
    np.testing.assert_allclose(shard.pull("w"), w0 - 0.1 * g / (np.sqrt(0.5 + g * g) + 1e-6), rtol=1e-6)
    frozen = Shard(specs, shard=0, num_shards=2)
    with pytest.raises(PSError, match="'big' has no optimizer \\(frozen\\)"):
        frozen.push("big", np.ones(100, np.float32))


def test_ids_go_with_sparse_tables_only():
    """One rule, on the shard (and the client checks with the same function before sending)."""
    shard = Shard(
        [
            _sparse(10),
            TableSpec(
                name="w",
                kind="dense",
                shape=[2],
                dtype="float32",
                initializer={"type": "constant", "value": 0.0},
                optimizer=None,
            ),
        ],
        shard=0,
        num_shards=1,
    )
    with pytest.raises(PSError, match="pull of sparse table 'emb' needs ids"):
        shard.pull("emb")
    with pytest.raises(PSError, match="pull of dense table 'w' takes no ids"):
        shard.pull("w", np.array([1]))
