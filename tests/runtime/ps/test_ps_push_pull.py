"""The fused push + pull (`PSClient.push_pull`): a shard applies step t's pushes, then answers the
rows of step t + 1. Checked against separate pushes then pulls on a second, identical server and
against numpy by hand (SGD from a constant start), in async and sync mode, over two shards."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime.ps import Servers
from transpiler.tables import tables_from_dicts

LR, DIM, VOCAB = 0.5, 4, 1000
SPECS = tables_from_dicts(
    [
        {
            "name": "w",
            "kind": "dense",
            "shape": [3, 2],
            "dtype": "float32",
            "initializer": {"type": "constant", "value": 1.0},
            "optimizer": {"type": "sgd", "lr": LR},
        },
        {
            "name": "b",
            "kind": "dense",
            "shape": [6000],
            "dtype": "float32",  # 24 KB: goes through shm
            "initializer": {"type": "constant", "value": -1.0},
            "optimizer": {"type": "sgd", "lr": LR},
        },
        {
            "name": "emb",
            "kind": "sparse",
            "shape": [VOCAB, DIM],
            "dtype": "float32",
            "initializer": {"type": "constant", "value": 1.0},
            "optimizer": {"type": "sgd", "lr": LR},
        },
        {
            "name": "wide",
            "kind": "sparse",
            "shape": [VOCAB, 1],
            "dtype": "float32",  # same ids as emb
            "initializer": {"type": "constant", "value": 0.0},
            "optimizer": {"type": "sgd", "lr": LR},
        },
    ]
)


def _grads(rng):
    ids = rng.integers(0, 60, size=40)  # repeats, spread over both shards
    return (
        ids,
        rng.normal(size=(40, DIM)).astype(np.float32),
        rng.normal(size=(3, 2)).astype(np.float32),
        rng.normal(size=6000).astype(np.float32),
    )


def test_async_push_pull_equals_push_then_pull_and_numpy():
    rng = np.random.default_rng(0)
    ref = {
        "w": np.ones((3, 2)),
        "b": -np.ones(6000),
        "emb": np.ones((VOCAB, DIM)),
        "wide": np.zeros((VOCAB, 1)),
    }
    # the fused calls go through shared memory (ipc in a run directory with its /dev/shm twin), the
    # separate ones as ZeroMQ frames over tcp
    with (
        Servers(SPECS, num_shards=2, transport="ipc") as fused_s,
        Servers(SPECS, num_shards=2) as split_s,
        fused_s.client() as fused,
        split_s.client() as split,
    ):
        for _ in range(4):
            ids, rows, gw, gb = _grads(rng)
            pulled = rng.integers(0, 80, size=30)
            gwide = rng.normal(size=(ids.size, 1)).astype(np.float32)
            pushes = [("emb", rows, ids), ("w", gw, None), ("b", gb, None), ("wide", gwide, ids.copy())]
            pulls = [("emb", pulled), ("w", None), ("b", None), ("wide", pulled)]
            got = fused.push_pull(pushes, pulls)
            split.push_many(pushes)
            want = split.pull_many(pulls)
            np.add.at(ref["emb"], ids, -LR * rows.astype(np.float64))
            ref["w"] -= LR * gw
            ref["b"] -= LR * gb
            np.add.at(ref["wide"], ids, -LR * gwide.astype(np.float64))
            refs = (ref["emb"][pulled], ref["w"], ref["b"], ref["wide"][pulled])
            for g, w, r in zip(got, want, refs, strict=True):
                np.testing.assert_array_equal(g, w)
                np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
        assert [s["emb"]["applied"] for s in fused.stats()] == [4, 4]  # each shard: one push per step
        assert split._segments is None and any(r is not None and r.head > 0 for r in fused._rings)


def test_sync_push_pull_waits_for_every_pusher_of_the_step_and_equals_separate_calls():
    """Two pushers per step. Pusher 0's fused call for step t returns only once pusher 1 has pushed
    step t too; both get the rows of step t + 1 = the start minus lr x (sum of both gradients)."""
    rng = np.random.default_rng(1)
    ref = {"w": np.ones((3, 2)), "emb": np.ones((VOCAB, DIM))}
    with (
        Servers(SPECS, num_shards=2, mode="sync", pushes_per_step=2, transport="ipc") as fused_s,
        Servers(SPECS, num_shards=2, mode="sync", pushes_per_step=2) as split_s,
    ):
        fused = [fused_s.client(pusher=p, timeout=20) for p in range(2)]
        split = [split_s.client(pusher=p, timeout=20) for p in range(2)]
        try:
            for step in range(3):
                grads = [_grads(rng) for _ in range(2)]
                pulled = rng.integers(0, 80, size=30)
                pulls = [("emb", pulled), ("w", None)]
                out: dict[int, list] = {}
                first = threading.Thread(
                    target=lambda: out.__setitem__(
                        0,
                        fused[0].push_pull(
                            [
                                ("emb", grads[0][1], grads[0][0]),
                                ("w", grads[0][2], None),
                                ("b", grads[0][3], None),
                            ],
                            pulls,
                            step=step,
                        ),
                    )
                )
                first.start()
                first.join(1.0)
                assert first.is_alive(), "step t + 1's rows came back before every pusher pushed step t"
                out[1] = fused[1].push_pull(
                    [("emb", grads[1][1], grads[1][0]), ("w", grads[1][2], None), ("b", grads[1][3], None)],
                    pulls,
                    step=step,
                )
                first.join(20)
                assert not first.is_alive()
                for p in range(2):
                    split[p].push_many(
                        [
                            ("emb", grads[p][1], grads[p][0]),
                            ("w", grads[p][2], None),
                            ("b", grads[p][3], None),
                        ],
                        step=step,
                    )
                want = split[0].pull_many(pulls, step=step + 1)
                for ids, rows, gw, _ in grads:
                    np.add.at(ref["emb"], ids, -LR * rows.astype(np.float64))
                    ref["w"] -= LR * gw
                for p in range(2):
                    for g, w, r in zip(out[p], want, (ref["emb"][pulled], ref["w"]), strict=True):
                        np.testing.assert_array_equal(g, w)
                        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
            assert [s["emb"]["version"] for s in fused[0].stats()] == [3, 3]
        finally:
            for c in (*fused, *split):
                c.close()


def test_a_refused_push_refuses_the_fused_call_and_the_server_goes_on():
    from runtime.ps import PSError

    with Servers(SPECS, num_shards=1) as s, s.client() as c:
        bad = np.full((3, 2), np.nan, np.float32)
        with pytest.raises(PSError, match="NaN or Inf"):
            c.push_pull([("w", bad, None)], [("w", None)])
        np.testing.assert_array_equal(c.pull("w"), np.ones((3, 2)))


def test_a_request_pointing_outside_its_shared_memory_segment_is_refused_and_the_server_goes_on():
    from raw_ps import Raw

    with Servers(SPECS, num_shards=1, transport="ipc") as s, s.client() as c:
        c.push("b", np.ones(6000, np.float32))  # 24 KB: through the ring
        ring = c._rings[0]
        raw = Raw(s, cid="raw")
        for desc in [
            {"seg": ring.name, "at": ring.cap - 8, "n": 4096, "arrays": []},
            {"seg": ring.name, "at": 0, "n": 64, "arrays": [["<f4", [1 << 20], 0, 4 << 20]]},
            {"seg": "../../../etc/passwd", "at": 0, "n": 0, "arrays": []},
        ]:
            reply = raw.ask(raw.sign({"op": "push", "table": "w", "shm": desc}))
            assert reply["ok"] is False and "malformed request" in reply["error"], reply
        raw.close()
        np.testing.assert_array_equal(c.pull("b"), np.full(6000, -1 - LR, np.float32))
        np.testing.assert_array_equal(c.pull("w"), np.ones((3, 2)))


def decode_reply(frames, key):
    from runtime.transport.wire import decode

    return decode(frames, key)[0]


def test_pulls_of_one_table_for_several_id_sets_are_answered_each():
    """One embedding looked up by several slots: `pull_many` / `push_pull` with the same table more
    than once (a shard refuses a request naming a table twice, so the client merges them) answer
    every pull with its own rows, in its own shape (by hand: rows start at the initializer's 1.0,
    then one SGD step of a known gradient)."""
    a, b = np.array([[3, 7], [7, 999]]), np.array([7, 5, 3])
    with Servers(SPECS, num_shards=2) as s, s.client() as c:
        got = c.pull_many([("emb", a), ("w", None), ("emb", b), ("w", None)])
        assert [g.shape for g in got] == [(2, 2, DIM), (3, 2), (3, DIM), (3, 2)]
        assert all(np.all(g == 1.0) for g in got)
        grad = np.arange(DIM, dtype=np.float32)
        got = c.push_pull([("emb", np.stack([grad, 2 * grad]), np.array([7, 3]))], [("emb", b), ("emb", a)])
    want = {7: 1 - LR * grad, 3: 1 - LR * 2 * grad, 5: np.ones(DIM), 999: np.ones(DIM)}
    np.testing.assert_allclose(got[0], np.stack([want[i] for i in b.ravel()]), rtol=1e-6)
    np.testing.assert_allclose(got[1], np.stack([want[i] for i in a.ravel()]).reshape(2, 2, DIM), rtol=1e-6)


def test_one_request_may_pull_and_push_a_table_more_than_once():
    """pull_many / push_many of the same table twice (a trainer with two lookups of one table):
    before the fix the shard refused the combined request ('names a table more than once')."""
    with Servers(SPECS, num_shards=2, transport="ipc") as s, s.client() as c:
        ids_a, ids_b = np.array([3, 5, 7]), np.array([5, 900])
        c.push_many(
            [
                ("emb", np.ones((3, DIM), np.float32), ids_a),
                ("emb", np.ones((2, DIM), np.float32), ids_b),
                ("w", np.ones((3, 2), np.float32), None),
                ("w", np.ones((3, 2), np.float32), None),
            ]
        )
        a, b, w1, w2 = c.pull_many([("emb", ids_a), ("emb", ids_b), ("w", None), ("w", None)])
        want = np.ones((VOCAB, DIM))
        np.add.at(want, np.concatenate([ids_a, ids_b]), -LR)
        np.testing.assert_allclose(a, want[ids_a])
        np.testing.assert_allclose(b, want[ids_b])
        np.testing.assert_allclose(w1, np.full((3, 2), 1 - 2 * LR))
        np.testing.assert_array_equal(w1, w2)
