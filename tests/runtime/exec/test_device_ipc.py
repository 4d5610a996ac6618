"""Boundary tensors between two gpu trainer types on one device go device to device (CUDA IPC,
runtime/trainer/ipc.py), on `fake_cupy` (tests/fake_cupy.py), whose IPC buffers and interprocess
events are files shared between the trainer processes.

This checks hetps's logic (which tensors cross the host, which go device to device, that the
receiver waits for the sender's event and hands the buffers back, that a missing release fails
naming the peer), not CUDA: the real cupy calls are unverified without a GPU."""

from __future__ import annotations

import multiprocessing as mp

import fake_cupy
import numpy as np
import pytest
from test_fake_device import RUN, data, model
from test_runtime_train import assert_same_params, single_process

from runtime import train
from runtime.trainer.ipc import SLOTS, IpcReceiver, IpcSender, device_key
from transpiler import TranspileConfig, transpile
from transpiler.config import kind_of

TWO_GPUS = TranspileConfig(
    trainer_types=["cpu", "gpu", "gpu2"],
    category_map={"io": "cpu", "sparse": "cpu", "dense": "gpu", "loss": "gpu2"},
)
TRAINERS = {"cpu": 1, "gpu": 1, "gpu2": 1}


@pytest.fixture
def fake_ipc(monkeypatch, tmp_path):
    """The stand-in for trainer processes, its counts kept per process in tmp_path/counts, its IPC
    buffers in tmp_path/ipc."""
    for d in ("counts", "ipc"):
        (tmp_path / d).mkdir()
    monkeypatch.setenv("HETPS_FAKE_CUPY", "fake_cupy")
    monkeypatch.setenv("HETPS_FAKE_CUPY_COUNTS", str(tmp_path / "counts"))
    monkeypatch.setenv("HETPS_FAKE_CUPY_IPC", str(tmp_path / "ipc"))
    fake_cupy.COUNTS.reset()
    return tmp_path


def _expected(plan, ipc: bool, items: int, rows: int) -> dict[str, dict[str, int]]:
    """Per gpu type and step, from the sub-programs alone: each tensor received from a cpu type
    (or, without `ipc`, from any type) is one copy to the device, each sent one off it, the loss
    type's report one more off it (its loss, scores and labels); tensors between the two gpu
    types are device-to-device copies on the receiving side, `ipc` or not none of the host's."""
    want = {}
    for t, prog in plan.programs.items():
        if kind_of(t) != "gpu":
            continue

        def nbytes(name: str, prog=prog) -> int:
            var = prog.vars[name]
            return rows * int(np.prod([d for d in var.shape if d != -1])) * np.dtype(var.dtype).itemsize

        comm = [
            (op.type, op.attrs["tensor"], op.attrs.get("src") or op.attrs["dst"])
            for op in prog.ops
            if op.type in ("send", "recv")
        ]
        d2d = [n for kind, n, peer in comm if kind == "recv" and ipc and kind_of(peer) == "gpu"]
        h2d = [n for kind, n, peer in comm if kind == "recv" and n not in d2d]
        d2h = [n for kind, n, peer in comm if kind == "send" and not (ipc and kind_of(peer) == "gpu")]
        report = (
            [(1 + 2 * rows) * 4] if "sigmoid_cross_entropy_with_logits" in {o.type for o in prog.ops} else []
        )
        want[t] = {
            "h2d": items * len(h2d),
            "h2d_bytes": items * sum(map(nbytes, h2d)),
            "d2h": items * (len(d2h) + len(report)),
            "d2h_bytes": items * (sum(map(nbytes, d2h)) + sum(report)),
            "d2d_ipc": items * len(d2d),
            "d2d_ipc_bytes": items * sum(map(nbytes, d2d)),
        }
    return want


def _runs(tmp_path) -> tuple[dict, dict, dict]:
    """Per-step counts of runs of 3 and 5 steps (their difference over 2: the run's start and end
    cancel) of the stand-in, per gpu trainer process (as sorted tuples), and hetps's own; the
    5-step run's parameters."""
    m, plan = model(), transpile(model().main, TWO_GPUS)
    fields = ("h2d", "h2d_bytes", "d2h", "d2h_bytes", "d2d_ipc", "d2d_ipc_bytes")
    stand_in, ours = {}, {}
    for steps in (3, 5):
        run = {**RUN, "trainers": TRAINERS}
        hist = train(plan, data(), steps=steps, mode="sync", micro_batches=2, return_params=True, **run)
        counts = fake_cupy.read_counts(tmp_path / "counts").values()
        stand_in[steps] = sorted(tuple(getattr(c, f) for f in fields) for c in counts)
        ours[steps] = {t: hist.trainers[f"{t}:0"] for t in ("gpu", "gpu2")}
        for f in (tmp_path / "counts").glob("*.counts"):
            f.unlink()
    per_step = [
        tuple((b - a) / 2 for a, b in zip(x, y, strict=True)) for x, y in zip(*stand_in.values(), strict=True)
    ]
    want = single_process(m, [data().batch(t, 64) for t in range(5)])
    assert_same_params(hist.params, want, [t.name for t in plan.tables])
    return dict(zip(fields, zip(*per_step, strict=True), strict=True)), ours, plan


@pytest.mark.parametrize("where", ["one device", "two devices", "no ipc"])
def test_two_gpu_types_train_as_one_process_and_cross_the_host_only_off_one_device(
    fake_ipc, monkeypatch, where
):
    """Sync training of a program whose MLP is on `gpu` and loss on `gpu2`: the same parameters as
    one process (numpy); per step the stand-in's counts in each gpu process, and hetps's own, equal
    what the sub-programs say: on one device the logits and their gradient between the two go
    device to device (0 host crossings for them, their bytes counted as d2d), on two devices or
    without IPC (no shared folder: ipcGetMemHandle fails) they cross the host as before."""
    if where == "two devices":
        monkeypatch.setenv("HETPS_FAKE_CUPY_UUID", "per-process")
    if where == "no ipc":
        monkeypatch.delenv("HETPS_FAKE_CUPY_IPC")
    got, ours, plan = _runs(fake_ipc)
    want = _expected(plan, where == "one device", items=2, rows=32)
    for key in got:
        assert sorted(got[key]) == sorted(w[key] for w in want.values()), key
    for t, w in want.items():
        for key in ("h2d", "h2d_bytes", "d2h", "d2h_bytes"):
            assert (ours[5][t][key] - ours[3][t][key]) / 2 == w[key], (t, key)
        assert (ours[5][t].get("ipc_recv", 0) - ours[3][t].get("ipc_recv", 0)) / 2 == w["d2d_ipc"], t
    ipc = where == "one device"  # (the logits one way, their gradient back: from the first step)
    assert all(w["d2d_ipc"] == 2 * ipc for w in want.values())
    assert [ours[5][t].get("ipc_sent", 0) for t in want] == [5 * 2 * ipc] * 2


def test_a_sender_out_of_buffers_waits_for_its_peer_and_the_run_goes_on(fake_ipc, monkeypatch):
    """One buffer per tensor (`HETPS_IPC_SLOTS=1`) and two micro-batches: a gpu trainer whose
    second send of a step finds the buffer still held waits for the peer's release (reading its
    inbox); no second buffer is made and sync training still equals one process."""
    monkeypatch.setenv("HETPS_IPC_SLOTS", "1")
    m, plan, run = model(), transpile(model().main, TWO_GPUS), {**RUN, "trainers": TRAINERS}
    hist = train(plan, data(), steps=4, mode="sync", micro_batches=2, return_params=True, **run)
    assert_same_params(
        hist.params, single_process(m, [data().batch(t, 64) for t in range(4)]), [t.name for t in plan.tables]
    )
    assert [hist.trainers[t]["ipc_sent"] for t in ("gpu:0", "gpu2:0")] == [8, 8]
    assert [hist.trainers[t]["ipc_slots"] for t in ("gpu:0", "gpu2:0")] == [1, 1]  # (bounded)


def test_async_training_of_two_gpu_types_on_one_device_finishes(fake_ipc):
    """Async mode (two steps' items in flight): the run ends with finite parameters, every tensor
    between the two gpu types device to device (each way once per micro-batch)."""
    run = {**RUN, "trainers": TRAINERS}
    hist = train(transpile(model().main, TWO_GPUS), data(), steps=6, mode="async", return_params=True, **run)
    assert hist.steps == 6 and all(np.isfinite(v).all() for v in hist.params.values())
    mb = hist.trainers["cpu:0"]["items"] // 6
    assert [hist.trainers[t]["ipc_recv"] for t in ("gpu:0", "gpu2:0")] == [6 * mb] * 2


def _receive(conn, ipc_dir: str, skip_wait: bool) -> None:
    """A receiver process: takes each IpcPart it is sent, answers the values (on the host) and the
    slots to release, or the error's text."""
    import os

    os.environ["HETPS_FAKE_CUPY_IPC"] = ipc_dir
    import fake_cupy as xp

    if skip_wait:  # planted: the copy stream does not wait for the sender's event
        xp.cuda.runtime.streamWaitEvent = lambda stream, event, flags=0: None
    rx = IpcReceiver(xp, xp.cuda.Stream(non_blocking=True))
    while (part := conn.recv()) is not None:
        try:
            _, got = rx.take(part)
            conn.send(({k: v.get() for k, v in got.items()}, rx.releasable(block=True)))
        except RuntimeError as e:
            conn.send(str(e))
    rx.close()
    conn.send(xp.COUNTS.d2d_ipc_bytes)


def _receiver(tmp_path, skip_wait: bool = False):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receive, args=(child, str(tmp_path), skip_wait))
    proc.start()
    return parent, proc


@pytest.fixture
def ipc_here(monkeypatch, tmp_path):
    monkeypatch.setenv("HETPS_FAKE_CUPY_IPC", str(tmp_path))
    fake_cupy.COUNTS.reset()
    return tmp_path


def _sender():
    stream = fake_cupy.cuda.Stream(non_blocking=True)
    return IpcSender(fake_cupy, stream, "gpu:0")


def test_tensors_cross_device_to_device_through_reused_buffers(ipc_here):
    """Another process receives what is sent: the values by hand, each buffer's handle and the
    event's sent once, a released buffer written again (no new one), the bytes counted as device to
    device there and no host crossing here."""
    tx, rng = _sender(), np.random.default_rng(0)
    conn, proc = _receiver(ipc_here)
    try:
        for rnd in range(3):
            host = {"a": rng.normal(size=(4, 3)).astype(np.float32), "b": np.arange(5, dtype=np.int64)}
            dev = [(k, fake_cupy.asarray(v) * 2) for k, v in host.items()]
            before = fake_cupy.COUNTS.h2d, fake_cupy.COUNTS.d2h
            part = tx.send(
                "gpu2:0", dev, wait=lambda s: pytest.fail("no buffer should be waited for"), timeout=1
            )
            assert (fake_cupy.COUNTS.h2d, fake_cupy.COUNTS.d2h) == before  # (nothing crossed the host)
            assert bool(part[1]) == (rnd == 0) and all(bool(t[4]) == (rnd == 0) for t in part[2])
            conn.send(part)
            values, released = conn.recv()
            for k, v in host.items():
                np.testing.assert_array_equal(values[k], 2 * v)
            assert released == {"gpu:0": [0, 1]}  # (the same two buffers every round)
            tx.release("gpu2:0", released["gpu:0"])
        assert len(tx.by_id) == 2
        conn.send(None)
        assert conn.recv() == 3 * (4 * 3 * 4 + 5 * 8)
    finally:
        proc.join(30)


def test_a_receiver_that_reads_before_waiting_for_the_senders_event_is_caught(ipc_here):
    """Planted: the receiver's copy stream does not wait for the sender's interprocess event (on a
    GPU it would read a half-written buffer); the stand-in refuses the read."""
    tx = _sender()
    conn, proc = _receiver(ipc_here, skip_wait=True)
    try:
        conn.send(tx.send("gpu2:0", [("a", fake_cupy.ones((2, 2)))], wait=lambda s: None, timeout=1))
        assert "waited for the interprocess event" in conn.recv()
        conn.send(None)
        conn.recv()
    finally:
        proc.join(30)


def test_a_receiver_that_never_hands_its_buffers_back_fails_the_sender_naming_it(ipc_here):
    """A receiver that died holding the buffers of a tensor: the sender waits for them (reading its
    inbox: `wait`) up to the run's timeout, then fails naming that receiver, never hangs."""
    tx, waited = _sender(), []
    v = [("logits", fake_cupy.ones((8, 1), dtype=np.float32))]
    for _ in range(SLOTS):
        tx.send("gpu2:0", v, wait=lambda s: pytest.fail("a buffer was free"), timeout=0.2)
    with pytest.raises(RuntimeError, match=r"'logits' \(8, 1\) sent to gpu2:0 came back in 0.2 s: gpu2:0"):
        tx.send("gpu2:0", v, wait=waited.append, timeout=0.2)
    assert waited and sum(waited) >= 0.2 - 1e-6 and len(tx.by_id) == SLOTS  # (bounded: no new buffer)
    tx.release("gpu2:0", [2])  # once one comes back it is written again
    tx.send("gpu2:0", v, wait=lambda s: pytest.fail("slot 2 was free"), timeout=0.2)
    with pytest.raises(Exception, match="does not hold"):
        tx.release("gpu3:0", [1])


def test_the_device_key_names_one_device_and_nothing_without_one(monkeypatch):
    a = device_key(fake_cupy)
    assert a and a == device_key(fake_cupy)
    monkeypatch.setenv("HETPS_FAKE_CUPY_UUID", "per-process")
    assert device_key(fake_cupy) not in ("", a)
    assert device_key(np) == ""


def test_the_descriptor_travels_in_a_signed_header_and_a_malformed_one_is_refused(ipc_here):
    """The `IpcPart` goes in the `Tensors` header through the wire format (MessagePack, no pickle)
    and comes back equal; a descriptor with a dtype off the allow-list, a handle that is not 64
    bytes of hex or a missing field is a ProtocolError on arrival, before anything is opened."""
    from runtime.transport.messages import TO_TRAINER, ProtocolError, Tensors, header, parse
    from runtime.transport.wire import decode, encode

    part = _sender().send("gpu2:0", [("a", fake_cupy.ones((2, 3)))], wait=lambda s: None, timeout=1)
    key = b"k" * 32
    h, _ = decode(encode(header(Tensors(0, 1, 2, [], part)), [], key), key)
    assert parse(h, TO_TRAINER).dev == part
    assert "d" not in header(Tensors(0, 1, 2, []))  # (host-only messages are as before)
    rx = IpcReceiver(fake_cupy, fake_cupy.cuda.Stream(non_blocking=True))
    sender, event, [t] = part
    for bad in (
        [sender, event, [[*t[:2], "|O", *t[3:]]]],
        [sender, "ab" * 10, [t]],
        [sender, event, [t[:3]]],
    ):
        with pytest.raises(ProtocolError, match="descriptor is malformed"):
            rx.take(bad)
    assert rx.opened == {} and rx.events == {}
