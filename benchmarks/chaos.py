"""Fault matrix: what hetps does when its processes are killed or paused, its disk fills up, a peer
sends hostile messages, or 16 clients hammer one server; prints one table.

Rows (issue 11):
- SIGKILL / SIGSTOP of a trainer (gpu:0), of a server shard (ps:0) and of the driver, SIGTERM of the
  driver: a real `train` run (Wide&Deep, local engine, 2 cpu + 1 emulated gpu trainers, 2 shards)
  driven from a child process (this script with `--driver`), the fault sent at step 2. Measured: the
  time from the fault to the driver's error (driver faults: to the last child's exit), the process
  the error names, processes of the run still alive 2 s after the driver ended (10 s after a driver
  fault) and whether the run directory (/tmp/hetps-run-*) was left. A paused driver is resumed
  after 3 s: the run must then finish.
- full disk: a 1 MiB tmpfs holds a checkpoint; a bigger save there must fail and leave the old
  one loadable with its values (needs root to mount; skipped otherwise).
- hostile messages, each sent through a raw ZeroMQ socket to a running sync shard (default limits,
  but max_message_bytes=16 MiB to spare memory): time to its error reply; afterwards the shard must
  be alive and a pull must give the exact expected values.
- hostile messages to a run's trainers and driver: junk, unsigned and wrongly signed messages, sent
  to every trainer's and the driver's inbox while a sync run trains; it must finish with the losses
  of the same run undisturbed (replays are refused too: tests/test_channels_hostile.py).
- faults during a pause: ps:0 SIGKILLed or SIGSTOPped just before the driver's checkpoint or
  evaluation pause at step 4 (a small sync run, in this process): time from the fault to the error
  and what it names.
- start-up failures: a dense table larger than the machine's memory (the shard refuses to start),
  a plan whose optimizer the servers do not know (verify refuses it).
- insiders: requests signed with one trainer's own key (cpu:1) against another's rights — a hold of
  gpu:0's table, cpu:0's sender id with a huge sequence number, a sync push as pusher cpu:0, 4 200
  hellos and then a captured push replayed — and fresh ids into an unbounded table past the
  shard's memory cap; the legitimate clients' values must stay exact.
- insiders at an inbox: cpu:1, holding only its own link key to the driver, sends the driver's
  inbox a message with cpu:0's sender id and a huge sequence number, then 5 000 fresh ids of its own
  and one of them replayed; cpu:0 must still be heard.
- memory before authentication: 3 frames of `--frame-mb` MB each from a peer without a key: the
  shard's peak memory growth; 120 x 10 MB messages on tcp from peers without a key to a driver's
  inbox that reads nothing meanwhile: its process's peak memory growth.
- load: 16 client threads pull and push for `--load-seconds` against one async shard; the final
  values must equal the count of pushes, exactly (gradients are powers of two).
- finish (`max_restarts`): rows where the run must *finish*. A sync run (Wide&Deep, 2 cpu + 1
  emulated gpu trainers, 2 shards, `--finish-steps` steps, a checkpoint every quarter of them) in
  this process, with `max_restarts=3`: cpu:0, gpu:0 and ps:0 each SIGKILLed once and three times at
  fixed steps, cpu:0 SIGSTOPped (left stopped: the engine names it after a second, the restart
  kills it), and on a two-node `ray.cluster_utils.Cluster` the second node removed (a cpu trainer
  on it; `min_trainers={"cpu": 1}`). Measured: completed, restarts, steps and seconds trained
  again, wall time against the uninterrupted run measured first, the final loss and the largest
  parameter difference against it, processes and run directories left.

Anything the script started is killed at the end of its row (leftovers are counted first).

    python benchmarks/chaos.py                      # all rows, about 3 minutes on 2 cores
    python benchmarks/chaos.py --only hostile,load  # some groups: process, disk, hostile, pause,
                                                    # startup, insider, memauth, load
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq  # noqa: E402

from runtime.ps import Limits, PSClient, PSError, Servers  # noqa: E402
from runtime.transport import zap  # noqa: E402
from runtime.transport.channels import Inbox, Links, Outbox  # noqa: E402
from runtime.transport.wire import AuthError, client_key, decode, encode, header_frame, link_key, sign  # noqa: E402
from transpiler.tables import TableSpec  # noqa: E402

STALL_S = 8.0  # the driver's stall_timeout in the process rows (SIGSTOP rows wait for it)
FINISH_STALL_S = 120.0  # the finish rows' stall_timeout (generous: the runs start several times)
EXACT = 2.0**-10  # gradients of this size sum exactly in float32
ONE = {"type": "constant", "value": 1.0}
SGD = {"type": "sgd", "lr": 1.0}


@dataclass
class Row:
    fault: str
    time_to_error: str = "-"
    named: str = "-"
    left: str = "-"
    lost: str = "-"
    exact: str = "-"


# -- processes -----------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """True for a process that exists and is not a zombie (its parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def _last_line(text: str) -> str:
    """The gist of an error: a traceback's last line (the exception), else the first line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    return (lines[-1] if any(ln.startswith("Traceback") for ln in lines) else lines[0])[:90]


def driver_main(handshake: str, result: str, steps: int) -> None:
    """The driver of one process row: trains, tells its pids at step 2, writes how the run ended."""
    from runtime import TrainingError, train
    from runtime.data import SyntheticCTR
    from runtime.engines import LocalEngine
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    eng, told = LocalEngine(), []

    def tell(record: dict) -> None:
        if record["step"] == 2 and not told:
            info = {"pids": eng.pids(), "run_dir": eng.tmp, "driver": os.getpid()}
            Path(handshake + ".tmp").write_text(json.dumps(info))
            os.replace(handshake + ".tmp", handshake)
            told.append(1)

    out: dict = {"ok": True}
    try:
        h = train(
            wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.1)).main,
            SyntheticCTR(vocab=1000),
            steps=steps,
            batch_size=128,
            trainers={"cpu": 2, "gpu": 1},
            servers=2,
            engine=eng,
            allow_emulation=True,
            callback=tell,
            stall_timeout=STALL_S,
            progress=False,
        )
        out["steps"] = h.steps
    except TrainingError as e:
        out = {"ok": False, "who": e.who, "detail": e.detail}
    except BaseException as e:  # noqa: BLE001 (any ending is a result here)
        out = {"ok": False, "who": "?", "detail": f"{type(e).__name__}: {e}"}
    out["t"] = time.time()
    Path(result).write_text(json.dumps(out))


def process_row(victim: str, sig: signal.Signals, tmp: Path) -> Row:
    row = Row(f"{sig.name} {victim}")
    hs, res = tmp / f"hs-{victim}-{sig.name}", tmp / f"res-{victim}-{sig.name}"
    steps = 40 if sig == signal.SIGSTOP and victim == "driver" else 100_000
    log = tmp / f"driver-{victim}-{sig.name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--driver", str(hs), str(res), str(steps)],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    pids: list[int] = []
    info: dict = {}
    try:
        deadline = time.monotonic() + 180
        while not hs.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                why = json.loads(res.read_text())["detail"] if res.exists() else log.read_text()
                print(f"{row.fault}: the run ended before step 2:\n{why}", file=sys.stderr)
                row.named = f"run ended before the fault: {_last_line(why)}"
                return row
            time.sleep(0.1)
        info = json.loads(hs.read_text())
        pids = [p for p in info["pids"].values() if p]
        target = info["driver"] if victim == "driver" else info["pids"][victim]
        t0 = time.time()
        os.kill(target, sig)
        if victim == "driver" and sig == signal.SIGSTOP:
            time.sleep(3)
            os.kill(target, signal.SIGCONT)
        if victim == "driver" and sig != signal.SIGSTOP:
            end = time.monotonic() + 10
            while any(_alive(p) for p in pids) and time.monotonic() < end:
                time.sleep(0.05)
            still = [p for p in pids if _alive(p)]
            row.time_to_error = f"{time.time() - t0:.1f} s (children gone)" if not still else "> 10 s"
            row.left = f"{len(still)} of {len(pids)}"
            row.named = "(driver gone)"
            try:
                code = proc.wait(10)
            except subprocess.TimeoutExpired:
                code = None
            if sig == signal.SIGTERM:
                row.named = f"driver exit code {code}"
        else:
            try:
                proc.wait(STALL_S + 120)
            except subprocess.TimeoutExpired:
                row.named = "driver hung"
                return row
            time.sleep(2)
            out = (
                json.loads(res.read_text())
                if res.exists()
                else {"ok": False, "who": "?", "detail": "no result"}
            )
            if out["ok"]:
                row.time_to_error = f"none: finished {out.get('steps')} of {steps} steps"
                row.named = "-"
            else:
                row.time_to_error = f"{out['t'] - t0:.1f} s"
                row.named = f"{out['who']}: {_last_line(out['detail'])}"
            row.left = f"{sum(_alive(p) for p in pids)} of {len(pids)}"
        end = time.monotonic() + 2  # the janitor removes a dead driver's run directory (polls at 0.1 s)
        while info["run_dir"] and os.path.exists(info["run_dir"]) and time.monotonic() < end:
            time.sleep(0.05)
        if info["run_dir"] and os.path.exists(info["run_dir"]):
            row.left += " + run dir"
        return row
    finally:
        _kill_all([*pids, proc.pid])
        proc.wait()
        if pids and info.get("run_dir"):
            shutil.rmtree(info["run_dir"], ignore_errors=True)


# -- full disk -------------------------------------------------------------------------------------
def disk_row(tmp: Path) -> Row:
    row = Row("full disk during a checkpoint")
    if os.geteuid() != 0:
        row.named = "skipped: mounting a tmpfs needs root"
        return row
    mnt = tmp / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode != 0:
        row.named = "skipped: cannot mount a tmpfs"
        return row
    specs = [
        TableSpec(
            name="emb",
            kind="sparse",
            shape=[-1, 4],
            dtype="float32",
            initializer=ONE,
            optimizer={"type": "adam", "lr": 0.01},
        )
    ]
    try:
        with Servers(specs, checkpoint_root=mnt) as servers, servers.client() as c:
            ids = np.arange(100)
            c.push("emb", np.ones((100, 4), np.float32), ids)
            c.save(mnt / "ckpt")
            saved = c.pull("emb", ids)
            c.push("emb", np.ones((200_000, 4), np.float32), np.arange(200_000) * 7 + 1000)
            t0 = time.perf_counter()
            try:
                c.save(mnt / "ckpt")
                row.named = "the save did not fail?"
            except PSError as e:
                row.time_to_error = f"{1e3 * (time.perf_counter() - t0):.0f} ms"
                row.named = "save: " + ("No space left on device" if "No space" in str(e) else str(e)[:90])
            stray = [p.name for p in mnt.iterdir() if p.name != "ckpt"]
            row.left = f"{len(stray)} stray dirs"
            c.push("emb", np.ones((100, 4), np.float32), ids)  # then load the old one back
            c.load(mnt / "ckpt")
            same = np.array_equal(c.pull("emb", ids), saved)
            row.lost = "none: previous checkpoint loads" if same else "previous checkpoint LOST"
            row.exact = "yes" if same else "no"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    return row


# -- hostile messages --------------------------------------------------------------------------------
class Raw:
    """A DEALER socket that signs like a client (its own key, a session opened by hello) but sends
    whatever frames it is given."""

    def __init__(self, servers: Servers, cid: str, name: str | None = None, hello: bool = True) -> None:
        self.name = (name or cid)[:60].replace("/", "|")
        self.servers, self.seq, self.sess = servers, 0, None
        self.key = client_key(servers.secret, self.name)
        self.cid = f"{self.name}/raw"
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        zap.credentials(self.sock, self.name, self.key)
        self.sock.connect(servers.endpoints[0])
        if hello:
            self.sess = (self.ask(self.sign({"op": "hello"})) or {}).get("session")

    def sign(self, header: dict, arrays: list = (), **fields) -> list:
        self.seq += 1
        h = {**header, "cid": self.cid, "seq": self.seq, "to": 0, "sess": self.sess, **fields}
        return encode(h, arrays, self.key, self.name)

    def signed_raw(self, header: bytes, *buffers: bytes) -> list:
        return sign([header, *buffers], self.key, self.name)

    def ask(self, frames: list, timeout_s: float = 30) -> dict | None:
        self.sock.send_multipart(frames)
        if not self.sock.poll(timeout_s * 1000):
            return None
        reply = self.sock.recv_multipart()
        try:
            return decode(reply, self.key)[0]
        except AuthError:
            return decode(reply, None)[0]


def _push_hdr(arrays: list) -> bytes:
    """A raw header frame (wire's MessagePack [header, array descriptors]) of a push to "w"."""
    return header_frame({"op": "push", "table": "w"}, arrays)


def _flood_parked(r: Raw, limits: Limits) -> list:
    for _ in range(limits.max_parked):
        r.sock.send_multipart(r.sign({"op": "pull", "table": "w", "step": 1}))
    return r.sign({"op": "pull", "table": "w", "step": 1})


def _flood_future(r: Raw, limits: Limits) -> list:
    g = np.zeros((4, 2), np.float32)
    for k in range(limits.max_buffered // limits.max_steps_ahead):  # (a pusher pushes a step once)
        f = Raw(r.servers, cid=f"f{k}")
        for step in range(1, limits.max_steps_ahead + 1):
            f.sock.send_multipart(f.sign({"op": "push", "table": "w", "step": step, "pusher": f.name}, [g]))
        for _ in range(limits.max_steps_ahead):  # their replies (all accepted)
            f.sock.poll(30_000) and f.sock.recv_multipart()
        f.sock.close()
    return r.sign({"op": "push", "table": "w", "step": 1, "pusher": r.name}, [g])


def hostile_rows() -> list[Row]:
    limits = Limits(max_message_bytes=16 << 20)
    specs = [
        TableSpec(
            name="w",
            kind="dense",
            shape=[4, 2],
            dtype="float32",
            initializer=ONE,
            optimizer=SGD,
        ),
        TableSpec(
            name="emb",
            kind="sparse",
            shape=[-1, 2],
            dtype="float32",
            initializer=ONE,
            optimizer=SGD,
        ),
    ]
    nested = header_frame({"op": "hello", "x": None})[:-2] + b"\x91" * 100_000 + b"\xc0\x90"
    cases = {
        "header nested 100 000 deep": lambda r: r.signed_raw(nested),
        "65 dimensions": lambda r: r.signed_raw(_push_hdr([["<f4", [1] * 65]]), b"\0" * 4),
        "shape [0, 2**63]": lambda r: r.signed_raw(_push_hdr([["<f4", [0, 2**63]]]), b""),
        "17 MiB message": lambda r: r.sign({"op": "push", "table": "w"}, [np.zeros(17 << 18, np.float32)]),
        "header over 1 MiB": lambda r: r.signed_raw(b"\xc0" * ((1 << 20) + 2)),
        f"{limits.max_new_rows + 1} new rows, vocab -1": lambda r: r.sign(
            {"op": "pull", "table": "emb"}, [np.arange(limits.max_new_rows + 1, dtype=np.int64)]
        ),
        f"{limits.max_parked + 1} parked sync pulls": lambda r: _flood_parked(r, limits),
        f"{limits.max_buffered + 1} pushes for future steps": lambda r: _flood_future(r, limits),
        "pull for step 10**18": lambda r: r.sign({"op": "pull", "table": "w", "step": 10**18}),
        "shutdown with the data key": lambda r: r.sign({"op": "shutdown"}),
        "save with the data key": lambda r: r.sign({"op": "save", "dir": "/tmp/x"}),
        "unsigned assign": lambda r: encode(
            {"op": "assign", "table": "w", "cid": "x", "seq": 1}, [np.zeros((4, 2), np.float32)]
        ),
    }
    rows = []
    with (
        Servers(specs, mode="sync", pushes_per_step=2, limits=limits) as servers,
        PSClient(servers.endpoints, secret=servers.secret, timeout=30) as check,
    ):
        for name, make in cases.items():
            r = Raw(servers, cid=name)
            frames = make(r)
            t0 = time.perf_counter()
            reply = r.ask(frames)
            dt = time.perf_counter() - t0
            r.sock.close()
            row = Row(name)
            if reply is None:
                row.named = "NO REPLY"
            else:
                row.time_to_error = f"{1e3 * dt:.0f} ms"
                err = reply.get("error", "accepted!") if not reply.get("ok") else "ACCEPTED"
                row.named = (
                    err.split(": ", 1)[-1][:90]
                    if err.startswith(("malformed", "authentication"))
                    else err[:90]
                )
            alive = all(p.is_alive() for p in servers.processes)
            row.left = "shard alive" if alive else "SHARD DIED"
            exact = alive and np.array_equal(check.pull("w"), np.ones((4, 2), np.float32))
            row.exact = "yes" if exact else "no"
            row.lost = "none" if exact else "?"
            rows.append(row)
        rows.append(replay_row(servers, check))
    return rows


def replay_row(servers: Servers, c: PSClient) -> Row:
    """A signed push captured off the client's socket and replayed 3 times: applied once."""
    row = Row("signed push replayed 3x")
    sock, sent = c._socks[0], []
    real = sock.send_multipart
    sock.send_multipart = lambda frames, **kw: (sent.append([bytes(f) for f in frames]), real(frames, **kw))[
        1
    ]
    g = np.full((1, 2), EXACT, np.float32)
    with PSClient(servers.endpoints, secret=servers.secret, pusher="b") as b:
        c.push("emb", g, np.array([5]), step=0)
        sock.send_multipart = real
        b.push("emb", g, np.array([5]), step=0)
        r = Raw(servers, cid="replayer")
        t0 = time.perf_counter()
        replies = [r.ask(sent[0]) for _ in range(3)]
        row.time_to_error = f"{1e3 * (time.perf_counter() - t0) / 3:.0f} ms"
        r.sock.close()
        refused = sum(1 for h in replies if h and not h["ok"] and "replayed" in h["error"])
        row.named = f"{refused}/3 refused as replays"
        exact = np.array_equal(c.pull("emb", np.array([5])), np.full((1, 2), 1 - 2 * EXACT, np.float32))
    row.left = "shard alive" if all(p.is_alive() for p in servers.processes) else "SHARD DIED"
    row.exact = "yes (one step)" if exact else "no"
    row.lost = "none" if exact else "?"
    return row


def trainer_hostile_row() -> Row:
    """A sync run whose trainers and driver get junk, unsigned and wrongly signed messages (twice
    each, at steps 1 and 3) from a process without a key, through a connection without a login and
    one with a made-up token: it must finish with the losses of the same run undisturbed, each
    trainer counting the logins it refused."""
    from runtime import train
    from runtime.data import SyntheticCTR
    from runtime.engines import LocalEngine
    from transpiler import builder as nn
    from transpiler import transpile
    from transpiler.models import wide_deep

    plan = transpile(wide_deep(vocab=300, dim=8, hidden=(16,), optimizer=nn.SGD(lr=0.05)).main)
    kw = dict(
        steps=60,
        batch_size=64,
        trainers={"cpu": 1, "gpu": 1},
        servers=1,
        mode="sync",
        allow_emulation=True,
        progress=False,
    )
    clean = train(plan, SyntheticCTR(vocab=300, seed=1), engine=LocalEngine(), **kw)
    eng, other = LocalEngine(), os.urandom(32)

    def attack(rec: dict) -> None:
        if rec["step"] not in (1, 3):
            return
        for name in ("cpu:0", "gpu:0", "driver"):
            for login in (None, "cpu:0"):  # no login; a login with a made-up token
                sock = zmq.Context.instance().socket(zmq.PUSH)
                sock.linger, sock.sndtimeo = 1000, 500  # (a refused login leaves nothing to queue in)
                if login is not None:
                    sock.plain_username, sock.plain_password = login.encode(), b"0" * 32
                sock.connect(eng.endpoint(name))
                try:
                    sock.send_multipart([b"junk"])
                    sock.send_multipart(encode({"k": "e", "s": 0, "o": 0, "cid": "x/y", "seq": 1}, []))
                    sock.send_multipart(
                        encode({"k": "e", "s": 0, "o": 0, "cid": "x/y", "seq": rec["step"]}, [], other)
                    )
                except zmq.Again:
                    pass
                sock.close()

    row = Row("junk, unsigned, other-key msgs to trainers + driver")
    try:
        hist = train(plan, SyntheticCTR(vocab=300, seed=1), engine=eng, callback=attack, **kw)
    except Exception as e:  # noqa: BLE001 - the row reports it
        row.named, row.left = f"RUN FAILED: {e}"[:90], "?"
        return row
    row.named = "logins refused " + ", ".join(
        f"{n} {s['refused_connections']}" for n, s in [*hist.trainers.items(), ("driver", vars(hist))]
    )
    row.left = "run finished"
    exact = hist.steps == clean.steps and np.allclose(hist.loss, clean.loss, rtol=1e-6, atol=0)
    row.exact = "yes (losses as undisturbed)" if exact else "no"
    row.lost = "none" if exact else "?"
    return row


# -- faults during a pause, start-up failures ----------------------------------------------------
def _small_run(**kw):
    """A small sync `train` (2 cpu + 1 emulated gpu trainers, 2 shards) of Wide&Deep; kw overrides."""
    from runtime import train
    from runtime.data import SyntheticCTR
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    model = kw.pop("model", None) or wide_deep(vocab=200, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1))
    args = dict(
        steps=50,
        batch_size=32,
        trainers={"cpu": 2, "gpu": 1},
        servers=2,
        mode="sync",
        allow_emulation=True,
        progress=False,
        stall_timeout=60.0,
    )
    return train(model if hasattr(model, "tables") else model.main, SyntheticCTR(vocab=200), **{**args, **kw})


def pause_row(sig: signal.Signals, pause: str, tmp: Path) -> Row:
    """ps:0 gets `sig` just before the driver's pause at step 4 (a checkpoint or an evaluation)."""
    from runtime import TrainingError
    from runtime.data import SyntheticCTR
    from runtime.engines import LocalEngine

    row, eng, hit = Row(f"{sig.name} ps:0 during the {pause} pause"), LocalEngine(), []

    def fault(record: dict) -> None:
        if record["step"] == 3 and not hit:
            os.kill(eng.pids()["ps:0"], sig)
            hit.append(time.monotonic())

    extra = (
        {"checkpoint": str(tmp / f"ck-{sig.name}"), "checkpoint_every": 4}
        if pause == "checkpoint"
        else {"eval_data": [SyntheticCTR(vocab=200).batch(10_000, 64)], "eval_every": 4}
    )
    try:
        _small_run(engine=eng, callback=fault, **extra)
        row.named = "the run did not fail?"
    except TrainingError as e:
        row.time_to_error = f"{time.monotonic() - hit[0]:.1f} s"
        row.named = f"{e.who}: {_last_line(e.detail)}"
    pids = [p for p in eng.pids().values() if p]
    row.left = f"{sum(_alive(p) for p in pids)} of {len(pids)}"
    _kill_all(pids)
    return row


def startup_rows() -> list[Row]:
    """A table too large for the shard's memory; a plan whose optimizer the servers do not know."""
    from runtime import TrainingError
    from transpiler import builder as nn
    from transpiler import transpile
    from transpiler.errors import PlanError
    from transpiler.models import wide_deep

    rows = []
    big = wide_deep(vocab=200, dim=4, hidden=(200_000, 100_000), optimizer=nn.SGD(lr=0.1))  # 80 GB
    row, t0 = Row("a dense table larger than memory"), time.monotonic()
    try:
        _small_run(model=big, steps=3)
        row.named = "the run did not fail?"
    except TrainingError as e:
        row.time_to_error = f"{time.monotonic() - t0:.1f} s (start-up included)"
        row.named = f"{e.who}: {_last_line(e.detail)}"
        row.left = "0 (the run was torn down)"
    rows.append(row)
    plan = transpile(wide_deep(vocab=200, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1)).main)
    d = plan.tables[0].to_dict()
    d["optimizer"]["type"] = "lamb"
    plan.tables[0] = TableSpec.from_dict(d)
    row, t0 = Row("an optimizer the servers do not know"), time.monotonic()
    try:
        _small_run(model=plan, steps=3)
        row.named = "the run did not fail?"
    except PlanError as e:
        row.time_to_error = f"{1e3 * (time.monotonic() - t0):.0f} ms (before any process)"
        row.named = str(e).splitlines()[-1].strip(" -")[:90]
        row.left = "0 (none started)"
    rows.append(row)
    return rows


# -- insiders: a process with a key of the run -----------------------------------------------------
W = TableSpec(name="w", kind="dense", shape=[4, 2], dtype="float32", initializer=ONE, optimizer=SGD)
EMB = TableSpec(name="emb", kind="sparse", shape=[-1, 8], dtype="float32", initializer=ONE, optimizer=SGD)


def _insider_row(name: str, attack, check) -> Row:
    row = Row(name)
    t0 = time.perf_counter()
    reply = attack()
    row.time_to_error = f"{1e3 * (time.perf_counter() - t0):.0f} ms"
    if reply is None:
        row.named = "NO REPLY"
    else:
        row.named = "ACCEPTED" if reply.get("ok") else reply["error"].split("refused: ")[-1][:90]
    row.exact = "yes" if check() else "NO"
    row.lost = "none" if row.exact == "yes" else "?"
    return row


def insider_rows() -> list[Row]:
    """Attacks signed with one trainer's own key (cpu:1) against another's (cpu:0, gpu:0) rights."""
    rows = []
    g = np.full((4, 2), EXACT, np.float32)
    with Servers([W, EMB], mode="sync", pushes_per_step=2, holders={"w": "gpu:0"}) as s:
        key = lambda n: client_key(s.secret, n)  # noqa: E731 (what the driver hands each trainer)
        a = PSClient(s.endpoints, client_key=key("cpu:0"), pusher="cpu:0", timeout=30)
        b = PSClient(s.endpoints, client_key=key("cpu:1"), pusher="cpu:1", timeout=30)
        evil = Raw(s, cid="cpu:1")
        hold = evil.sign({"op": "hold", "table": "w"})
        rows.append(_insider_row("hold of gpu:0's table by cpu:1", lambda: evil.ask(hold), lambda: True))
        forged = evil.sign({"op": "stats"}, cid=a._cid, seq=10**15, sess=a._sess[0])
        rows.append(
            _insider_row(
                "cpu:0's id, seq 10**15, by cpu:1",
                lambda: evil.ask(forged),
                lambda: a.stats() is not None,  # cpu:0 is not locked out
            )
        )
        push = evil.sign({"op": "push", "table": "w", "step": 0, "pusher": "cpu:0"}, [g])

        def real_step() -> bool:
            a.push("w", g, step=0)
            b.push("w", g, step=0)
            return np.array_equal(a.pull("w", step=1), np.full((4, 2), 1 - 2 * EXACT, np.float32))

        rows.append(_insider_row("sync push as pusher cpu:0 by cpu:1", lambda: evil.ask(push), real_step))
        sent: list = []
        real = a._socks[0].send_multipart
        a._socks[0].send_multipart = lambda frames, **kw: (
            sent.append([bytes(f) for f in frames]),
            real(frames, **kw),
        )[1]
        a.push("emb", np.full((1, 8), EXACT, np.float32), np.array([3]), step=0)
        a._socks[0].send_multipart = real
        b.push("emb", np.full((1, 8), EXACT, np.float32), np.array([3]), step=0)

        def flood_then_replay() -> dict | None:
            for i in range(4200):
                evil.sock.send_multipart(
                    encode({"op": "hello", "cid": f"cpu:1/{i}", "seq": 0, "to": 0}, (), evil.key, "cpu:1")
                )
            for _ in range(4200):
                evil.sock.poll(30_000) and evil.sock.recv_multipart()
            return evil.ask(sent[0])

        one_step = lambda: np.array_equal(  # noqa: E731
            a.pull("emb", np.array([3]), step=1), np.full((1, 8), 1 - 2 * EXACT, np.float32)
        )
        rows.append(_insider_row("4 200 hellos, then a captured push replayed", flood_then_replay, one_step))
        evil.sock.close()
        a.close()
        b.close()
    with Servers([EMB], limits=Limits(max_memory_bytes=64 << 20)) as s, s.client() as c:
        pid, t0 = s.processes[0].pid, time.perf_counter()
        row = Row("fresh ids into a vocab -1 table, 64 MiB cap")
        try:
            for k in range(1000):
                c.pull("emb", np.arange(100_000) + 100_000 * k)
            row.named = "no cap?"
        except PSError as e:
            row.time_to_error = f"{time.perf_counter() - t0:.1f} s ({k * 100_000} rows served)"
            row.named = str(e).split(": ", 1)[-1][:90]
        row.left = f"shard alive, peak {_peak_rss(pid) / 2**20:.0f} MiB"
        row.exact = (
            "yes" if np.array_equal(c.pull("emb", np.array([5])), np.ones((1, 8), np.float32)) else "NO"
        )
        rows.append(row)
    return rows


# -- insiders at an inbox: a process with a link key of its own ("cpu:1") ----------------------------
def _drain(inbox: Inbox) -> int:
    """Messages `inbox` accepts until one call (waiting up to 0.5 s) neither accepts nor refuses any."""
    heard = 0
    while True:
        refused = inbox.refused
        if inbox.recv(500) is not None:
            heard += 1
        elif inbox.refused == refused:
            return heard


def _raw_inbox_push(ep: str, name: str, key: bytes, messages: list) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.linger, sock.sndhwm = 5000, 0
    zap.credentials(sock, name, key)
    sock.connect(ep)
    for frames in messages:
        sock.send_multipart(frames)
    sock.close()


def inbox_insider_rows(tmp: Path) -> list[Row]:
    """cpu:1, with its own key of its link to the driver, against the driver's inbox: cpu:0's id with
    a huge sequence number, then 5 000 fresh ids of its own and one of its messages replayed."""
    master = os.urandom(32)
    inbox = Inbox(f"ipc://{tmp}/driver", Links.derive(master, "driver", senders=["cpu:0", "cpu:1"]))
    ep, evil = inbox.endpoint, link_key(master, "cpu:1", "driver")
    out = Outbox(Links.derive(master, "cpu:0", {"driver": ep}), shm=False)
    rows = []
    try:
        row, t0 = Row("inbox: cpu:0's id, seq 2**62, by cpu:1"), time.perf_counter()
        _raw_inbox_push(ep, "cpu:1", evil, [encode({"cid": out.cid, "seq": 2**62}, (), evil, "cpu:1")])
        _drain(inbox)
        row.time_to_error = f"{1e3 * (time.perf_counter() - t0):.0f} ms"
        row.named = inbox.last_refused[:90] if inbox.refused == 1 else "ACCEPTED"
        out.send(ep, {"k": "real"})
        row.lost = "none (cpu:0 still heard)" if inbox.recv(5000) is not None else "cpu:0 LOCKED OUT"
        rows.append(row)
        row, t0 = Row("inbox: 5 000 fresh ids by cpu:1, then one replayed"), time.perf_counter()
        ids = [encode({"cid": f"cpu:1/{i}", "seq": 1}, (), evil, "cpu:1") for i in range(5000)]
        _raw_inbox_push(ep, "cpu:1", evil, ids)
        heard = _drain(inbox)
        _raw_inbox_push(ep, "cpu:1", evil, ids[:1])
        replayed = _drain(inbox)
        row.time_to_error = f"{time.perf_counter() - t0:.1f} s"
        row.named = f"{heard} ids heard, the replay {'ACCEPTED' if replayed else 'refused'}"
        out.send(ep, {"k": "real"})
        row.lost = "none (cpu:0 still heard)" if inbox.recv(5000) is not None else "cpu:0 NOT HEARD"
        rows.append(row)
    finally:
        out.close()
        inbox.close()
    return rows


# -- memory before authentication ------------------------------------------------------------------
def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def memauth_row(mb: int) -> Row:
    """3 frames of `mb` MB each (each under ZMQ_MAXMSGSIZE, together over the limit), unsigned,
    from a peer without a key: the shard's peak memory growth."""
    row = Row(f"3 x {mb} MB unsigned frames, no key")
    frame = np.zeros(mb << 20, np.uint8)
    with Servers([W], limits=Limits(max_message_bytes=(mb + mb // 2) << 20)) as s, s.client() as c:
        c.pull("w")
        pid = s.processes[0].pid
        before = _peak_rss(pid)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(s.endpoints[0])
        t0 = time.perf_counter()
        sock.send_multipart([header_frame({"op": "push", "table": "w"}), frame, frame, frame], copy=False)
        replied = sock.poll(3000)
        sock.close()
        row.time_to_error = (
            "refused at connection" if not replied else f"{time.perf_counter() - t0:.1f} s, replied"
        )
        row.named = f"shard peak memory +{(_peak_rss(pid) - before) / 2**20:.1f} MiB"
        row.left = "shard alive" if all(p.is_alive() for p in s.processes) else "SHARD DIED"
        row.exact = "yes" if np.array_equal(c.pull("w"), np.ones((4, 2), np.float32)) else "NO"
        row.lost = "none"
    return row


def _inbox_child(conn, master: bytes) -> None:
    """An inbox on tcp that reads nothing until told, then one message (memauth_inbox_row)."""
    inbox = Inbox("tcp://127.0.0.1:*", Links.derive(master, "driver", senders=["cpu:0"]))
    conn.send(inbox.endpoint)
    conn.recv()
    got = inbox.recv(10_000)
    conn.send((got is not None, inbox.refused_connections))
    inbox.close()


def memauth_inbox_row(count: int = 120, mb: int = 10) -> Row:
    """`count` x `mb` MB messages on tcp from peers without a key (half without a login, half with a
    token of no link) to a driver's inbox that reads nothing meanwhile: its process's peak growth."""
    import multiprocessing as mp

    row, master = Row(f"inbox: {count} x {mb} MB messages on tcp, no key"), os.urandom(32)
    parent, conn = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=_inbox_child, args=(conn, master))
    child.start()
    try:
        ep = parent.recv()
        before, big = _peak_rss(child.pid), np.ones(mb << 20, np.uint8)
        t0 = time.perf_counter()
        for login in (None, "cpu:9"):
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.linger, sock.sndtimeo = 0, 200
            if login is not None:
                sock.plain_username, sock.plain_password = login.encode(), b"0" * 32
            sock.connect(ep)
            for i in range(count // 2):
                try:
                    sock.send_multipart(encode({"cid": "x/y", "seq": i + 1}, [big], None), copy=False)
                except zmq.Again:
                    pass
            time.sleep(1.0)
            sock.close()
        out = Outbox(Links.derive(master, "cpu:0", {"driver": ep}))
        out.send(ep, {"k": "real"})
        parent.send("read")
        heard, refused = parent.recv()
        out.close()
        row.time_to_error = (
            f"refused at connection ({refused} logins refused, {time.perf_counter() - t0:.1f} s)"
        )
        row.named = f"inbox peak memory +{(_peak_rss(child.pid) - before) / 2**20:.1f} MiB"
        row.lost = "none (cpu:0 heard)" if heard else "cpu:0 NOT HEARD"
    finally:
        child.join(15)
        if child.is_alive():
            child.kill()
    row.left = "inbox ended" if child.exitcode == 0 else f"inbox exit {child.exitcode}"
    return row


# -- load --------------------------------------------------------------------------------------------
def load_row(clients: int, seconds: float) -> Row:
    vocab = 1000
    specs = [
        TableSpec(
            name="w",
            kind="dense",
            shape=[64, 16],
            dtype="float32",
            initializer=ONE,
            optimizer=SGD,
        ),
        TableSpec(
            name="emb",
            kind="sparse",
            shape=[vocab, 8],
            dtype="float32",
            initializer=ONE,
            optimizer=SGD,
        ),
    ]
    counts = np.zeros(vocab, np.int64)
    dense_pushes, lat, errors = [0], [], []
    lock = threading.Lock()

    def work(i: int) -> None:
        rng = np.random.default_rng(i)
        mine, n_dense, my_lat = np.zeros(vocab, np.int64), 0, []
        try:
            with PSClient(servers.endpoints, secret=servers.secret, pusher=i, timeout=60) as c:
                while time.perf_counter() < stop:
                    ids = np.unique(rng.integers(0, vocab, 64))
                    t = time.perf_counter()
                    c.pull("emb", ids)
                    my_lat.append(time.perf_counter() - t)
                    c.push("emb", np.full((ids.size, 8), EXACT, np.float32), ids)
                    mine[ids] += 1
                    c.push("w", np.full((64, 16), EXACT, np.float32))
                    n_dense += 1
        except Exception as e:  # noqa: BLE001 (reported in the table)
            errors.append(f"client {i}: {e}")
        with lock:
            counts[:] += mine
            dense_pushes[0] += n_dense
            lat.extend(my_lat)

    with Servers(specs, mode="async") as servers:
        stop = time.perf_counter() + seconds
        threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with PSClient(servers.endpoints, secret=servers.secret) as c:
            emb, w = c.pull("emb", np.arange(vocab)), c.pull("w")
        alive = all(p.is_alive() for p in servers.processes)
    pushes = 2 * dense_pushes[0]  # one sparse and one dense push per round
    exact = np.array_equal(
        emb, np.repeat((1 - counts * EXACT)[:, None], 8, 1).astype(np.float32)
    ) and np.array_equal(w, np.full((64, 16), 1 - dense_pushes[0] * EXACT, np.float32))
    p99 = 1e3 * float(np.percentile(lat, 99)) if lat else float("nan")
    return Row(
        f"{clients} clients x {seconds:g} s",
        time_to_error=f"no error ({pushes} pushes)" if not errors else f"{len(errors)} errors",
        named=errors[0][:90] if errors else f"p99 pull {p99:.1f} ms",
        left="shard alive" if alive else "SHARD DIED",
        lost="none" if exact else "?",
        exact="yes" if exact else "NO",
    )


# -- must finish (max_restarts) -------------------------------------------------------------------
@dataclass
class FinishRow:
    fault: str
    completed: str = "no"
    restarts: str = "-"
    steps_lost: str = "-"
    seconds_lost: str = "-"
    wall: str = "-"
    final_loss: str = "-"
    params: str = "-"
    left: str = "-"


def _finish_run(steps: int, tmp: Path, faults: dict[int, tuple[str, signal.Signals]], name: str) -> dict:
    """One sync run with `max_restarts=3`, `faults` {step: (process, signal)} sent from its step
    callback; what happened, as a dict."""
    from runtime import TrainingError, train
    from runtime.data import SyntheticCTR
    from runtime.engines import LocalEngine
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    eng, pending, seen, dirs = LocalEngine(), dict(faults), set(), set()

    def hook(record: dict) -> None:
        seen.update(p for p in eng.pids().values() if p)
        dirs.add(eng.tmp)
        fault = pending.pop(record["step"], None)
        if fault is not None:
            os.kill(eng.pids()[fault[0]], fault[1])

    t0, out = time.perf_counter(), {}
    try:
        h = train(
            wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.1)).main,
            SyntheticCTR(vocab=1000),
            steps=steps,
            batch_size=128,
            trainers={"cpu": 2, "gpu": 1},
            servers=2,
            mode="sync",
            engine=eng,
            allow_emulation=True,
            callback=hook,
            checkpoint=str(tmp / f"ckpt-{name}"),
            checkpoint_every=max(1, steps // 4),
            max_restarts=3,
            return_params=True,
            progress=False,
            stall_timeout=FINISH_STALL_S,
        )
        out = {"ok": True, "history": h}
    except TrainingError as e:
        out = {
            "ok": False,
            "error": f"{e.who}: {_last_line(e.detail)}",
            "history": getattr(e, "history", None),
        }
    out["wall"] = time.perf_counter() - t0
    time.sleep(1)
    out["left"] = sum(_alive(p) for p in seen)
    out["dirs"] = sum(bool(d) and os.path.exists(d) for d in dirs)
    _kill_all(list(seen))
    return out


def ray_node_main(steps: int) -> dict:
    """The Ray row's run, in a child process (one Ray cluster per driver process): a two-node
    cluster, one cpu trainer on the second node, which is removed at step steps // 3."""
    import ray
    from ray.cluster_utils import Cluster

    from runtime import train
    from runtime.data import SyntheticCTR
    from runtime.engines import RayEngine
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=3,
            resources={"head": 1, "gpu_trainer": 1, "cpu_slot": 1},
            object_store_memory=80 << 20,
            include_dashboard=False,
            _system_config={"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        ),
    )
    try:
        second = cluster.add_node(num_cpus=1, resources={"cpu_slot": 1}, object_store_memory=80 << 20)
        ray.init(address=cluster.address, log_to_driver=False)
        eng = RayEngine(
            cluster.address, gpu_resource="gpu_trainer", resources={"ps": {"head": 1}, "cpu": {"cpu_slot": 1}}
        )
        seen: set[int] = set()

        def hook(record: dict) -> None:
            seen.update(p for p in eng.pids().values() if p)
            if record["step"] == steps // 3 and not getattr(hook, "done", False):
                hook.done = True
                cluster.remove_node(second, allow_graceful=False)

        t0 = time.perf_counter()
        h = train(
            wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.1)).main,
            SyntheticCTR(vocab=1000),
            steps=steps,
            batch_size=128,
            trainers={"cpu": 2, "gpu": 1},
            servers=1,
            mode="sync",
            engine=eng,
            allow_emulation=True,
            callback=hook,
            checkpoint=tempfile.mkdtemp(prefix="hetps-chaos-ray-"),
            checkpoint_every=max(1, steps // 4),
            max_restarts=3,
            min_trainers={"cpu": 1},
            progress=False,
            stall_timeout=FINISH_STALL_S,
        )
        wall = time.perf_counter() - t0
        time.sleep(1)
        return {
            "steps": h.steps,
            "loss": h.loss,
            "wall": wall,
            "restarts": [r.__dict__ for r in h.restarts],
            "left": sum(_alive(p) for p in seen),
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def _finish_row(fault: str, got: dict, ref, steps: int) -> FinishRow:
    row, h = FinishRow(fault), got.get("history")
    row.left = f"{got['left']} processes, {got['dirs']} run dirs"
    if h is None:
        row.completed = f"no: {got.get('error', '?')}"
        return row
    row.completed = "yes" if got["ok"] and h.steps == steps else f"no: {got.get('error', '?')}"
    row.restarts = f"{len(h.restarts)}" + (
        f" ({', '.join(r.culprit for r in h.restarts)})" if h.restarts else ""
    )
    row.steps_lost = str(sum(r.steps_lost for r in h.restarts))
    row.seconds_lost = f"{sum(r.seconds_lost for r in h.restarts):.1f}"
    row.wall = f"{got['wall']:.1f} s ({got['wall'] / ref['wall']:.2f}x)"
    if got["ok"]:
        want = ref["history"]
        row.final_loss = f"{h.loss[-1]:.6f} vs {want.loss[-1]:.6f}"
        diff = max(float(np.max(np.abs(h.params[k] - v))) for k, v in want.params.items())
        row.params = f"{diff:.1e}"
    return row


def finish_rows(steps: int, tmp: Path) -> list[FinishRow]:
    ref = _finish_run(steps, tmp, {}, "ref")
    rows = [_finish_row("none (the uninterrupted run)", ref, ref, steps)]
    once, thrice = {steps * 3 // 8: 0}, {steps // 5: 0, steps // 2: 0, steps * 4 // 5: 0}
    for victim in ("cpu:0", "gpu:0", "ps:0"):
        for at, times in ((once, "1x"), (thrice, "3x")):
            faults = {s: (victim, signal.SIGKILL) for s in at}
            got = _finish_run(steps, tmp, faults, f"{victim}-{times}".replace(":", ""))
            rows.append(_finish_row(f"SIGKILL {victim} {times}", got, ref, steps))
            print(f"  {rows[-1].fault}: done", file=sys.stderr)
    got = _finish_run(steps, tmp, {steps // 2: ("cpu:0", signal.SIGSTOP)}, "stop")
    rows.append(_finish_row("SIGSTOP cpu:0 (left stopped)", got, ref, steps))
    rows.append(_ray_node_row(steps, ref))
    return rows


def _ray_node_row(steps: int, ref: dict) -> FinishRow:
    row = FinishRow("remove a Ray node (cpu:1 on it)")
    try:
        import ray  # noqa: F401
    except ImportError:
        row.completed = "skipped: no ray"
        return row
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env["RAY_TMPDIR"] = tmp = tempfile.mkdtemp(prefix="hetps-chaos-ray-")
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--ray-node", str(steps)],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
    except subprocess.TimeoutExpired:
        row.completed = "no: timed out after 900 s"
        return row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        row.completed = f"no: {_last_line(proc.stderr)}"
        return row
    out = json.loads(lines[-1][len("RESULT ") :])
    rs = out["restarts"]
    row.completed = "yes" if out["steps"] == steps else "no"
    row.restarts = (
        f"{len(rs)} ({', '.join(r['culprit'] for r in rs)}; then {rs[-1]['trainers'] if rs else '-'})"
    )
    row.steps_lost = str(sum(r["steps_lost"] for r in rs))
    row.seconds_lost = f"{sum(r['seconds_lost'] for r in rs):.1f}"
    row.wall = f"{out['wall']:.1f} s (Ray start-up incl.)"
    row.final_loss = f"{out['loss'][-1]:.6f} vs {ref['history'].loss[-1]:.6f}"
    row.params = "(fewer readers: same batches)"
    row.left = f"{out['left']} processes"
    return row


def print_finish_table(rows: list[FinishRow]) -> None:
    cols = [
        ("fault", "fault (max_restarts=3)"),
        ("completed", "completed"),
        ("restarts", "restarts"),
        ("steps_lost", "steps lost"),
        ("seconds_lost", "s lost"),
        ("wall", "wall (vs uninterrupted)"),
        ("final_loss", "final loss vs uninterrupted"),
        ("params", "max param diff"),
        ("left", "left behind"),
    ]
    width = {k: max(len(title), *(len(getattr(r, k)) for r in rows)) for k, title in cols}
    print("| " + " | ".join(title.ljust(width[k]) for k, title in cols) + " |")
    print("|" + "|".join("-" * (width[k] + 2) for k, _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(getattr(r, k).ljust(width[k]) for k, _ in cols) + " |")


# -- main --------------------------------------------------------------------------------------------
def print_table(rows: list[Row]) -> None:
    cols = [
        ("fault", "fault"),
        ("time_to_error", "time to the error"),
        ("named", "who / what is named"),
        ("left", "processes left"),
        ("lost", "data lost"),
        ("exact", "sums exact"),
    ]
    width = {k: max(len(title), *(len(getattr(r, k)) for r in rows)) for k, title in cols}
    print("| " + " | ".join(title.ljust(width[k]) for k, title in cols) + " |")
    print("|" + "|".join("-" * (width[k] + 2) for k, _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(getattr(r, k).ljust(width[k]) for k, _ in cols) + " |")


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only",
        default="process,disk,hostile,pause,startup,insider,memauth,load",
        help="groups to run, comma-separated (default: all)",
    )
    ap.add_argument("--frame-mb", type=int, default=200, help="frame size of the memauth row")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--load-seconds", type=float, default=5.0)
    ap.add_argument("--finish-steps", type=int, default=40)
    ap.add_argument("--driver", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--ray-node", nargs=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.driver:
        driver_main(args.driver[0], args.driver[1], int(args.driver[2]))
        return []
    if args.ray_node:
        print("RESULT " + json.dumps(ray_node_main(int(args.ray_node[0]))), flush=True)
        return []
    groups = set(args.only.split(","))
    rows: list[Row] = []
    tmp = Path(tempfile.mkdtemp(prefix="hetps-chaos-"))
    t_start = time.perf_counter()
    try:
        if "process" in groups:
            for victim in ("gpu:0", "ps:0", "driver"):
                for sig in (signal.SIGKILL, signal.SIGSTOP):
                    rows.append(process_row(victim, sig, tmp))
                    print(f"  {rows[-1].fault}: done", file=sys.stderr)
            rows.append(process_row("driver", signal.SIGTERM, tmp))
        if "disk" in groups:
            rows.append(disk_row(tmp))
        if "hostile" in groups:
            rows += hostile_rows()
            rows.append(trainer_hostile_row())
        if "pause" in groups:
            for sig, pause in (
                (signal.SIGKILL, "checkpoint"),
                (signal.SIGSTOP, "checkpoint"),
                (signal.SIGKILL, "evaluation"),
            ):
                rows.append(pause_row(sig, pause, tmp))
        if "startup" in groups:
            rows += startup_rows()
        if "insider" in groups:
            rows += insider_rows()
            rows += inbox_insider_rows(tmp)
        if "memauth" in groups:
            rows.append(memauth_row(args.frame_mb))
            rows.append(memauth_inbox_row())
        if "load" in groups:
            rows.append(load_row(args.clients, args.load_seconds))
        if "finish" in groups:
            finish = finish_rows(args.finish_steps, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if "finish" in groups:
        print_finish_table(finish)
        if rows:
            print()
    if rows:
        print_table(rows)
    print(f"\n{len(rows)} rows in {time.perf_counter() - t_start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
