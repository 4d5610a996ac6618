"""Streaming sparse tables (runtime/ps/entry.py): admission by count or probability, eviction of
rows not touched for T pushes, and the table's memory in the server's stats. References are hand
computations: a constant initializer and SGD make every row's value a sum one can write down."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.ps import PSError, Servers, make_table
from transpiler.tables import TableSpec

LR, DIM = 0.5, 2


def spec(entry=None, evict_after=None, vocab=-1, init=0.25):
    s = TableSpec(
        name="emb",
        kind="sparse",
        shape=[vocab, DIM],
        dtype="float32",
        initializer={"type": "constant", "value": init},
        optimizer={"type": "sgd", "lr": LR},
        entry=entry,
        evict_after=evict_after,
    )
    return s


def grad(ids, value=1.0):
    return np.full((len(ids), DIM), value, np.float32)


@pytest.mark.parametrize("vocab", [-1, 1000])
def test_count_admission_creates_a_row_at_the_kth_sighting(vocab):
    t = make_table(spec({"type": "count", "threshold": 3}, vocab=vocab))
    for _ in range(2):  # sightings 1 and 2 (id 7 twice in one push counts once): no row, zeros, no update
        t.push(grad([7, 7, 9]), np.array([7, 7, 9]))
        assert len(t) == 0
        np.testing.assert_array_equal(t.pull(np.array([7, 9])), np.zeros((2, DIM)))
    t.push(grad([7, 7]), np.array([7, 7]))  # 3rd sighting of 7: admitted, this push's gradient applies
    assert len(t) == 1
    np.testing.assert_allclose(t.pull(np.array([7, 9])), [[0.25 - LR * 2] * DIM, [0, 0]])
    t.push(grad([9]), np.array([9]))
    np.testing.assert_allclose(t.pull(np.array([9])), [[0.25 - LR] * DIM])


def test_probability_admission_is_a_fair_draw_independent_of_order():
    entry = {"type": "probability", "p": 0.3, "seed": 4}
    ids = np.arange(20_000)
    a, b = make_table(spec(entry)), make_table(spec(entry))
    a.push(grad(ids), ids)
    for part in np.array_split(np.random.default_rng(0).permutation(ids), 7):  # other order, other pushes
        b.push(grad(part), part)
    rows_a = {int(i) for i, v in zip(ids, a.pull(ids)[:, 0], strict=True) if v != 0}
    rows_b = {int(i) for i, v in zip(ids, b.pull(ids)[:, 0], strict=True) if v != 0}
    assert rows_a == rows_b and len(a) == len(rows_a)
    assert abs(len(rows_a) - 6000) < 4 * np.sqrt(20_000 * 0.3 * 0.7)  # binomial(20000, 0.3), 4 sigma
    again = [i for i in range(2000) if i not in rows_a]  # seen again: a new draw each sighting
    a.push(grad(again), np.array(again))
    assert 0.2 * len(again) < len(a) - len(rows_a) < 0.4 * len(again)


def test_rows_untouched_for_t_pushes_are_evicted_and_start_afresh():
    t = make_table(spec(evict_after=4, vocab=100))
    t.push(grad([1, 2]), np.array([1, 2]))  # push 1: rows 1 and 2 at 0.25 - LR
    for _ in range(7):  # pushes 2..8 touch only id 1
        t.push(grad([1]), np.array([1]))
    assert len(t) == 1  # 2 went untouched for more than 4 pushes
    np.testing.assert_allclose(t.pull(np.array([1])), [[0.25 - 8 * LR] * DIM])
    np.testing.assert_allclose(t.pull(np.array([2])), [[0.25] * DIM])  # back from the initializer
    kept = make_table(spec(evict_after=4, vocab=100))
    kept.push(grad([1, 2]), np.array([1, 2]))
    for _ in range(7):
        kept.push(grad([1]), np.array([1]))
        kept.pull(np.array([2]))  # a pull is a touch: 2 stays, with its value
    np.testing.assert_allclose(kept.pull(np.array([2])), [[0.25 - LR] * DIM])


def test_a_stream_of_new_ids_stays_bounded_with_eviction():
    t, plain = make_table(spec({"type": "count", "threshold": 2}, evict_after=8)), make_table(spec())
    for step in range(200):  # 500 new ids per push, each seen in two consecutive pushes
        ids = np.arange(step * 500 - 500, step * 500 + 500) % 10**9
        for table in (t, plain):
            table.push(grad(ids), ids)
    assert len(plain) == 100_500 and len(t) <= 8 * 500 + 1000
    assert t.memory_bytes() < plain.memory_bytes() / 5


def test_bad_streaming_specs_are_refused():
    for entry, after, msg in (
        ({"type": "count", "threshold": 0}, None, "threshold"),
        ({"type": "probability", "p": 2}, None, "probability"),
        ({"type": "lru"}, None, "count"),
        (None, 0, "evict_after"),
    ):
        with pytest.raises(PSError, match=msg):
            make_table(spec(entry, after))
    with pytest.raises(PSError, match="sparse tables only"):
        make_table(
            TableSpec(
                name="w",
                kind="dense",
                shape=[2],
                initializer={"type": "constant", "value": 0},
                optimizer={"type": "sgd", "lr": 0.1},
                evict_after=3,
            )
        )


def test_server_stats_report_rows_and_bytes():
    with (
        Servers([spec({"type": "count", "threshold": 1}, evict_after=2, vocab=-1)], 2) as srv,
        srv.client() as client,
    ):
        ids = np.arange(100)
        client.push("emb", grad(ids), ids)
        stats = client.stats()
        assert sum(s["emb"]["rows"] for s in stats) == 100
        assert all(s["emb"]["bytes"] >= s["emb"]["rows"] * DIM * 4 for s in stats)


def test_training_with_admission_keeps_rows_only_for_ids_seen_in_two_steps(tmp_path):
    """Sync training: the server applies one merged push per step, so an id's sightings are the
    steps whose global batch holds it; with threshold 2 the tables end with exactly the ids seen
    in at least 2 steps (counted here from the batches), and the metrics' end record says so."""
    from procs import alive

    from runtime import train
    from runtime.data import SyntheticCTR
    from runtime.engines import LocalEngine
    from runtime.telemetry.outputs import read_metrics
    from transpiler import TranspileConfig, transpile
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    steps, batch = 12, 64
    model = wide_deep(vocab=50_000, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1))
    plan = transpile(
        model.main, TranspileConfig(num_servers=2, sparse_entry={"type": "count", "threshold": 2})
    )
    data = SyntheticCTR(vocab=50_000, seed=5)
    eng = LocalEngine()
    hist = train(
        plan,
        data,
        steps=steps,
        batch_size=batch,
        trainers={"cpu": 2, "gpu": 1},
        engine=eng,
        allow_emulation=True,
        metrics=str(tmp_path / "m.jsonl"),
        progress=False,
    )
    seen = np.zeros(50_000, int)
    for t in range(steps):
        seen[np.unique(data.batch(t, batch)["sparse"])] += 1
    sparse = [t.name for t in plan.tables if t.kind == "sparse"]
    assert len(sparse) == 2
    for name in sparse:
        assert hist.tables[name]["rows"] == int((seen >= 2).sum()) < int((seen >= 1).sum())
        assert hist.tables[name]["bytes"] > 0
    end = [r for r in read_metrics(str(tmp_path / "m.jsonl")) if r.get("kind") == "end"][0]
    assert end["tables"] == hist.tables
    assert not alive(eng.pids().values())
