"""Same-host tensors through shared memory (transport.channels, transport.shm): exact round trips, the
ring's flow control, ZeroMQ fallback, refusal of hostile control messages, and clean-up of the segments."""

import itertools
import os
import time

import numpy as np
import pytest
from link_keys import inbox_links, outbox_links, raw_push, signed

from runtime.engines import LocalEngine
from runtime.transport import shm
from runtime.transport.channels import Inbox, Outbox
from runtime.transport.shm import shm_dir_for
from runtime.transport.wire import WireError


def _pair(run_dir, shm=True):
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    return inbox, Outbox(outbox_links(inbox.endpoint), shm=shm), inbox.endpoint


def _recv(inbox):
    msg = inbox.recv(5000)
    assert msg is not None, "no message within 5 s"
    return msg


def _arrays(rng):
    return [
        rng.normal(size=(300, 64)).astype(np.float32),  # 75 KiB: over SHM_MIN_BYTES
        np.arange(7, dtype=np.int64),
        np.float64(2.5),
        np.zeros((0, 4), np.float16),
        np.array([True, False, True]),
        rng.normal(size=(40, 60))[:, ::2],  # not contiguous
        np.arange(6, dtype=">i4").reshape(2, 3),
    ]  # big-endian


def test_tensors_arrive_exactly_through_the_segment(run_dir):
    inbox, out, ep = _pair(run_dir)
    try:
        for seed in range(3):
            sent = _arrays(np.random.default_rng(seed))
            out.send(ep, {"k": "t", "s": seed}, sent)
            header, got = _recv(inbox)
            assert header == {"k": "t", "s": seed}
            for a, b in zip(sent, got, strict=True):
                a = np.asarray(a)
                assert b.shape == a.shape and b.dtype == a.dtype.newbyteorder("=")
                np.testing.assert_array_equal(b, a)
        ring = out.rings[ep]
        assert ring is not None and ring.head > 0  # they went through shared memory
        assert int(ring.consumed[0]) == ring.head  # and the receiver said it read them all
        assert os.listdir(shm_dir_for(run_dir)) == []  # mapped by both: its name is gone
    finally:
        out.close()
        inbox.close()


def test_small_messages_and_endpoints_without_the_twin_go_as_zeromq_frames(run_dir, tmp_path):
    inbox, _, ep = _pair(run_dir)
    other = Inbox(f"ipc://{tmp_path}/c", inbox_links())  # not a run directory: no shared memory
    out = Outbox(outbox_links(ep, other.endpoint))
    try:
        out.send(ep, {"k": 1}, [np.arange(10)])
        assert out.rings[ep].head == 0 and _recv(inbox)[1][0].tolist() == list(range(10))
        big = np.arange(100_000, dtype=np.float32)
        out.send(f"ipc://{tmp_path}/c", {"k": 2}, [big])
        assert out.rings[f"ipc://{tmp_path}/c"] is None
        np.testing.assert_array_equal(_recv(other)[1][0], big)
    finally:
        out.close()
        inbox.close()
        other.close()


def test_a_full_ring_falls_back_to_zeromq_and_order_is_kept(run_dir, monkeypatch):
    """The receiver reads nothing while 12 messages of 1/4 ring each are sent: the first ones fill
    the ring, the rest go as frames (a send never blocks); all arrive, in order, intact; once read,
    the ring takes messages again, wrapping around."""
    monkeypatch.setattr(shm, "SHM_RING_BYTES", 1 << 20)
    inbox, out, ep = _pair(run_dir)
    rng = np.random.default_rng(0)
    sent = [rng.normal(size=(256 << 10) // 4 - 64).astype(np.float32) for _ in range(12)]
    try:
        for i, a in enumerate(sent):
            out.send(ep, {"i": i}, [a])
        ring = out.rings[ep]
        assert 0 < ring.head <= 1 << 20  # some went through the ring, not all of them
        assert out.ring_full() == 12 - ring.head // sent[0].nbytes  # the others are counted
        for i, a in enumerate(sent):
            header, (got,) = _recv(inbox)
            assert header == {"i": i}
            np.testing.assert_array_equal(got, a)
        before = ring.head
        for i in range(8):  # 2 ring lengths: wraps twice
            out.send(ep, {"i": i}, [sent[i]])
            np.testing.assert_array_equal(_recv(inbox)[1][0], sent[i])
        assert ring.head - before >= 2 << 20
    finally:
        out.close()
        inbox.close()


_forged = itertools.count(1)


def _control(ep, desc, key=None):
    """Send a hand-made control message to `ep` as sender "a" (signed with its link key, or `key`),
    numbered as an Outbox numbers its messages."""
    raw_push(ep, signed({"k": "t", "shm": desc, "cid": "a/hand", "seq": next(_forged)}, key=key))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seg": "../../etc/passwd"}, "is not a segment of this run"),
        ({"seg": "1-0badc0de-nonexistent"}, "cannot be opened"),
        ({"at": (8 << 20) - 100, "n": 1 << 20}, "lies outside segment"),  # would wrap past the end
        ({"n": 16}, r"lie outside its message of 16"),
        ({"arrays": [["<f4", [1001], 0, 4000]], "n": 4000}, "needs 4004 bytes, frame has 4000"),
        ({"arrays": [["|O", [1], 0, 8]]}, "Invalid enum value '|O'"),
        ({"arrays": [["<f4", [1] * 33, 0, 4]]}, r"length <= 32 - at `\$.arrays\[0\]\[1\]`"),
        ({"arrays": [["<f4", [True], 0, 4]]}, "Expected `int`, got `bool`"),
        ({"arrays": [["<f4", [4], 0, 16, 0]]}, "Expected `array` of length 4"),
        ({"seg": 7}, "Expected `str`, got `int`"),
        ({"extra": 1}, "unknown field `extra`"),
        ({"at": 1 << 62}, r"Expected `int` <= 4611686018427387903 - at `\$.at`"),
        ({"arrays": [["<f4", [4], 0, 15]]}, "needs 16 bytes, frame has 15"),
        ({"arrays": [["<f4", [4], -8, 16]]}, r"is not \{seg, at, n, arrays: \[\[dtype, shape, offset, bytes"),
        ({"at": -1}, r"Expected `int` >= 0 - at `\$.at`"),
    ],
)
def test_hostile_control_messages_are_refused_without_reading_outside_the_segment(run_dir, change, message):
    inbox, out, ep = _pair(run_dir)
    try:
        out.send(ep, {"k": "t"}, [np.arange(8192, dtype=np.float32)])  # maps the real segment
        _recv(inbox)
        desc = {"seg": out.rings[ep].name, "at": 0, "n": 32768, "arrays": [["<f4", [8192], 0, 32768]]}
        if "arrays" in change and "n" not in change:
            change = {**change, "n": 64}
        _control(ep, {**desc, **change})
        with pytest.raises(WireError, match=message):
            _recv(inbox)
        out.send(ep, {"k": "after"}, [np.arange(8192, dtype=np.float32)])  # the channel still works
        assert _recv(inbox)[0] == {"k": "after"}
    finally:
        out.close()
        inbox.close()


def test_unsigned_control_messages_and_symlinked_segments_are_refused(run_dir):
    inbox, out, ep = _pair(run_dir)
    try:
        _control(ep, {"seg": "1-0badc0de-x", "at": 0, "n": 0, "arrays": []}, key=os.urandom(32))
        assert inbox.recv(500) is None  # refused before its descriptor is looked at, and skipped
        assert inbox.refused == 1 and "MAC" in inbox.last_refused
        os.symlink("/etc/hostname", os.path.join(shm_dir_for(run_dir), "1-0badc0de-link"))
        _control(ep, {"seg": "1-0badc0de-link", "at": 0, "n": 0, "arrays": []})
        with pytest.raises(WireError, match="cannot be opened"):
            _recv(inbox)
    finally:
        out.close()
        inbox.close()


def test_a_message_sent_just_before_the_sender_closes_still_arrives(run_dir):
    """A trainer's last message (e.g. its trace) is read after the trainer has closed its Outbox
    and exited; before the fix the sender unlinked its segment on close and the receiver failed
    with 'shared-memory segment ... cannot be opened'."""
    inbox, out, ep = _pair(run_dir)
    last = np.random.default_rng(5).normal(size=50_000).astype(np.float32)
    out.send(ep, {"k": "last"}, [last])
    out.close()
    try:
        header, (got,) = _recv(inbox)
        assert header == {"k": "last"}
        np.testing.assert_array_equal(got, last)
    finally:
        inbox.close()


def test_the_local_engine_makes_a_private_twin_and_removes_it_with_the_run_directory():
    eng = LocalEngine()
    ep = eng.endpoint("cpu:0")
    twin = shm_dir_for(eng.tmp)
    try:
        assert os.path.isdir(twin) and os.stat(twin).st_mode & 0o777 == 0o700
        inbox, out = Inbox(ep, inbox_links()), Outbox(outbox_links(ep, eng.endpoint("gpu:0")))
        out.send(ep, {}, [np.zeros(10_000, np.float32)])
        _recv(inbox)
        out.send(eng.endpoint("gpu:0"), {}, [np.zeros(10_000, np.float32)])  # a segment nobody mapped
        out.close()
        inbox.close()
        assert len(os.listdir(twin)) == 1  # the mapped one is unlinked, the other waits for the run's end
    finally:
        eng.stop()
    deadline = time.monotonic() + 5
    while os.path.exists(twin) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(twin)


def test_trainers_read_tensors_in_place_and_hand_every_message_back():
    """A trainer reads another's tensors where they lie in shared memory and hands the bytes back
    once their step is pushed: over 4 ring-fulls of tensors each way, no message finds the ring
    full (each would go as ZeroMQ frames; `ring_full` counts them). The values are checked by the
    equivalence tests; this checks that nothing is held back."""
    from runtime import train
    from runtime.data import SyntheticCTR
    from transpiler import builder as nn
    from transpiler import transpile
    from transpiler.models import wide_deep

    model = wide_deep(vocab=500, dim=16, hidden=(32,), optimizer=nn.SGD(lr=0.01))
    hist = train(  # 26 slots x 16 x 512 x 4 bytes = 852 KB a message, 40 steps: 34 MB each way
        transpile(model.main),
        SyntheticCTR(vocab=500),
        steps=40,
        batch_size=512,
        engine=LocalEngine(),
        trainers={"cpu": 1, "gpu": 1},
        micro_batches=1,
        servers=1,
        mode="async",
        allow_emulation=True,
        progress=False,
    )
    assert hist.steps == 40
    assert {n: s["ring_full"] for n, s in hist.trainers.items()} == {"cpu:0": 0, "gpu:0": 0}


def test_a_strided_array_goes_through_the_segment_as_it_would_as_frames(run_dir):
    """A column slice (what a concat's gradient sends) is laid out in C order by the ring's copy,
    not by a copy of its own first; what arrives equals the slice, through shared memory and not."""
    inbox, out, ep = _pair(run_dir)
    full = np.random.default_rng(0).normal(size=(512, 429)).astype(np.float32)
    part = full[:, :416]
    assert not part.flags.c_contiguous
    try:
        out.send(ep, {"i": 0}, [part, full[:, 416:].T])
        assert out.rings[ep].head > 0  # through the segment
        header, (a, b) = _recv(inbox)
        np.testing.assert_array_equal(a, part)
        np.testing.assert_array_equal(b, full[:, 416:].T)
        assert a.flags.c_contiguous and b.shape == (13, 512)
    finally:
        out.close()
        inbox.close()
