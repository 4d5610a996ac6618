"""A parameter server against an insider — a process that holds a run's data key but is not the
client it claims to be — and against growth without bound: each refused with a clear error, the
legitimate clients unaffected."""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from raw_ps import Raw

from runtime.ps import Limits, PSClient, PSError, Servers, Shard
from runtime.transport.wire import ReplayError, Sessions, client_key, encode, header_frame, sign
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


# -- holds: a plan fact; identities: bound to each client's own key -------------------------------
W = TableSpec(name="w", kind="dense", shape=[3, 2], dtype="float32", initializer=ONE, optimizer=SGD)


def trainer(servers: Servers, name: str, **kw) -> PSClient:
    """A client as `train` makes a trainer's: its own key only (derived by the driver), its name."""
    return PSClient(servers.endpoints, client_key=client_key(servers.secret, name), pusher=name, **kw)


@pytest.fixture(scope="module")
def held_server():
    with Servers([W, EMB], mode="async", holders={"w": "gpu:0"}) as s:
        yield s


def test_only_the_trainer_the_plan_names_may_hold_a_table(held_server):
    # Before the fix a hold + write_back signed with the data key replaced the table's values and
    # made the shard refuse the table's real pushers.
    with trainer(held_server, "cpu:1", timeout=10) as evil, trainer(held_server, "gpu:0", timeout=10) as gpu:
        with pytest.raises(
            PSError, match=r"hold of table 'w' by 'cpu:1' refused: the plan gives it to 'gpu:0'"
        ):
            evil.hold(["w"])
        with pytest.raises(PSError, match="no trainer holds it"):
            evil.write_back({"w": {"Param": np.full((3, 2), 7.0, np.float32)}}, 1, True)
        gpu.push("w", np.full((3, 2), 0.5, np.float32))  # the real pusher: 1 - 0.5 * 0.5
        np.testing.assert_array_equal(gpu.pull("w"), np.full((3, 2), 0.75, np.float32))
        state = gpu.hold(["w"])["w"]
        np.testing.assert_array_equal(state["Param"], np.full((3, 2), 0.75, np.float32))
        with pytest.raises(PSError, match="another client holds it"):
            evil.write_back({"w": {"Param": np.full((3, 2), 7.0, np.float32)}}, 1, True)
        with pytest.raises(PSError, match="NaN or Inf"):
            gpu.write_back({"w": {"Param": np.full((3, 2), np.nan, np.float32)}}, 1, False)
        with pytest.raises(PSError, match=r"shape \[2, 2\], expected \[3, 2\]"):
            gpu.write_back({"w": {"Param": np.zeros((2, 2), np.float32)}}, 1, False)
        gpu.write_back({"w": {"Param": np.full((3, 2), 0.25, np.float32)}}, 1, True)
        np.testing.assert_array_equal(evil.pull("w"), np.full((3, 2), 0.25, np.float32))


def test_a_client_cannot_claim_another_clients_id_or_lock_it_out(held_server):
    # Before the fix a message under another client's id with a huge sequence number locked that
    # client out for good (its next request was "replayed or reordered").
    with trainer(held_server, "cpu:0", timeout=10) as victim:
        evil = Raw(held_server, key=client_key(held_server.secret, "cpu:1"), cid="cpu:1")
        forged = evil.sign({"op": "stats"}, cid=victim._cid, seq=10**15, sess=victim._sess[0])
        reply = evil.ask(forged)
        assert reply["ok"] is False and "claims sender id 'cpu:0/" in reply["error"], reply
        assert "a client may speak only as itself" in reply["error"]
        signed_as_victim = sign(forged[:-1], client_key(held_server.secret, "cpu:1"), "cpu:0")
        reply = evil.ask(signed_as_victim)  # naming the victim in the MAC frame: the wrong key
        assert reply["ok"] is False and "MAC does not match" in reply["error"], reply
        evil.close()
        victim.push("emb", np.full((1, DIM), 0.5, np.float32), np.array([5]))  # not locked out
        np.testing.assert_array_equal(victim.pull("emb", np.array([5])), np.full((1, DIM), 0.75, np.float32))


def test_a_sync_push_under_another_pushers_name_is_refused_and_the_real_one_applied():
    # Before the fix a forged pusher id's step-0 push was applied and the real one refused.
    with Servers([W], mode="sync", pushes_per_step=2) as s:
        with trainer(s, "cpu:0", timeout=10) as a, trainer(s, "cpu:1", timeout=10) as b:
            forged = Raw(s, key=client_key(s.secret, "evil"), cid="evil")
            push = forged.sign(
                {"op": "push", "table": "w", "step": 0, "pusher": "cpu:0"}, [np.ones((3, 2), np.float32)]
            )
            reply = forged.ask(push)
            forged.close()
            assert reply["ok"] is False and "push as pusher 'cpu:0' refused" in reply["error"], reply
            g = np.full((3, 2), 0.25, np.float32)
            a.push("w", g, step=0)
            b.push("w", g, step=0)
            np.testing.assert_array_equal(a.pull("w", step=1), np.full((3, 2), 1 - 0.5 * 0.5, np.float32))


def test_a_flood_of_hellos_forgets_only_the_flooders_sessions_and_a_replay_stays_refused(held_server):
    # Before the fix, after 4 200 hellos from fresh ids (the guard remembered 4 096 senders) a
    # captured push was accepted again.
    with trainer(held_server, "cpu:0", timeout=10) as victim:
        sent = []
        real = victim._socks[0].send_multipart
        victim._socks[0].send_multipart = lambda frames, **kw: (
            sent.append([bytes(f) for f in frames]),
            real(frames, **kw),
        )[1]
        victim.push("emb", np.full((1, DIM), 0.5, np.float32), np.array([77]))
        victim._socks[0].send_multipart = real
        flood = Raw(held_server, key=client_key(held_server.secret, "cpu:1"), cid="cpu:1", hello=False)
        for i in range(4200):
            flood.sock.send_multipart(
                encode({"op": "hello", "cid": f"cpu:1/{i}", "seq": 0, "to": 0}, (), flood.key, "cpu:1")
            )
        for _ in range(4200):
            assert flood.sock.poll(10_000)
            flood.sock.recv_multipart()
        reply = flood.ask(sent[0])
        assert reply["ok"] is False and "replayed or reordered" in reply["error"], reply
        flood.close()
        victim.push("emb", np.full((1, DIM), 0.5, np.float32), np.array([77]))  # its session lives on
        np.testing.assert_array_equal(victim.pull("emb", np.array([77])), np.full((1, DIM), 0.5, np.float32))


def test_a_forgotten_sender_must_say_hello_again_and_its_captured_requests_stay_refused():
    guard = Sessions(max_senders=3)
    sess = guard.open({"cid": "a/1", "seq": 0})
    guard.check({"cid": "a/1", "seq": 1, "sess": sess})
    for i in range(3):  # other names' sessions: a/1 is forgotten
        guard.open({"cid": f"b{i}/1", "seq": 0})
    with pytest.raises(ReplayError, match="has no session here"):
        guard.check({"cid": "a/1", "seq": 2, "sess": sess})  # (with the old guard: accepted)
    again = guard.open({"cid": "a/1", "seq": 0})  # a captured hello opens a session with a new id
    assert again != sess
    with pytest.raises(ReplayError, match="has no session here"):
        guard.check({"cid": "a/1", "seq": 5, "sess": sess})  # so requests captured before stay refused
    with pytest.raises(ReplayError, match="said hello twice"):
        guard.open({"cid": "a/1", "seq": 0})


# -- memory before authentication -----------------------------------------------------------------
def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_a_peer_without_a_key_cannot_make_a_shard_buffer_anything():
    # Before the fix a shard buffered a whole multi-frame message (each frame under ZMQ_MAXMSGSIZE)
    # before it checked its size or MAC: +1.6 GB for 3 x 600 MB unsigned frames.
    frame = np.zeros(40 << 20, np.uint8)  # 3 x 40 MB frames, each under the 64 MiB limit
    with Servers([W], limits=Limits(max_message_bytes=64 << 20)) as s:
        pid = s.processes[0].pid
        with PSClient(s.endpoints, secret=s.secret) as c:  # (the shard is warm: its peak is its own)
            c.pull("w")
            before = _peak_rss(pid)
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(s.endpoints[0])
            sock.send_multipart([header_frame({"op": "push", "table": "w"}), frame, frame, frame], copy=False)
            assert not sock.poll(3000)  # no reply: the connection was never admitted
            sock.close()
            np.testing.assert_array_equal(c.pull("w"), np.ones((3, 2), np.float32))
            grew = _peak_rss(pid) - before
        assert grew < 40 << 20, grew  # (the old way: >= 120 MB)
