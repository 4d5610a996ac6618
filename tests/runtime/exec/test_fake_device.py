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
