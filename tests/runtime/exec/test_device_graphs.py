"""Device graphs (runtime/exec/graphs.py) on the cupy stand-in (tests/fake_cupy.py), which models
stream capture as CUDA does it: kernels on the capturing stream are recorded and do not take
effect (what they wrote is put back, what they made is NaN), a launch runs them again on the same
memory, and a host sync or a kernel on another stream during the capture is refused.

This checks hetps's graph logic (what is captured, which buffers a replay reads and writes, when it
falls back to eager), not CUDA's graphs themselves: the stand-in computes with numpy.
"""

from __future__ import annotations

import logging

import fake_cupy
import numpy as np
import pytest
from test_fake_device import RUN, data, model

from ops_registry import get_op
from runtime import Executor, train
from runtime.exec.device import to_host
from runtime.exec.graphs import DeviceGraphs
from transpiler import Program
from transpiler import builder as nn

W_NAMES = ("l1.w_0", "l1.b_0", "l2.w_0", "l2.b_0")


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setenv("HETPS_FAKE_CUPY", "fake_cupy")
    fake_cupy.COUNTS.reset()
    return fake_cupy


def _mlp():
    """x [-1, 4] -> relu(fc 8) -> fc 1 as one program, and as two (x -> h, h -> y); the parameters."""
    progs = [Program() for _ in range(4)]
    main, startup, first, second = progs
    with nn.program_guard(main, startup):
        h = nn.fc(nn.data("x", [-1, 4]), 8, act="relu", name="l1")
        y = nn.fc(h, 1, name="l2")
    with nn.program_guard(first, Program()):
        h1 = nn.fc(nn.data("x", [-1, 4]), 8, act="relu", name="l1")
    with nn.program_guard(second, Program()):
        y2 = nn.fc(nn.data("h", [-1, 8]), 1, name="l2")
    host = Executor()
    host.run(startup)
    params = {n: host.scope[n] for n in W_NAMES}
    return main, params, y.name, (first, h1.name, second, y2.name)


def _by_hand(p: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.maximum(x @ p["l1.w_0"] + p["l1.b_0"], 0)
    return h, h @ p["l2.w_0"] + p["l2.b_0"]


def _device_exe(params: dict) -> Executor:
    exe = Executor(fake_cupy, graphs=DeviceGraphs(fake_cupy))
    exe.scope.update({n: fake_cupy.asarray(v) for n, v in params.items()})
    return exe


def _batch(seed: int, n: int = 6) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


def test_the_stand_in_capture_runs_nothing_until_the_graph_is_launched(fake_gpu):
    a = fake_cupy.asarray(np.ones(3, np.float32))
    w = fake_cupy.asarray(np.full(3, 2.0, np.float32))
    s = fake_cupy.cuda.Stream(non_blocking=True)
    c = fake_cupy.asarray(np.zeros(2, np.float32))
    with s:
        s.begin_capture()
        b = a * w
        w -= b
        c += 1  # (an array only a method's own operand)
        graph = s.end_capture()
    assert np.isnan(to_host(b)).all() and (to_host(w) == 2).all()  # not computed, not written yet
    np.testing.assert_array_equal(to_host(c), [0, 0])
    graph.launch()
    np.testing.assert_array_equal(to_host(b), [2, 2, 2])
    np.testing.assert_array_equal(to_host(w), [0, 0, 0])
    np.testing.assert_array_equal(to_host(c), [1, 1])
    a[...] = fake_cupy.asarray(np.full(3, 3.0, np.float32))
    graph.launch()  # reads a's and w's memory as it is now
    np.testing.assert_array_equal(to_host(b), [0, 0, 0])
    with s:
        s.begin_capture()
        with pytest.raises(fake_cupy.CUDARuntimeError, match="not permitted when stream is capturing"):
            float(a.sum())
        with pytest.raises(fake_cupy.CUDARuntimeError, match="Invalidated"):
            s.end_capture()
    s.begin_capture()  # (not made current with `with s:`)
    with pytest.raises(fake_cupy.CUDARuntimeError, match="another stream"):
        a * 2
    with pytest.raises(fake_cupy.CUDARuntimeError, match="Invalidated"):
        s.end_capture()


def test_a_program_is_captured_once_and_replayed_on_each_batch(fake_gpu):
    main, params, y, _ = _mlp()
    exe = _device_exe(params)
    for t in range(5):
        x = _batch(t)
        (got,) = exe.run(main, feed={"x": x}, fetch_list=[y])
        np.testing.assert_allclose(got, _by_hand(params, x)[1], rtol=1e-6)
    stats = exe.graphs.stats
    assert (stats.captured, stats.replays, stats.eager) == (1, 4, 1)  # one warm-up, then the graph
    (graph,) = exe.graphs.graphs.values()
    assert set(graph.inplace) == set(W_NAMES) and set(graph.inputs) == {"x"}  # params read in place


def test_items_interleaved_between_two_graphs_keep_their_own_values(fake_gpu):
    """Item 1's hidden layer, handed over from graph A, is read by graph B after item 2 ran A (which
    overwrote A's buffers): B must still see item 1's values."""
    _, params, _, (first, h, second, y) = _mlp()
    exe = _device_exe(params)
    for t in range(4):
        x1, x2 = _batch(2 * t), _batch(2 * t + 1)
        (h1,) = exe.run(first, feed={"x": x1}, fetch_list=[h], return_numpy=False)
        (h2,) = exe.run(first, feed={"x": x2}, fetch_list=[h], return_numpy=False)
        (y1,) = exe.run(second, feed={"h": h1}, fetch_list=[y])
        (y2,) = exe.run(second, feed={"h": h2}, fetch_list=[y])
        np.testing.assert_allclose(y1, _by_hand(params, x1)[1], rtol=1e-6, err_msg=f"round {t}")
        np.testing.assert_allclose(y2, _by_hand(params, x2)[1], rtol=1e-6, err_msg=f"round {t}")
    assert exe.graphs.stats.captured == 2 and exe.graphs.stats.replays >= 10


class _Item:  # a trainer's micro-batch as the Executor's ctx: what DeviceGraphs reads of it
    def __init__(self, key: tuple) -> None:
        self.key = key


def _two_segments(exe: Executor, seg: tuple, items: list, xs: list) -> tuple[list, list]:
    """Every item through the first program, then every one through the second (interleaved as a
    trainer runs its items): the hidden layers as handed out, and the outputs."""
    first, h, second, y = seg
    hs = [
        exe.run(first, feed={"x": x}, fetch_list=[h], return_numpy=False, ctx=it)[0]
        for it, x in zip(items, xs, strict=True)
    ]
    ys = [exe.run(second, feed={"h": v}, fetch_list=[y], ctx=it)[0] for it, v in zip(items, hs, strict=True)]
    return hs, ys


def test_items_in_flight_get_lanes_of_their_own_read_in_place_and_reused_once_released(fake_gpu):
    """Items with keys: each has its own graphs' buffers (a lane), so graph A's output for item 1
    is read by graph B in place (no copy), after items 2 and 3 ran A; a released item's lane is
    lent again (the same buffers); with every lane lent, an item replays the shared lane (copies).
    Sharing one set of buffers between items in flight would give item 1 item 3's hidden layer."""
    _, params, _, seg = _mlp()
    exe = Executor(fake_cupy, graphs=DeviceGraphs(fake_cupy, lanes=2))
    exe.scope.update({n: fake_cupy.asarray(v) for n, v in params.items()})
    lent = []
    for t in range(4):
        items, xs = [_Item((t, 0, m)) for m in range(3)], [_batch(10 * t + m) for m in range(3)]
        hs, ys = _two_segments(exe, seg, items, xs)
        for m, (x, got) in enumerate(zip(xs, ys, strict=True)):
            np.testing.assert_allclose(got, _by_hand(params, x)[1], rtol=1e-6, err_msg=f"round {t} item {m}")
            np.testing.assert_allclose(to_host(hs[m]), _by_hand(params, x)[0], rtol=1e-6)  # kept its own
        lent.append([exe.graphs.lanes[it.key] for it in items])
        for it in items:
            exe.graphs.release(it.key)
    assert lent[0] == [0, 1, None] and lent[-1] == lent[1], lent  # two lanes, then the shared one
    assert sorted(lent[-1][:2]) == [0, 1] and not exe.graphs.lanes  # lent again once released
    bufs = {lane: g.outputs[seg[1]] for (_, lane), g in exe.graphs.graphs.items() if seg[1] in g.outputs}
    assert hs[0] is bufs[lent[-1][0]]  # item 1's hidden layer: its lane's buffer, not a copy
    assert hs[2] is not bufs[None]  # the shared lane's: a copy


def _reads_x_twice() -> tuple:
    """x -> h = relu(fc 8) and (h, x) -> y = fc 1 of concat(h, x) as two programs (the second reads
    x again, as a trainer's backward part reads a received tensor the forward part read); the
    parameters, by name."""
    first, second, startup = Program(), Program(), Program()
    with nn.program_guard(first, startup):
        h = nn.fc(nn.data("x", [-1, 4]), 8, act="relu", name="l1")
    with nn.program_guard(second, startup):
        y = nn.fc(nn.concat([nn.data("h", [-1, 8]), nn.data("x", [-1, 4])]), 1, name="l3")
    host = Executor()
    host.run(startup)
    params = {n: host.scope[n] for n in ("l1.w_0", "l1.b_0", "l3.w_0", "l3.b_0")}
    return (first, h.name, second, y.name), params


def test_a_graph_reads_an_input_another_graph_of_the_lane_copied_in_from_that_buffer(fake_gpu):
    """Graph B reads the device array x that graph A copied into its input buffer: B reads it from
    there (linked, no second copy) and still gets each item's own x when items share the shared
    lane (one lane: items 2 and 3 replay A's shared graph one after the other, so B must copy item
    2's x back in before it reads it). Round 0 runs item by item (A then B), the others all items
    through A, then all through B. Checked against numpy by hand."""
    (first, h, second, y), p = _reads_x_twice()
    exe = Executor(fake_cupy, graphs=DeviceGraphs(fake_cupy, lanes=1))
    exe.scope.update({n: fake_cupy.asarray(v) for n, v in p.items()})
    for t in range(4):
        items, xs = [_Item((t, 0, m)) for m in range(3)], [_batch(10 * t + m) for m in range(3)]
        devs, hs = [fake_cupy.asarray(x) for x in xs], {}
        order = [(0, m) for m in range(3)] + [(1, m) for m in range(3)]
        for stage, m in sorted(order, key=lambda o: o[::-1]) if t == 0 else order:
            if stage == 0:
                hs[m] = exe.run(first, feed={"x": devs[m]}, fetch_list=[h], return_numpy=False, ctx=items[m])[
                    0
                ]
                continue
            (got,) = exe.run(second, feed={"h": hs[m], "x": devs[m]}, fetch_list=[y], ctx=items[m])
            hh = np.maximum(xs[m] @ p["l1.w_0"] + p["l1.b_0"], 0)
            want = np.concatenate([hh, xs[m]], axis=1) @ p["l3.w_0"] + p["l3.b_0"]
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"round {t} item {m}")
        for it in items:
            exe.graphs.release(it.key)
    seconds = {lane: g for (_, lane), g in exe.graphs.graphs.items() if y in g.outputs}
    assert set(seconds) == {0, None}, seconds
    assert all("x" in g.linked and "x" not in g.inputs for g in seconds.values())  # read from A's buffer


def test_a_shape_change_runs_eagerly_and_says_why_once(fake_gpu, caplog):
    main, params, y, _ = _mlp()
    exe = _device_exe(params)
    for t in range(3):
        exe.run(main, feed={"x": _batch(t)}, fetch_list=[y])
    with caplog.at_level(logging.WARNING, logger="hetps.device"):
        for t in range(2):  # the last, partial batch
            x = _batch(10 + t, n=4)
            (got,) = exe.run(main, feed={"x": x}, fetch_list=[y])
            np.testing.assert_allclose(got, _by_hand(params, x)[1], rtol=1e-6)
    said = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(said) == 1 and "x [4, 4] float32 (captured: [6, 4] float32)" in said[0], said
    x = _batch(20)
    (got,) = exe.run(main, feed={"x": x}, fetch_list=[y])  # the captured shape again: replayed
    np.testing.assert_allclose(got, _by_hand(params, x)[1], rtol=1e-6)
    assert exe.graphs.stats.replays == 3  # (the run that captured replays too)


def test_a_host_sync_inside_the_capture_is_found_and_the_program_runs_eagerly(fake_gpu, monkeypatch, caplog):
    """Planted: a relu kernel that reads a device value on the host (`float(x.max())`); CUDA refuses
    it during capture. The capture fails, says which op and why, and the program runs eagerly."""
    relu = get_op("relu")
    plain = relu.kernel

    def syncing(xp, ins, attrs):
        float(ins["X"].max())
        return plain(xp, ins, attrs)

    monkeypatch.setattr(relu, "kernel", syncing)
    main, params, y, _ = _mlp()
    exe = _device_exe(params)
    with caplog.at_level(logging.WARNING, logger="hetps.device"):
        for t in range(4):
            x = _batch(t)
            (got,) = exe.run(main, feed={"x": x}, fetch_list=[y])
            np.testing.assert_allclose(got, _by_hand(params, x)[1], rtol=1e-6)
    said = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(said) == 1 and "capture failed" in said[0] and "'relu'" in said[0], said
    assert "not permitted when stream is capturing" in said[0]
    assert exe.graphs.stats.captured == 0 and exe.graphs.stats.replays == 0


def test_a_parameter_read_in_place_that_becomes_another_array_is_captured_again(fake_gpu):
    main, params, y, _ = _mlp()
    exe = _device_exe(params)
    for t in range(3):
        exe.run(main, feed={"x": _batch(t)}, fetch_list=[y])
    new = {n: v * 0.5 for n, v in params.items()}
    exe.scope["l2.w_0"] = fake_cupy.asarray(new["l2.w_0"])  # (a held table's copy on write)
    mixed = {**params, "l2.w_0": new["l2.w_0"]}
    for t in range(4):
        x = _batch(30 + t)
        (got,) = exe.run(main, feed={"x": x}, fetch_list=[y])
        np.testing.assert_allclose(got, _by_hand(mixed, x)[1], rtol=1e-6, err_msg=f"run {t}")
    assert exe.graphs.stats.captured == 2  # captured again, l2.w_0 now through a buffer
    (graph,) = exe.graphs.graphs.values()
    assert "l2.w_0" in graph.inputs and "l2.w_0" not in graph.inplace


def test_a_random_op_is_not_captured(fake_gpu):
    main, startup = Program(), Program()
    with nn.program_guard(main, startup):
        y = nn.dropout(nn.data("x", [-1, 4]), ratio=0.5)
    exe = Executor(fake_cupy, graphs=DeviceGraphs(fake_cupy))
    for _ in range(3):
        exe.run(main, feed={"x": _batch(0)}, fetch_list=[y])
    assert exe.graphs.stats.captured == 0
    assert "random numbers" in next(iter(exe.graphs.stats.refused.values()))


def test_graphed_sync_training_with_a_gpu_trainer_equals_eager(fake_gpu):
    """Sync training with one gpu trainer holding its tables: with device graphs (the default) the
    parameters equal an eager run's to 1e-6, and the gpu trainer replayed graphs."""
    m = model()
    run = dict(steps=6, mode="sync", micro_batches=2, return_params=True, **RUN)
    runs = {graphs: train(m.main, data(), device_graphs=graphs, **run) for graphs in (True, False)}
    for name, want in runs[False].params.items():
        np.testing.assert_allclose(runs[True].params[name], want, rtol=1e-6, atol=1e-7, err_msg=name)
    gpu = runs[True].trainers["gpu:0"]
    assert gpu["graphs_captured"] > 0 and gpu["graph_replays"] >= 6 * 2, gpu
    assert gpu["graph_eager_parts"] == 0, gpu
    assert "graph_replays" not in runs[False].trainers["gpu:0"]


def test_the_held_tables_adam_step_as_one_graph_is_adam_by_hand_through_a_copy_on_write(fake_gpu):
    """HeldTables(graphs=True): every table's optimizer step is one graph replay (its Adam moments
    and powers updated where they are), equal to Adam by hand; a step that must keep its old value
    (async: a later step read it) makes the table another array, and the step is captured again."""
    from test_fake_device import _adam_by_hand
    from test_held_dense import _ShardClient, _specs

    from runtime.ps.held_tables import HeldTables
    from runtime.ps.shard import Shard

    shard = Shard(_specs({"type": "adam", "lr": 0.1}), mode="async")
    held = HeldTables(_ShardClient(shard), ["w"], start=0, sync=False, xp=fake_cupy, graphs=True)
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(6)]
    for step, g in enumerate(grads):
        if step == 3:
            kept = held.pull("w", 4)  # (step 4 reads the table before step 3 is applied)
        held.apply({"w": fake_cupy.asarray(g)}, step)
    p, m, v = _adam_by_hand(np.ones((3, 2)), grads)
    states = held._host_states()
    np.testing.assert_allclose(states["w"]["Param"], p, rtol=1e-5)
    np.testing.assert_allclose(states["w"]["Moment1"], m, rtol=1e-5)
    np.testing.assert_allclose(states["w"]["Moment2"], v, rtol=1e-5)
    np.testing.assert_allclose(to_host(kept), _adam_by_hand(np.ones((3, 2)), grads[:3])[0], rtol=1e-5)
    stats = held.graphed.stats
    # steps 0, 1 eager (warm-up), 2 captured; 3, 4 eager (a new array, the warm-up), 5 captured again
    assert (stats.captured, stats.replays, stats.eager) == (2, 2, 4), stats


def test_a_gradient_that_is_the_same_array_every_step_is_read_in_place_by_the_held_step(fake_gpu):
    """The held tables' step reads a gradient where it is when it was the same array at the call
    before its capture (as a segment graph's output buffer is, step after step): no copy into a
    buffer of its own, and each step still applies that array's values of the time (written into
    it in place between steps, as the segment's replay does), Adam by hand. A gradient that is
    another array later makes it copied from then on, still Adam by hand."""
    from test_fake_device import _adam_by_hand
    from test_held_dense import _ShardClient, _specs

    from runtime.ps.held_tables import HeldTables
    from runtime.ps.shard import Shard

    shard = Shard(_specs({"type": "adam", "lr": 0.1}), mode="async")
    held = HeldTables(_ShardClient(shard), ["w"], start=0, sync=False, xp=fake_cupy, graphs=True)
    rng = np.random.default_rng(2)
    grads = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(8)]
    buf = fake_cupy.asarray(np.zeros((3, 2), np.float32))
    for step, g in enumerate(grads):
        if step == 5:
            buf = fake_cupy.asarray(np.zeros((3, 2), np.float32))  # another array from step 5 on
        buf[...] = fake_cupy.asarray(g)
        held.apply({"w": buf}, step)
        if step == 4:
            assert ("w", "Grad") in held.graphed.graph.inplace and not held.graphed.graph.inputs
    np.testing.assert_allclose(
        held._host_states()["w"]["Param"], _adam_by_hand(np.ones((3, 2)), grads)[0], rtol=1e-5
    )
    assert set(held.graphed.graph.inputs) == {("w", "Grad")} and held.graphed.stats.captured == 2


def test_a_last_partial_batch_runs_eagerly_in_a_graphed_run(fake_gpu):
    """Three batches of 64 and a last one of 40: the gpu trainer's parts run eagerly for it (their
    inputs' shapes changed) and the run ends where an eager run ends."""
    m = model()
    feeds = [data().batch(t, 64) for t in range(3)] + [data().batch(3, 40)]
    run = dict(RUN, batch_size=None)
    runs = {
        graphs: train(m.main, feeds, epochs=1, mode="sync", return_params=True, device_graphs=graphs, **run)
        for graphs in (True, False)
    }
    for name, want in runs[False].params.items():
        np.testing.assert_allclose(runs[True].params[name], want, rtol=1e-6, atol=1e-7, err_msg=name)
    gpu = runs[True].trainers["gpu:0"]
    assert gpu["graph_replays"] > 0 and gpu["graph_eager_parts"] > 0, gpu  # replayed, then the fallback
