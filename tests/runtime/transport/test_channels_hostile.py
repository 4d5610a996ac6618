"""A trainer's or the driver's inbox (transport.channels) against hostile senders: a connection without
a link key is refused at its handshake; a message not signed with its sender's link key, or a captured
signed message sent again or out of order, is refused and skipped (counted, never raised), so that no
one without a key can stop or steer a run; a malformed message signed with a key (a peer's bug) still
raises. (Insiders, who hold a link key of their own: test_inbox_insiders.py.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
from link_keys import Tap, inbox_links, outbox_links, raw_push, signed

from runtime.engines import LocalEngine
from runtime.transport.channels import REFUSALS_PER_CALL, Inbox, Outbox
from runtime.transport.wire import WireError, encode


def _captured(run_dir: str, sends: list[tuple[dict, list]]) -> list[list[bytes]]:
    """The ZeroMQ frames an Outbox (sender "a" to "b") puts on the wire for `sends`, as an
    eavesdropper records them (a raw PULL socket in the receiver's place)."""
    ep = f"ipc://{run_dir}/tap"
    tap = Tap(ep)
    out = Outbox(outbox_links(ep), shm=False)
    try:
        for header, arrays in sends:
            out.send(ep, header, arrays)
        got = []
        for _ in sends:
            assert tap.poll(5000), "the Outbox sent nothing"
            got.append(tap.recv_multipart())
        return got
    finally:
        out.close()
        tap.close()


def _sends(n: int, size: int) -> list[tuple[dict, list]]:
    return [({"k": "t", "s": i}, [np.full(size, i, np.float32)]) for i in range(n)]


@pytest.mark.parametrize("shm", [False, True], ids=["frames", "shared-memory"])
def test_a_replayed_or_reordered_message_is_refused_and_the_channel_keeps_working(run_dir, shm):
    size = 8192 if shm else 16  # the new sender's message, 32 KiB: through the segment; 64 bytes: frames
    first, second, third = _captured(run_dir, _sends(3, size))
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    try:
        ep = inbox.endpoint
        raw_push(ep, first, first, third, second)  # again; then the 2nd after the 3rd: reordered
        header, (arr,) = inbox.recv(5000)
        assert header == {"k": "t", "s": 0} and arr[0] == 0  # the original, cid / seq taken off
        header, (arr,) = inbox.recv(5000)
        assert header == {"k": "t", "s": 2} and arr[0] == 2  # the replay of the 1st was skipped
        assert inbox.recv(500) is None  # the 2nd, after the 3rd: refused
        assert inbox.refused == 2 and "replayed or reordered" in inbox.last_refused
        out = Outbox(
            outbox_links(ep), shm=shm
        )  # a new sender (a new id) is heard, through the segment or not
        try:
            out.send(ep, {"k": "after"}, [np.arange(size, dtype=np.float32)])
            header, (arr,) = inbox.recv(5000)
            assert header == {"k": "after"} and arr.shape == (size,) and arr[-1] == size - 1
            assert (out.rings.get(ep) is not None) == shm
        finally:
            out.close()
    finally:
        inbox.close()


def test_a_replayed_shared_memory_descriptor_is_refused_before_its_segment_is_read(run_dir):
    """A recorded control message names a place in a ring that the sender has since reused:
    accepted again, it would hand the receiver another message's bytes."""
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    tap = Tap(f"ipc://{run_dir}/tap")
    ep = inbox.endpoint
    out = Outbox(outbox_links(ep, f"ipc://{run_dir}/tap"))  # (the tap stands where "b" would be)
    try:
        sent = np.arange(8192, dtype=np.float32)
        out.send(ep, {"k": "t"}, [sent])  # through the ring of this sender and receiver
        assert out.rings[ep] is not None and out.rings[ep].head > 0
        header, (arr,) = inbox.recv(5000)
        np.testing.assert_array_equal(arr, sent)
        # the eavesdropper cannot read the ring's name off the wire alone, so record the control
        # message as the receiver got it: sent to the tap by the same sender, with the next number
        out.send(f"ipc://{run_dir}/tap", {"k": "t"}, [np.ones(16, np.float32)])
        recorded = tap.recv_multipart(copy=True)
        out.send(ep, {"k": "t"}, [sent * 2])
        np.testing.assert_array_equal(inbox.recv(5000)[1][0], sent * 2)
        raw_push(ep, recorded)  # signed by the sender, but older than what the inbox has read
        assert inbox.recv(500) is None and inbox.refused == 1
    finally:
        out.close()
        tap.close()
        inbox.close()


def test_messages_without_the_key_are_refused_and_skipped(run_dir):
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    try:
        ep = inbox.endpoint
        raw_push(ep, signed({"k": "t", "cid": "a/x", "seq": 1}), login=None)  # no login: not connected
        raw_push(ep, signed({"k": "t", "cid": "a/x", "seq": 1}), receiver="c")  # a wrong token: neither
        raw_push(
            ep,
            [b"\x00garbage"],  # no MAC frame at all
            encode({"k": "t", "cid": "a/x", "seq": 1}, [np.zeros(3)], None),  # unsigned
            signed({"k": "t", "cid": "a/x", "seq": 2}, [np.zeros(3)], key=os.urandom(32)),  # another key
            signed({"k": "t", "cid": "z/x", "seq": 3}, sender="z"),  # a sender without a link to "b"
            signed({"k": "good", "cid": "a/x", "seq": 4}, [np.arange(3.0)]),
        )
        header, (arr,) = inbox.recv(5000)  # the four are skipped, the good one arrives
        assert header == {"k": "good"} and arr.tolist() == [0.0, 1.0, 2.0]
        assert inbox.refused == 4 and "no link to this endpoint" in inbox.last_refused
        assert inbox.refused_connections >= 1 and inbox.recv(300) is None  # (counted: the wrong token)
    finally:
        inbox.close()


def test_a_signed_message_without_a_sender_number_is_refused(run_dir):
    """Only an Outbox's messages (numbered) are heard: a signed message without `cid` / `seq` could
    be replayed at will."""
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    try:
        raw_push(inbox.endpoint, signed({"k": "t"}))
        assert inbox.recv(500) is None
        assert inbox.refused == 1 and "sequence number" in inbox.last_refused
    finally:
        inbox.close()


def test_a_malformed_message_signed_with_the_key_still_raises(run_dir):
    """A peer holding the key that sends a malformed message has a bug: that is an error, not noise."""
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    try:
        bad = signed(
            {"k": "t", "cid": "a/p", "seq": 1, "shm": {"seg": "../x", "at": 0, "n": 0, "arrays": []}}
        )
        raw_push(inbox.endpoint, bad)
        with pytest.raises(WireError, match="is not a segment of this run"):
            inbox.recv(5000)
    finally:
        inbox.close()


def test_a_run_under_hostile_traffic_trains_exactly_as_without_it():
    """While a sync run trains, a process without the key sends junk, unsigned and wrongly signed
    messages to every trainer's and the driver's inbox: the run ends normally with the losses of an
    undisturbed run, and each trainer counts what it refused."""
    from runtime import train
    from runtime.data import SyntheticCTR
    from transpiler import builder as nn
    from transpiler import transpile
    from transpiler.models import wide_deep

    plan = transpile(wide_deep(vocab=300, dim=8, hidden=(16,), optimizer=nn.SGD(lr=0.05)).main)

    def run(eng, callback=None):
        return train(
            plan,
            SyntheticCTR(vocab=300, seed=1),
            steps=60,
            batch_size=64,
            engine=eng,
            trainers={"cpu": 1, "gpu": 1},
            servers=1,
            mode="sync",
            allow_emulation=True,
            progress=False,
            callback=callback,
        )

    clean = run(LocalEngine())
    eng = LocalEngine()
    names = ["cpu:0", "gpu:0", "driver"]

    def attack(rec):
        if rec["step"] in (1, 3):
            for name in names:
                ep = eng.endpoint(name)
                raw_push(ep, [b"junk"], login=None)  # no key: refused at connection
                raw_push(ep, encode({"k": "t", "s": 0, "cid": "evil/x", "seq": 10**9}, [], None), login=None)
                raw_push(ep, [b"junk"], login="cpu:0", receiver="elsewhere")  # a wrong token: refused too

    hostile = run(eng, attack)
    assert hostile.steps == clean.steps == 60
    np.testing.assert_allclose(hostile.loss, clean.loss, rtol=1e-6)
    refused = {n: s["refused_connections"] for n, s in hostile.trainers.items()}
    assert all(v >= 1 for v in refused.values()), refused  # the wrong token (keyless: not counted)
    assert hostile.refused_connections >= 1  # the driver's
    assert clean.refused_connections == 0 and all(
        s["refused_connections"] == 0 for s in clean.trainers.values()
    )


def test_a_flood_of_refused_messages_does_not_hold_the_receiver(run_dir):
    """Each call skips at most REFUSALS_PER_CALL refused messages, then returns to its caller (a
    trainer runs its work between calls); the good message behind the flood still arrives."""
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    try:
        flood = 2 * REFUSALS_PER_CALL + 7
        raw_push(inbox.endpoint, *[[b"junk"]] * flood, signed({"k": "good", "cid": "a/p", "seq": 1}))
        calls, got = 0, None
        while got is None and calls < 10:
            got = inbox.recv(5000)
            calls += 1
            assert inbox.refused == min(flood, calls * REFUSALS_PER_CALL)  # at most that many a call
        assert got == ({"k": "good"}, []) and calls == 3
    finally:
        inbox.close()
