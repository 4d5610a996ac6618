"""A parameter server reads requests in place and copies a dense pull once (issue 18): requests'
arrays in the client's shared-memory ring are used as read-only views and handed back once served,
a dense pull is copied straight from the table into the reply, and neither may let a later write
change what was read. Values are checked against numpy by hand (SGD from constant starts)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.ps import Servers, Shard
from runtime.ps.server import _Loop
from runtime.transport.shm import ShmRing, ShmSegments, shm_dir_for
from runtime.transport.wire import decode, encode, wire_array
from transpiler.tables import tables_from_dicts

LR = 0.5
SPECS = tables_from_dicts(
    [
        {
            "name": "b",
            "kind": "dense",
            "shape": [6000],
            "dtype": "float32",  # 24 KB: through shared memory
            "initializer": {"type": "constant", "value": 1.0},
            "optimizer": {"type": "sgd", "lr": LR},
        },
        {
            "name": "emb",
            "kind": "sparse",
            "shape": [1000, 8],
            "dtype": "float32",
            "initializer": {"type": "constant", "value": 0.0},
            "optimizer": {"type": "sgd", "lr": LR},
        },
    ]
)


@pytest.fixture
def shm_dir(run_dir):
    return shm_dir_for(run_dir)


def test_views_are_read_only_and_the_sender_gets_the_bytes_back_only_on_release(shm_dir):
    ring, segments = ShmRing(shm_dir, "x", 1 << 20), ShmSegments(shm_dir)
    sent = [wire_array(0, np.arange(5000, dtype=np.float32)), wire_array(1, np.arange(7, dtype=np.int64))]
    desc = ring.put(sent)
    views, release = segments.views(desc)
    for v, a in zip(views, sent, strict=True):
        np.testing.assert_array_equal(v, a)
        assert not v.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            v[0] = 1
    assert int(ring.consumed[0]) == 0  # unreleased: the sender may not overwrite them yet
    release()
    assert int(ring.consumed[0]) == ring.head
    copies = segments.arrays(ring.put(sent))  # copies: handed back at once
    assert int(ring.consumed[0]) == ring.head and copies[0].flags.writeable
    ring.close()


def test_views_released_out_of_order_give_the_sender_back_only_the_released_prefix(shm_dir):
    """A trainer releases a step's messages once the step is pushed, in any order: the sender may
    reuse bytes only up to the first message still read."""
    ring, segments = ShmRing(shm_dir, "x", 1 << 20), ShmSegments(shm_dir)
    msgs = [[wire_array(0, np.full(5000, k, np.float32))] for k in range(3)]
    leases, ends = [], []
    for m in msgs:
        leases.append(segments.views(ring.put(m)))
        ends.append(ring.head)
    leases[1][1]()  # the second first: the first still holds the bytes before it
    assert int(ring.consumed[0]) == 0
    np.testing.assert_array_equal(leases[0][0][0], msgs[0][0])
    leases[0][1]()  # now the first two
    assert int(ring.consumed[0]) == ends[1]
    leases[2][1]()
    assert int(ring.consumed[0]) == ends[2] == ring.head
    ring.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_every_request_read_from_shared_memory_is_handed_back_and_applied_exactly(mode):
    """Many more bytes than the ring holds: each push must be handed back (else the client would
    fall back to ZeroMQ frames once the 8 MiB ring is full), and the values must be exact."""
    rng = np.random.default_rng(0)
    want_b, want_emb = np.ones(6000), np.zeros((1000, 8))
    with Servers(SPECS, transport="ipc", mode=mode) as s, s.client() as c:
        for step in range(420):  # 420 x 24 KB > 8 MiB
            gb = rng.normal(size=6000).astype(np.float32)
            ids = np.unique(rng.integers(0, 1000, size=600))
            gemb = rng.normal(size=(ids.size, 8)).astype(np.float32)
            head = c._rings[0].head if c._rings[0] is not None else 0
            c.push_many([("b", gb, None), ("emb", gemb, ids)], step=step if mode == "sync" else None)
            ring = c._rings[0]
            assert ring.head > head, f"push {step} did not go through shared memory"
            assert int(ring.consumed[0]) == ring.head, f"push {step} was not handed back"
            want_b -= LR * gb.astype(np.float64)
            want_emb[ids] -= LR * gemb.astype(np.float64)
        got_b, got_emb = c.pull_many(
            [("b", None), ("emb", np.arange(1000))], step=420 if mode == "sync" else None
        )
    np.testing.assert_allclose(got_b, want_b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_emb, want_emb, rtol=1e-4, atol=1e-4)


class _Socket:
    """Keeps what a server sends (ZeroMQ frames it would send without a copy)."""

    def __init__(self) -> None:
        self.sent: list[list] = []

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        self.sent.append(frames)


@pytest.mark.parametrize("op", ["pull", "push_pull"])
def test_a_dense_pull_sent_as_frames_is_not_changed_by_the_next_push(op):
    loop = _Loop(_Socket(), Shard(SPECS), secret=None)
    pull = {"op": "pull", "table": "b"} if op == "pull" else {"op": "push_pull", "pull": [["b", 0]]}
    loop.handle([b"id", *encode({**pull, "rid": 1})])
    loop.handle([b"id", *encode({"op": "push", "table": "b", "rid": 2}, [np.ones(6000, np.float32)])])
    (h1, (pulled,)), (h2, _) = (decode(frames[1:]) for frames in loop.sock.sent)
    assert h1["ok"] and h2["ok"], (h1, h2)
    np.testing.assert_array_equal(pulled, np.ones(6000, np.float32))  # the value before the push
    np.testing.assert_array_equal(loop.shard.pull("b"), np.full(6000, 1 - LR, np.float32))


def test_a_dense_view_pull_is_read_only_and_a_plain_pull_is_a_copy():
    shard = Shard(SPECS)
    view, copy = shard.pull("b", copy=False), shard.pull("b")
    assert not view.flags.writeable and copy.flags.writeable
    copy[:] = 7
    shard.push("b", np.ones(6000, np.float32))
    np.testing.assert_array_equal(view, np.full(6000, 1 - LR, np.float32))  # a view of the table
    np.testing.assert_array_equal(shard.pull("b"), np.full(6000, 1 - LR, np.float32))
