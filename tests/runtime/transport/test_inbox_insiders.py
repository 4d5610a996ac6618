"""A trainer's or the driver's inbox (transport.channels) against insiders and memory floods: a peer
that holds a link key of its own ("c") cannot speak as another sender ("a") nor lock it out, cannot
make the inbox forget what it has heard, and cannot send a frame over the inbox's limit; a peer
without a key is refused at its connection, before the inbox buffers any of its bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import zmq
from link_keys import MASTER, inbox_links, outbox_links, raw_push, signed

from runtime.transport.channels import Inbox, Outbox
from runtime.transport.wire import MAX_IDS_PER_NAME


def test_an_insider_cannot_lock_out_another_sender_with_its_id_and_a_huge_number(run_dir, caplog):
    """With one run key (before), "c" could sign a message claiming a's id with sequence number
    2**62: accepted, and every later message of a refused as a replay."""
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    out = Outbox(outbox_links(inbox.endpoint), shm=False)
    try:
        out.send(inbox.endpoint, {"k": "first"})
        assert inbox.recv(5000)[0] == {"k": "first"}
        forged = {"k": "forged", "cid": out.cid, "seq": 2**62}
        raw_push(
            inbox.endpoint,
            signed(forged, sender="c"),  # c's own key, a's id in the header
            signed(forged, sender="a", receiver="b", key=_key("c", "b")),  # a's name, c's key
            login="c",
        )
        assert inbox.recv(2000) is None and inbox.refused == 2  # both refused, before a speaks again
        assert (
            "signed with the link key of 'c'" in _reasons(caplog)
            and "MAC does not match" in inbox.last_refused
        )
        out.send(inbox.endpoint, {"k": "after"})
        assert inbox.recv(5000)[0] == {"k": "after"}  # a is still heard
    finally:
        out.close()
        inbox.close()


def test_fresh_ids_are_admitted_up_to_a_bound_and_nothing_heard_is_forgotten(run_dir):
    """5000 fresh ids from one insider: at most MAX_IDS_PER_NAME are heard; a captured message of
    the first is still refused as a replay afterwards (with a guard that forgets the least recent of
    4096, before, it was accepted again); another sender is still heard."""
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    try:
        ids = [signed({"k": "t", "i": i, "cid": f"c/{i}", "seq": 1}, sender="c") for i in range(5000)]
        raw_push(inbox.endpoint, *ids, login="c")
        heard = 0
        while True:  # (each call skips at most REFUSALS_PER_CALL refused messages)
            refused = inbox.refused
            if inbox.recv(2000) is not None:
                heard += 1
            elif inbox.refused == refused:
                break
        assert heard == MAX_IDS_PER_NAME and inbox.refused == 5000 - MAX_IDS_PER_NAME
        raw_push(inbox.endpoint, ids[0], login="c")
        assert inbox.recv(500) is None and "replayed" in inbox.last_refused
        out = Outbox(outbox_links(inbox.endpoint))
        out.send(inbox.endpoint, {"k": "a"})
        assert inbox.recv(5000)[0] == {"k": "a"}
        out.close()
    finally:
        inbox.close()


def test_a_frame_over_the_limit_drops_the_insiders_connection_unread(run_dir):
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links(), max_bytes=1 << 20)
    try:
        raw_push(inbox.endpoint, signed({"k": "big", "cid": "c/1", "seq": 1}, [np.zeros(1 << 19)]), login="c")
        assert inbox.recv(1000) is None  # 4 MiB frame: the connection is dropped, nothing queued
        out = Outbox(outbox_links(inbox.endpoint))
        out.send(inbox.endpoint, {"k": "a"}, [np.zeros(1000)])
        assert inbox.recv(5000)[0] == {"k": "a"}
        out.close()
    finally:
        inbox.close()


_INBOX_PROCESS = textwrap.dedent(
    """
    import os, sys, time
    from runtime.transport.channels import Inbox, Links
    inbox = Inbox("tcp://127.0.0.1:*", Links.derive(bytes.fromhex(os.environ["MASTER"]), "b", senders=["a"]))
    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) << 10
    print(inbox.endpoint, rss(), flush=True)
    sys.stdin.readline()  # the flood has been sent: read nothing before it, then one good message
    got = inbox.recv(10_000)
    print(rss(), None if got is None else got[0]["k"], inbox.refused, inbox.refused_connections, flush=True)
    inbox.close()
    """
)


def test_keyless_floods_over_tcp_are_refused_at_connection_with_bounded_memory():
    """120 x 10 MB messages from a peer without a key (one without a login, one with a wrong
    token), on tcp, to an inbox that reads nothing meanwhile: before, its process buffered all of
    them (+1.2 GB); now its peak resident size grows by less than 100 MB, and a keyed sender is heard."""
    env = {**os.environ, "MASTER": MASTER.hex(), "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", _INBOX_PROCESS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        ep, before = child.stdout.readline().split()
        big = np.ones(10 << 20, np.uint8)
        for login in (None, "z"):
            _flood(ep, login, [signed({"k": "t", "cid": "a/x", "seq": i + 1}, [big]) for i in range(60)])
        out = Outbox(outbox_links(ep))
        out.send(ep, {"k": "good"})
        child.stdin.write("\n")
        child.stdin.flush()
        peak, got, refused, refused_connections = child.stdout.readline().split()
        out.close()
        assert got == "good" and refused == "0"
        assert int(peak) - int(before) < 100 << 20, (int(peak) - int(before)) >> 20
    finally:
        child.kill()
        child.wait()


def _flood(ep: str, login: str | None, messages: list) -> None:
    """Push `messages` through one socket (logged in as `login`, with a token of no link), each
    waiting at most 0.2 s for room; then give the I/O threads 1 s."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.linger, sock.sndtimeo = 0, 200
    if login is not None:
        sock.plain_username, sock.plain_password = login.encode(), b"0" * 32
    sock.connect(ep)
    for frames in messages:
        try:
            sock.send_multipart(frames, copy=False)
        except zmq.Again:
            pass
    time.sleep(1.0)
    sock.close()


def _reasons(caplog) -> str:
    return " ".join(r.getMessage() for r in caplog.records)


def _key(sender: str, receiver: str) -> bytes:
    from runtime.transport.wire import link_key

    return link_key(MASTER, sender, receiver)


def test_a_sender_whose_login_is_refused_gets_an_error_not_a_hang(run_dir, monkeypatch):
    """A process with a key of no link to an inbox (another run's) is refused at its handshake;
    ZeroMQ then has no connection to queue in, and a send fails after SEND_TIMEOUT_MS naming the
    endpoint instead of blocking for ever."""
    import pytest

    from runtime.transport import channels
    from runtime.transport.wire import WireError

    monkeypatch.setattr(channels, "SEND_TIMEOUT_MS", 300)
    inbox = Inbox(f"ipc://{run_dir}/b", inbox_links())
    out = Outbox(outbox_links(inbox.endpoint, name="z"))
    try:
        t0 = time.monotonic()
        with pytest.raises(WireError, match="refuses this process's login"):
            for _ in range(50):
                out.send(inbox.endpoint, {"k": "t"})
                time.sleep(0.05)
        assert time.monotonic() - t0 < 10 and inbox.recv(200) is None
        assert inbox.refused_connections >= 1
    finally:
        out.close()
        inbox.close()
