"""The gpu trainer's device path on `fake_cupy` (tests/fake_cupy.py), a strict stand-in for cupy
whose arrays cannot mix with host arrays: every value that reaches a gpu trainer's kernels must have
crossed with `xp.asarray`, and every value leaving it with `.get()` / `xp.asnumpy`.

This checks hetps's device logic (what crosses between host and device, and where), not cupy
itself: the stand-in computes with numpy. tests/runtime/exec/test_gpu_cuda.py runs on real cupy.
The trainer processes find the stand-in through `HETPS_FAKE_CUPY` (runtime/exec/device.py), which
they inherit from the test."""

from __future__ import annotations

import fake_cupy
import numpy as np
import pytest
from test_runtime_train import assert_same_params, single_process

from ops_registry import SparseRows, scatter_add
from runtime import Executor, train
from runtime.data import SyntheticCTR
from runtime.driver.checkpoints import latest
from runtime.evaluation.evaluate import evaluate, predict
from runtime.exec.device import array_module, to_host
from runtime.exec.executor import RunContext
from transpiler import Program, append_backward, transpile
from transpiler import builder as nn
from transpiler.models import wide_deep
from transpiler.passes.held import held_dense

VOCAB = 300
RUN = dict(batch_size=64, trainers={"cpu": 1, "gpu": 1}, servers=1, allow_emulation=False, progress=False)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setenv("HETPS_FAKE_CUPY", "fake_cupy")
    fake_cupy.COUNTS.reset()
    return fake_cupy


def model():
    return wide_deep(num_slots=4, vocab=VOCAB, dim=4, hidden=(16, 8), optimizer=nn.SGD(lr=0.2))


def data():
    return SyntheticCTR(vocab=VOCAB, num_slots=4, seed=5)


def test_the_stand_in_refuses_every_implicit_crossing_and_counts_the_explicit_ones(fake_gpu):
    xp, desc = array_module("gpu")
    assert xp is fake_cupy and "CUDA device" in desc
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    dev = xp.asarray(host)
    for mix in (
        lambda: np.asarray(dev),
        lambda: dev + host,
        lambda: np.add(dev, host),
        lambda: xp.concatenate([dev, host]),
        lambda: dev.__setitem__(0, host[0]),
        lambda: xp.maximum(dev, host),
    ):
        with pytest.raises(TypeError):
            mix()
    assert isinstance(dev * np.float32(2) + 1, xp.ndarray)  # scalars mix, as in cupy
    np.testing.assert_array_equal(to_host(dev @ dev.T), host @ host.T)
    assert (fake_gpu.COUNTS.h2d, fake_gpu.COUNTS.d2h) == (1, 1)
    assert (fake_gpu.COUNTS.h2d_bytes, fake_gpu.COUNTS.d2h_bytes) == (24, 16)


def test_a_kernel_that_mixes_a_host_array_into_device_values_is_caught(fake_gpu):
    """What the stand-in catches: a planted kernel bug (a host constant added to device values, which
    numpy accepts silently and cupy refuses)."""

    def leaky_bias(xp, ins, attrs):
        return {"Out": ins["X"] + np.ones(ins["X"].shape[-1], dtype=ins["X"].dtype)}

    x = np.ones((4, 3), dtype=np.float32)
    leaky_bias(np, {"X": x}, {})  # fine on the host
    with pytest.raises(TypeError, match="host ndarray"):
        leaky_bias(fake_cupy, {"X": fake_cupy.asarray(x)}, {})


def test_the_whole_dense_and_sparse_program_runs_on_the_device_through_the_executor(fake_gpu):
    m = model()
    batches = [data().batch(t, 64) for t in range(3)]
    dev = Executor(fake_cupy)
    dev.run(m.startup)
    for b in batches:
        loss = dev.run(m.main, feed=b, fetch_list=[m.loss])[0]
    assert isinstance(loss, np.ndarray)  # fetched values come back to the host
    assert all(isinstance(v, fake_cupy.ndarray) for v in dev.scope.values() if hasattr(v, "shape"))
    want = single_process(m, batches)
    params = {k: to_host(v) for k, v in dev.scope.items()}
    assert_same_params(params, want, [t.name for t in transpile(m.main).tables])
    assert fake_gpu.COUNTS.h2d > 0 and fake_gpu.COUNTS.d2h > 0


def test_repeated_ids_scatter_add_on_the_device(fake_gpu):
    ids = np.array([1, 1, 3, 1], dtype=np.int64)
    rows = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    want = np.zeros((5, 3), np.float32)
    np.add.at(want, ids, rows)
    got = fake_cupy.zeros((5, 3), fake_cupy.float32)
    scatter_add(fake_cupy, got, fake_cupy.asarray(ids), fake_cupy.asarray(rows))
    np.testing.assert_allclose(to_host(got), want, rtol=1e-6)


def test_sync_training_with_a_device_trainer_holding_its_tables_equals_single_process(fake_gpu):
    m = model()
    plan = transpile(m.main)
    held = held_dense(plan.programs, plan.tables, RUN["trainers"])
    assert held and set(held.values()) == {"gpu"}  # the gpu trainer holds its dense tables
    hist = train(m.main, data(), steps=6, mode="sync", micro_batches=2, return_params=True, **RUN)
    want = single_process(m, [data().batch(t, 64) for t in range(6)])
    assert_same_params(hist.params, want, [t.name for t in plan.tables])


def test_async_training_with_a_device_trainer_finishes(fake_gpu):
    hist = train(model().main, data(), steps=8, mode="async", return_params=True, **RUN)
    assert hist.steps == 8 and all(np.isfinite(v).all() for v in hist.params.values())


def test_a_device_run_checkpoints_resumes_and_is_evaluated(fake_gpu, tmp_path):
    m = model()
    ckpt = tmp_path / "ckpt"
    train(m.main, data(), steps=4, mode="sync", checkpoint=str(ckpt), **RUN)
    resumed = train(m.main, data(), steps=6, mode="sync", resume=str(ckpt), return_params=True, **RUN)
    assert resumed.first_step == 4 and resumed.steps == 2
    want = single_process(m, [data().batch(t, 64) for t in range(6)])
    plan = transpile(m.main)
    assert_same_params(resumed.params, want, [t.name for t in plan.tables])
    held_out = [SyntheticCTR(vocab=VOCAB, num_slots=4, seed=9).batch(t, 50) for t in range(2)]
    scores = evaluate(plan, held_out, checkpoint=str(latest(ckpt)))
    assert scores["examples"] == 100 and np.isfinite(scores["loss"])
    assert predict(plan, held_out, checkpoint=str(latest(ckpt))).shape[0] == 100


def test_kernel_profiling_times_the_gpu_kind_on_the_device(fake_gpu):
    from runtime.profile.measure import profile_kernels

    costs, emulated = profile_kernels(transpile(model().main), kinds=("gpu",), sizes=(8, 16), repeats=1)
    assert emulated == [] and costs["gpu"]


def _forward_backward(build, xp) -> dict:
    """{param: gradient, "loss": loss} of test_gradients' case `build`, every value on `xp`."""
    from test_gradients import Case

    main, startup, case = Program(), Program(), Case()
    with nn.program_guard(main, startup):
        out = build(case)
        weights = case.data(case.rng.uniform(0.5, 1.5, out.shape))
        loss = nn.reduce_sum(nn.mul(out, weights))
    params = [p.name for p in main.parameters()]
    grads = dict(append_backward(main, loss, params))
    exe = Executor(xp)
    exe.run(startup)
    got = exe.run(main, feed=case.feed, fetch_list=[loss] + [grads[p] for p in params], ctx=RunContext(0))
    dense = [to_host(g.to_dense(xp)) if isinstance(g, SparseRows) else g for g in got]
    return dict(zip(["loss", *params], dense, strict=True))


def test_every_differentiable_op_runs_forward_and_backward_on_the_device(fake_gpu):
    """test_gradients' cases (every op the builder emits with a gradient), on the stand-in: the same
    loss and gradients as on numpy, and no host array mixed into device values."""
    from test_gradients import CASES

    failed = {}
    for name, build in CASES.items():
        want = _forward_backward(build, np)
        try:
            got = _forward_backward(build, fake_cupy)
        except Exception as e:  # noqa: BLE001  (collect every op's failure)
            failed[name] = f"{type(e).__name__}: {e}"[:300]
            continue
        for k, w in want.items():
            np.testing.assert_allclose(got[k], w, rtol=1e-9, atol=1e-12, err_msg=f"{name}: {k}")
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


def _per_step_from_plan(plan, items: int, rows: int) -> dict[str, int]:
    """What must cross per step on the gpu trainer, from its sub-program alone: each recv'd tensor to
    the device and each sent one off it, per item (rows x the var's declared dims x its dtype's
    size); one report per item off the device (its loss, scores and labels, in the loss's dtype);
    nothing for the dense tables it holds (pull_dense / push_dense of held tables)."""
    prog = plan.programs["gpu"]
    assert not [op for op in prog.ops if op.type in ("pull_sparse", "push_sparse")]  # (none here)

    def nbytes(name: str) -> int:
        var = prog.vars[name]
        return rows * int(np.prod([d for d in var.shape if d != -1])) * np.dtype(var.dtype).itemsize

    recvs = [op.attrs["tensor"] for op in prog.ops if op.type == "recv"]
    sends = [op.attrs["tensor"] for op in prog.ops if op.type == "send"]
    loss = next(
        op for op in prog.ops if op.type == "sigmoid_cross_entropy_with_logits" and op.role != "backward"
    )
    report = (1 + 2 * rows) * np.dtype(prog.vars[loss.outputs["Out"][0]].dtype).itemsize
    return {
        "h2d": items * len(recvs),
        "h2d_bytes": items * sum(nbytes(n) for n in recvs),
        "d2h": items * (len(sends) + 1),
        "d2h_bytes": items * (sum(nbytes(n) for n in sends) + report),
    }


def test_per_step_only_boundary_tensors_cross_and_nothing_for_the_held_tables(
    fake_gpu, tmp_path, monkeypatch
):
    """The gpu trainer's crossings per step, counted by the stand-in in its process and by hetps
    itself (`History.trainers`), equal what its sub-program says must cross: the boundary tensors and
    the item reports; its held MLP tables and their optimizer state never cross during the run
    (runs of 3 and 5 steps differ by 2 steps' crossings: hold and write-back are once per run)."""
    monkeypatch.setenv("HETPS_FAKE_CUPY_COUNTS", str(tmp_path))
    m, got, ours = model(), {}, {}
    for steps in (3, 5):
        hist = train(m.main, data(), steps=steps, mode="sync", micro_batches=2, **RUN)
        (counts,) = fake_cupy.read_counts(tmp_path).values()  # (the gpu trainer's process only)
        got[steps], ours[steps] = counts, hist.trainers["gpu:0"]
        for f in tmp_path.glob("*.counts"):
            f.unlink()
    want = _per_step_from_plan(transpile(m.main), items=2, rows=32)
    for key, per_step in want.items():
        assert (getattr(got[5], key) - getattr(got[3], key)) / 2 == per_step, key
        assert (ours[5][key] - ours[3][key]) / 2 == per_step, key
    assert got[5].h2d_pinned - got[3].h2d_pinned == 2 * want["h2d"]  # received tensors: pinned, own stream
    assert (got[5].d2h, got[5].h2d) == (ours[5]["d2h"], ours[5]["h2d"])  # hetps counts every copy it makes


def test_a_received_tensor_read_before_its_copy_stream_was_waited_for_is_caught(fake_gpu, monkeypatch):
    """Planted: the copy to the device without the compute stream waiting for it (on a GPU its
    kernels would read a half-copied buffer); the stand-in's stream model refuses the read."""
    from runtime.exec.device import Copies

    copies = Copies(fake_cupy)
    host = np.ones((4, 3), np.float32)
    np.testing.assert_array_equal(to_host(copies.to_device(host) * 2), 2 * host)  # as written: fine
    monkeypatch.setattr(fake_cupy.cuda.Stream.null, "wait_event", lambda event: None)
    dev = copies.to_device(host)
    with pytest.raises(RuntimeError, match="before its copy on another stream was waited for"):
        dev * 2


def test_a_messages_tensors_cross_with_one_event_each_way_and_keep_their_values(fake_gpu):
    """`Copies.to_device_all` / `to_host_all` (a message's tensors, a segment's sends): every array,
    a `SparseRows`' parts among them, equal to the host arrays by hand after the round trip; one
    event recorded on the copy stream for all the copies in, one wait of the copy stream for the
    compute stream for all the copies in and one for all the copies out; each copy counted, in
    pinned buffers that are reused."""
    from runtime.exec.device import Copies

    copies, rng = Copies(fake_cupy), np.random.default_rng(3)
    host = {"a": rng.normal(size=(5, 3)).astype(np.float32), "b": rng.normal(size=(5, 3)).astype(np.float32)}
    rows = SparseRows(np.array([0, 2], np.int64), rng.normal(size=(2, 3)).astype(np.float32), 4)
    records, waits, pinned = [], [], 0
    copies.stream.record = lambda event=None, rec=copies.stream.record: records.append(1) or rec(event)
    copies.stream.wait_event = lambda e, wait=copies.stream.wait_event: waits.append(1) or wait(e)
    for rnd in range(3):
        before = fake_cupy.COUNTS.h2d_pinned, fake_cupy.COUNTS.d2h_pinned
        dev = copies.to_device_all({**host, "rows": rows})
        assert len(records) == rnd + 1  # (one event for the 4 copies in)
        back = copies.to_host_all([dev["a"] * 2, dev["b"][:, 1:], dev["rows"], np.ones(2)])
        # the copy stream waits for the compute stream once each way: before the copies in (their
        # destinations, from cupy's pool, may be memory the kernels enqueued so far read) and out
        assert len(waits) == 2 * (rnd + 1)
        np.testing.assert_array_equal(back[0], host["a"] * 2)
        np.testing.assert_array_equal(back[1], host["b"][:, 1:])  # (strided: made contiguous first)
        np.testing.assert_array_equal(back[2].rows, rows.rows)
        np.testing.assert_array_equal(back[2].values, rows.values)
        np.testing.assert_array_equal(back[3], np.ones(2))
        assert isinstance(back[0], np.ndarray) and isinstance(back[2].values, np.ndarray)
        assert (fake_cupy.COUNTS.h2d_pinned - before[0], fake_cupy.COUNTS.d2h_pinned - before[1]) == (4, 4)
        pinned = len(fake_cupy._KEEP) if rnd == 0 else pinned
    assert len(fake_cupy._KEEP) == pinned  # (no pinned buffer allocated after the first round: reused)


def test_a_device_sync_hidden_in_a_kernel_shows_in_the_counts(fake_gpu):
    """Caught by the stand-in: the bce label check read its answer (`bool(bad.any())`) on the device,
    one hidden device -> host copy and sync per micro-batch; device labels are now left unchecked
    there and a host batch is still refused."""
    from ops_registry.loss import check_binary_labels

    check_binary_labels(fake_cupy.asarray(np.array([0.0, 1.0, 0.5])), "bce", "Label")
    assert fake_gpu.COUNTS.d2h == 0
    assert bool(fake_cupy.asarray(np.array([1.0])).any()) and fake_gpu.COUNTS.d2h == 1  # counted
    with pytest.raises(ValueError, match="outside"):
        check_binary_labels(np.array([0.0, 2.0]), "bce", "Label")


def _adam_by_hand(p, grads, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    m = v = np.zeros_like(p, dtype=np.float64)
    p = p.astype(np.float64)
    for t, g in enumerate(grads, 1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        c = np.sqrt(1 - b2**t)
        p = p - lr * c / (1 - b1**t) * m / (np.sqrt(v) + eps * c)
    return p, m, v


def test_held_tables_and_their_adam_state_live_on_the_device_until_the_write_back(fake_gpu):
    """HeldTables on the device: the hold copies the state there once, steps with device gradients
    cross nothing, the write-back copies the state back: Adam by hand; a NaN gradient is refused there."""
    from test_held_dense import _ShardClient, _specs

    from runtime.ps.held_tables import HeldTables
    from runtime.ps.shard import Shard
    from runtime.ps.types import PSError

    shard = Shard(_specs({"type": "adam", "lr": 0.1}), mode="async")
    held = HeldTables(_ShardClient(shard), ["w"], start=0, sync=False, xp=fake_cupy)
    t = held.tables["w"]
    assert all(isinstance(a, fake_cupy.ndarray) for a in t.state_dict().values())
    hold_copies = fake_gpu.COUNTS.h2d
    assert hold_copies == len(t.state_dict())  # Param, 2 moments, 2 powers: once
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(3)]
    dev_grads = [fake_cupy.asarray(g) for g in grads]
    fake_gpu.COUNTS.reset()
    for step, g in enumerate(dev_grads):
        assert held.pull("w", step) is t.param  # the device array itself
        held.apply({"w": g}, step)
    assert (fake_gpu.COUNTS.h2d, fake_gpu.COUNTS.d2h) == (0, 0)  # nothing crossed for 3 steps
    states = held._host_states()
    p, m, v = _adam_by_hand(np.ones((3, 2)), grads)
    np.testing.assert_allclose(states["w"]["Param"], p, rtol=1e-5)
    np.testing.assert_allclose(states["w"]["Moment1"], m, rtol=1e-5)
    np.testing.assert_allclose(states["w"]["Moment2"], v, rtol=1e-5)
    assert fake_gpu.COUNTS.d2h == len(t.state_dict())  # the state, once
    bad = fake_cupy.asarray(np.full((3, 2), np.nan, np.float32))
    held.apply({"w": bad}, 3)
    with pytest.raises(PSError, match=r"\['w'\].*NaN or Inf"):
        held._host_states()
