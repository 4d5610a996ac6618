"""A parameter server under hostile or buggy requests: every message below is sent through a raw
ZeroMQ socket, gets an error reply, and the shard then still answers correctly (issue 11, items 3-5).

The expected values are written out by hand: the tables start at a constant 1.0 and use SGD, so a
pull after one push of gradient g is 1.0 - lr * g exactly.
"""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
from raw_ps import Raw

from runtime.ps import Limits, PSClient, PSError, Servers, Shard
from runtime.transport.wire import MAX_HEADER_DEPTH, decode, encode
from transpiler.tables import TableSpec

LR, DIM = 0.5, 4
ONE = {"type": "constant", "value": 1.0}
SGD = {"type": "sgd", "lr": LR}
SPECS = [
    TableSpec(name="w", kind="dense", shape=[3, 2], dtype="float32", initializer=ONE, optimizer=SGD),
    TableSpec(
        name="emb",
        kind="sparse",
        shape=[-1, DIM],
        dtype="float32",
        initializer=ONE,
        optimizer=SGD,
    ),
]
LIMITS = Limits(max_message_bytes=1 << 20, max_new_rows=100, max_steps_ahead=4, max_buffered=3, max_parked=5)


@pytest.fixture(scope="module")
def sync_server(tmp_path_factory):
    """One sync shard that waits for 2 pushers per step: pulls of later steps park, pushes buffer."""
    root = tmp_path_factory.mktemp("ckroot")
    with Servers(
        SPECS, mode="sync", pushes_per_step=2, limits=LIMITS, checkpoint_root=root, log_dir=root
    ) as s:
        yield s


def _still_serves(servers: Servers) -> None:
    assert all(p.is_alive() for p in servers.processes), "a shard exited"
    with PSClient(servers.endpoints, secret=servers.secret, timeout=10) as c:
        np.testing.assert_array_equal(c.pull("w"), np.ones((3, 2), np.float32))
        assert c.stats()[0]["emb"]["rows"] == 0  # nothing hostile created rows


def _nested(depth: int) -> bytes:
    """A header frame [{"op": "hello", "x": [[...]]}, []] with `depth` arrays, as raw MessagePack."""
    return msgspec.msgpack.encode([{"op": "hello", "x": None}, []])[:-2] + b"\x91" * depth + b"\xc0\x90"


def _header(arrays: list) -> bytes:
    """A header frame (raw MessagePack) of a push to "w" with these array descriptors."""
    return msgspec.msgpack.encode([{"op": "push", "table": "w"}, arrays])


HOSTILE = {  # name: (frames for Raw, expected error text)
    "a header nested 100 000 deep (RecursionError with JSON)": (
        lambda r: r.signed_raw(_nested(100_000)),
        "nested deeper",
    ),
    "a header nested past MAX_HEADER_DEPTH": (
        lambda r: r.signed_raw(_nested(40)),
        f"nested deeper than {MAX_HEADER_DEPTH}",
    ),
    "65 dimensions": (lambda r: r.signed_raw(_header([["<f4", [1] * 65]]), b"\0" * 4), "of length <= 32"),
    "a pickled array": (lambda r: r.signed_raw(_header([["|O", [1]]]), b"\x80\x04K\x01."), "'|O'"),
    "a truncated header": (lambda r: r.signed_raw(_header([["<f4", [6]]])[:-2], b"\0" * 24), "truncated"),
    "shape [0, 2**63]": (lambda r: r.signed_raw(_header([["<f4", [0, 2**63]]]), b""), "not a valid array"),
    "shape [0, 2**62]": (lambda r: r.signed_raw(_header([["<f4", [0, 2**62]]]), b""), "not a valid array"),
    "message over max_message_bytes": (
        lambda r: r.sign({"op": "push", "table": "w"}, [np.zeros(300_000, np.float32)]),
        "more than the limit of 1048576",
    ),
    "header over 1 MiB": (lambda r: r.signed_raw(b"\xc0" * ((1 << 20) + 2)), "more than"),
    "not MessagePack": (lambda r: r.signed_raw(b"\xc1\xfe"), "not MessagePack"),
    "the old JSON header": (lambda r: r.signed_raw(b'{"op":"hello","arrays":[]}'), "header frame is not"),
    "a header that is a list": (lambda r: r.signed_raw(msgspec.msgpack.encode([[1], []])), "a map of string"),
    "a header key that is not a string": (
        lambda r: r.signed_raw(msgspec.msgpack.encode([{1: "hello"}, []])),
        "Expected `str`",
    ),
    "an ext value (e.g. a timestamp)": (
        lambda r: r.signed_raw(
            msgspec.msgpack.encode([{"op": "pull", "x": msgspec.msgpack.Ext(1, b"")}, []])
        ),
        "got `ext`",
    ),
    "unknown op": (lambda r: r.sign({"op": "rm -rf"}), "unknown request op"),
    "table of the wrong type": (lambda r: r.sign({"op": "pull", "table": ["w"]}), "needs field 'table'"),
    "step of the wrong type": (
        lambda r: r.sign({"op": "pull", "table": "w", "step": "1"}),
        "needs field 'step'",
    ),
    "too many new rows in an unbounded table": (
        lambda r: r.sign({"op": "pull", "table": "emb"}, [np.arange(101, dtype=np.int64) * 7]),
        "would create 101 rows in one request, more than max_new_rows=100",
    ),
    "pull too many steps ahead": (
        lambda r: r.sign({"op": "pull", "table": "w", "step": 10**18}),
        "max_steps_ahead=4",
    ),
    "push too many steps ahead": (
        lambda r: r.sign(
            {"op": "push", "table": "w", "step": 5, "pusher": r.name}, [np.ones((3, 2), np.float32)]
        ),
        "max_steps_ahead=4",
    ),
    "unsigned": (lambda r: encode({"op": "hello", "cid": "x", "seq": 1}), "authentication failed"),
    "wrong key": (
        lambda r: encode({"op": "hello", "cid": "x", "seq": 1}, [], b"guess"),
        "authentication failed",
    ),
    "signed but no sequence number": (
        lambda r: encode({"op": "hello", "to": 0}, [], r.key, r.name),
        "sequence number",
    ),
    "push_pull describing more arrays than it carries": (
        lambda r: r.sign({"op": "push_pull", "push": [["w", 1]], "pull": [], "step": 0, "pusher": "a"}),
        "push_pull describes 1 arrays, the request carries 0",
    ),
    "push_pull pulling a dense table twice": (
        lambda r: r.sign({"op": "push_pull", "push": [], "pull": [["w", 0], ["w", 0]]}),
        "pulls a dense table more than once",
    ),
    "push_pull part of the wrong form": (
        lambda r: r.sign({"op": "push_pull", "pull": [["w", 7]]}),
        "must be a list of [table, number of arrays in (0, 1)]",
    ),
    "signed for another shard": (
        lambda r: encode({"op": "hello", "cid": "x", "seq": 1, "to": 1}, [], r.key, r.name),
        "addressed to shard 1, this is shard 0",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_message_gets_an_error_reply_and_the_shard_still_serves(sync_server, name):
    make, message = HOSTILE[name]
    raw = Raw(sync_server, cid=f"raw-{name}")
    reply = raw.ask(make(raw))
    raw.close()
    assert reply["ok"] is False and message in reply["error"], reply
    _still_serves(sync_server)


def test_a_frame_far_over_the_limit_is_dropped_by_zeromq_unread_and_the_shard_still_serves(sync_server):
    raw = Raw(sync_server, cid="huge")
    raw.sock.send_multipart(raw.sign({"op": "push", "table": "w"}, [np.zeros(3 << 18, np.float32)]))  # 3 MiB
    assert not raw.sock.poll(2000)  # over 2 x max_message_bytes: the connection is dropped, no reply
    raw.close()
    _still_serves(sync_server)


def test_parked_pulls_and_buffered_pushes_are_bounded_and_then_served(sync_server):
    raw = Raw(sync_server, cid="a")  # (it pushes as pusher "a")
    for i in range(LIMITS.max_parked):  # pulls of step 1 wait for step 0: parked, no reply yet
        raw.sock.send_multipart(raw.sign({"op": "pull", "table": "w", "step": 1, "rid": f"p{i}"}))
    over = raw.ask(raw.sign({"op": "pull", "table": "w", "step": 1}))
    assert over["ok"] is False and "max_parked=5" in over["error"]
    g = np.full((3, 2), 0.25, np.float32)
    for step in (1, 2, 3):  # pushes for later steps wait in the shard: 3 allowed, a 4th refused
        assert raw.ask(raw.sign({"op": "push", "table": "w", "step": step, "pusher": "a"}, [g]))["ok"]
    over = raw.ask(raw.sign({"op": "push", "table": "w", "step": 4, "pusher": "a"}, [g]))
    assert over["ok"] is False and "max_buffered=3" in over["error"]
    # step 0 from both pushers: the parked pulls get the value after that one step
    with (
        PSClient(sync_server.endpoints, secret=sync_server.secret, pusher="b") as b,
        PSClient(sync_server.endpoints, secret=sync_server.secret, pusher="a") as a,
    ):
        a.push("w", g, step=0)
        b.push("w", g, step=0)
        answers = [
            decode(raw.sock.recv_multipart(), raw.key)
            for _ in range(LIMITS.max_parked)
            if raw.sock.poll(10_000)
        ]
        assert sorted(h["rid"] for h, _ in answers) == [f"p{i}" for i in range(LIMITS.max_parked)]
        for _, (value,) in answers:
            np.testing.assert_array_equal(value, np.full((3, 2), 1.0 - LR * 2 * 0.25, np.float32))
        for step in (1, 2, 3):  # b completes the buffered steps: 4 steps of 0.5 each in all
            b.push("w", g, step=step)
        np.testing.assert_array_equal(b.pull("w", step=4), np.full((3, 2), 1.0 - 4 * LR * 0.5, np.float32))
    raw.close()


def test_new_rows_are_counted_once_per_distinct_id_and_a_refusal_creates_none():
    shard = Shard(SPECS, limits=Limits(max_new_rows=100))
    shard.pull("emb", np.repeat(np.arange(60) * 1000, 5))  # 300 ids, 60 new rows: allowed
    with pytest.raises(PSError, match="would create 101 rows"):
        shard.push("emb", np.ones((101, DIM), np.float32), np.arange(101) + 10**12)
    assert len(shard.tables["emb"]) == 60
    shard.pull("emb", np.arange(160) * 1000)  # 60 known + 100 new: allowed
    assert len(shard.tables["emb"]) == 160


def test_limits_leave_legitimate_requests_alone():
    frozen = TableSpec(
        name="f",
        kind="dense",
        shape=[2],
        dtype="float32",
        initializer=ONE,
        optimizer=None,
    )
    shard = Shard([*SPECS, frozen], mode="sync", limits=Limits(max_new_rows=10, max_steps_ahead=4))
    np.testing.assert_array_equal(shard.pull("f", step=1000), np.ones(2, np.float32))  # never steps
    values = np.full((50, DIM), 3.0, np.float32)
    shard.assign("emb", values, np.arange(50))  # the driver's import: not a request to bound
    np.testing.assert_array_equal(shard.pull("emb", np.arange(50)), values)


# -- item 4: the NaN/Inf guard checks the value as the table stores it ----------------------------
@pytest.mark.parametrize(
    "table_dtype, grad_dtype, value",
    [
        ("float32", "float64", 1e39),  # finite in float64, inf in float32 (was written as -inf)
        ("float16", "float32", 7e4),  # float16's largest finite value is 65504
        ("float16", "float64", -1e5),
    ],
)
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_gradient_that_overflows_the_table_dtype_is_refused(table_dtype, grad_dtype, value, kind):
    assert abs(value) > float(np.finfo(table_dtype).max) and np.isfinite(np.array(value, grad_dtype))
    spec = TableSpec(
        name="t",
        kind=kind,
        shape=[5, 2],
        dtype=table_dtype,
        initializer=ONE,
        optimizer=SGD,
    )
    shard = Shard([spec])
    ids = np.array([1, 3]) if kind == "sparse" else None
    grad = np.full((2, 2) if ids is not None else (5, 2), value, grad_dtype)
    for op in (shard.push, shard.assign):
        with pytest.raises(PSError, match="NaN or Inf; rejected"):
            op("t", grad, *(() if ids is None else (ids,)))
    got = shard.pull("t", *(() if ids is None else (np.arange(5),)))
    np.testing.assert_array_equal(got, np.ones((5, 2), table_dtype))
    shard.push("t", grad / value, *(() if ids is None else (ids,)))  # a representable one still goes in
    assert np.isfinite(shard.pull("t", *(() if ids is None else (np.arange(5),)))).all()


# -- item 5: keys, admin requests, checkpoint root, replays ---------------------------------------
@pytest.fixture(scope="module")
def async_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    with Servers(SPECS, mode="async", checkpoint_root=root / "ckpts") as s:
        yield s, root


def test_servers_have_a_random_secret_by_default(async_server):
    servers, _ = async_server
    assert len(servers.secret) == 32 and len(servers.admin_secret) == 32
    assert servers.secret != servers.admin_secret
    with pytest.raises(PSError, match="authentication failed"):
        PSClient(servers.endpoints, timeout=5)
    with Servers(SPECS) as other:
        assert other.secret != servers.secret


def test_admin_requests_need_the_admin_key(async_server, tmp_path):
    servers, root = async_server
    with PSClient(servers.endpoints, secret=servers.secret, timeout=10) as trainer:
        for call in (
            lambda: trainer.assign("w", np.zeros((3, 2), np.float32)),
            lambda: trainer.save(root / "ckpts" / "a"),
            lambda: trainer.load(root / "ckpts" / "a"),
        ):
            with pytest.raises(PSError, match="admin request: only the driver"):
                call()
        raw = Raw(servers, cid="shutdown-try")
        reply = raw.ask(raw.sign({"op": "shutdown"}))
        raw.close()
        assert reply["ok"] is False and "admin request" in reply["error"]
        assert all(p.is_alive() for p in servers.processes)
        np.testing.assert_array_equal(trainer.pull("w"), np.ones((3, 2), np.float32))


def test_save_and_load_stay_inside_the_checkpoint_root(async_server, tmp_path):
    servers, root = async_server
    with servers.client(timeout=10) as admin:
        admin.save(root / "ckpts" / "good")  # inside the root: fine
        assert (root / "ckpts" / "good" / "manifest.json").is_file()
        admin.load(root / "ckpts" / "good")
        for bad in (tmp_path / "elsewhere", root / "ckpts" / ".." / "escape"):
            with pytest.raises(PSError, match="outside the checkpoint root"):
                admin.save(bad)
            assert not bad.exists() or not any(p.name.endswith(".npz") for p in bad.rglob("*"))
        os.symlink(tmp_path, root / "ckpts" / "link")
        with pytest.raises(PSError, match="outside the checkpoint root"):
            admin.load(root / "ckpts" / "link")
    with Servers(SPECS) as no_root, no_root.client(timeout=10) as admin:
        with pytest.raises(PSError, match="started without a checkpoint root"):
            admin.save(tmp_path / "x")


def test_a_captured_signed_push_replayed_three_times_is_refused(async_server):
    servers, _ = async_server
    with PSClient(servers.endpoints, secret=servers.secret, timeout=10) as c:
        sent = []
        sock = c._socks[0]
        real_send = sock.send_multipart
        sock.send_multipart = lambda frames, **kw: (
            sent.append([bytes(f) for f in frames]),
            real_send(frames, **kw),
        )[1]
        g = np.array([[0.5, 1.0, 1.5, 2.0]], np.float32)
        c.push("emb", g, np.array([12345]))
        sock.send_multipart = real_send
        (captured,) = sent
        raw = Raw(servers, cid="attacker")
        for _ in range(3):
            reply = raw.ask(captured)
            assert reply["ok"] is False and "replayed or reordered" in reply["error"]
        raw.close()
        np.testing.assert_array_equal(c.pull("emb", np.array([12345])), 1.0 - LR * g)  # applied once


def test_a_reordered_message_is_refused(async_server):
    servers, _ = async_server
    raw = Raw(servers, cid="reorder")
    later = raw.sign({"op": "stats"})
    earlier_seq = raw.seq
    raw.seq = earlier_seq + 5
    first = raw.ask(raw.sign({"op": "stats"}))
    assert first["ok"] is True
    reply = raw.ask(later)  # sequence number below the last one accepted
    raw.close()
    assert reply["ok"] is False and "replayed or reordered" in reply["error"]


def test_a_request_captured_on_its_way_to_one_shard_is_refused_by_another():
    with Servers(SPECS, num_shards=2) as servers, servers.client(timeout=10) as c:
        sent: dict[int, list] = {0: [], 1: []}
        for k, sock in enumerate(c._socks):
            real = sock.send_multipart
            sock.send_multipart = lambda frames, k=k, real=real, **kw: (
                sent[k].append([bytes(f) for f in frames]),
                real(frames, **kw),
            )[1]
        ids = np.arange(40)
        c.push("emb", np.full((40, DIM), 0.5, np.float32), ids)  # a sparse push goes to both shards
        raw = Raw(servers, cid="cross")
        reply = raw.ask(sent[1][-1])  # shard 1's part (sent after shard 0's: a newer number) to shard 0
        raw.close()
        assert reply["ok"] is False and "addressed to shard 1, this is shard 0" in reply["error"]
        with PSClient(servers.endpoints, secret=servers.secret) as check:
            assert [s["emb"]["rows"] for s in check.stats()] == [
                len(sent[0][-1][1]) // 8,
                40 - len(sent[0][-1][1]) // 8,
            ]
            np.testing.assert_array_equal(
                check.pull("emb", ids), np.full((40, DIM), 1.0 - LR * 0.5, np.float32)
            )
