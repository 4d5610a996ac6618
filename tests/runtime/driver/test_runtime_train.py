"""`train` on the local engine: real processes (2 cpu trainers, 1 emulated gpu trainer, PS shards).

Starting a run costs seconds on a 2-core machine, so each run serves several assertions. The oracle
for sync mode is single-process training (`Executor` on the untranspiled program) on the same global
batches: the runtime splits each batch over 2 readers x 4 micro-batches, accumulates gradients and
lets 2 server shards sum them, so any mistake in splitting, scaling, routing or summing shows up in
the parameters. The optimizer is SGD: Adagrad's and Adam's first steps divide a gradient by its own
magnitude, which turns float32 rounding differences of tiny gradients into visible ones.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from procs import alive

from runtime import Executor, InMemoryServer, TrainingError, simulate, train
from runtime.data import SyntheticCTR
from runtime.engines import LocalEngine
from runtime.exec.device import cuda_available
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import dlrm, wide_deep

STEPS = 20


def single_process(model, batches) -> dict[str, np.ndarray]:
    exe = Executor()
    exe.run(model.startup)
    for b in batches:
        exe.run(model.main, feed=b)
    return exe.scope


def assert_same_params(got: dict, want: dict, names: list[str]) -> None:
    for n in names:
        w = want[n]
        np.testing.assert_allclose(got[n], w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=n)


def dlrm_batches(count: int, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        b = {f"slot_{i}": rng.zipf(1.3, (n, 4)) % 1000 for i in range(8)}
        b["dense"] = rng.normal(size=(n, 13)).astype(np.float32)
        b["label"] = (rng.random((n, 1)) < 0.3).astype(np.float32)
        out.append(b)
    return out


def test_sync_wide_deep_equals_single_process_and_leaves_no_process():
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.2))
    data = SyntheticCTR(vocab=1000, seed=3)
    eng, seen = LocalEngine(), []
    hist = train(
        model.main,
        data,
        steps=STEPS,
        batch_size=256,
        trainers={"cpu": 2, "gpu": 1},
        servers=2,
        mode="sync",
        micro_batches=4,
        engine=eng,
        allow_emulation=True,
        return_params=True,
        callback=seen.append,
        secret=b"every message signed (HMAC)",
    )
    want = single_process(model, [data.batch(t, 256) for t in range(STEPS)])
    tables = [t.name for t in transpile(model.main).tables]
    assert len(tables) == 8
    assert_same_params(hist.params, want, tables)
    # the history: one entry per step, in order, with the loss of the whole global batch
    assert [r["step"] for r in seen] == list(range(STEPS)) and hist.examples == [256] * STEPS
    exe = Executor()
    exe.run(model.startup)
    (loss0,) = exe.run(model.main, feed=data.batch(0, 256), fetch_list=[model.loss])
    assert hist.loss[0] == pytest.approx(float(loss0), rel=1e-5)
    assert all(0.0 <= a <= 1.0 for a in hist.auc)
    assert set(hist.trainers) == {"cpu:0", "cpu:1", "gpu:0"}
    assert [hist.trainers[f"cpu:{i}"]["items"] for i in (0, 1)] == [4 * STEPS, 4 * STEPS]
    assert hist.trainers["gpu:0"]["items"] == 8 * STEPS and hist.examples_per_s() > 0
    assert not alive(eng.pids().values())


def test_sync_dlrm_with_imported_values_equals_single_process_and_simulate():
    """The program carries its parameter values (as ONNX / Paddle imports do), different from its
    initializers: the servers must start from them. `runtime.exec.simulate` is the in-process oracle."""
    model = dlrm(vocab=1000, optimizer=nn.SGD(lr=0.1))
    exe = Executor()
    exe.run(model.startup)
    rng = np.random.default_rng(1)
    model.main.params = {
        n: (v * rng.uniform(0.5, 1.5, v.shape)).astype(v.dtype) for n, v in exe.scope.items()
    }
    batches = dlrm_batches(STEPS - 1, 128) + dlrm_batches(1, 1, seed=9)  # the last: one example, so
    plan = transpile(model.main)  # reader cpu:0 gets none
    hist = train(
        plan, batches, epochs=1, servers=2, micro_batches=4, allow_emulation=True, return_params=True
    )
    assert hist.steps == STEPS and len(hist.params) == 18
    ref = Executor()
    losses = [float(ref.run(model.main, feed=b, fetch_list=[model.loss])[0]) for b in batches]
    assert_same_params(hist.params, ref.scope, sorted(hist.params))
    np.testing.assert_allclose(hist.loss, losses, rtol=1e-5)
    server = InMemoryServer(plan)
    sim = [float(step[0]) for step in simulate(plan, batches, server=server)]
    np.testing.assert_allclose(hist.loss, sim, rtol=1e-5)
    assert_same_params(hist.params, server.values, sorted(hist.params))


def test_sync_one_reader_two_gpu_trainers_uneven_micro_batches_equal_single_process():
    """N:M routing with M > N: micro-batch k of cpu:0 goes to gpu:(k mod 2) and its gradients come
    back; 100 examples in 3 micro-batches (33, 33, 34) check the loss-gradient scaling."""
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.2))
    data = SyntheticCTR(vocab=1000, seed=4)
    hist = train(
        model.main,
        data,
        steps=6,
        batch_size=100,
        trainers={"cpu": 1, "gpu": 2},
        micro_batches=3,
        allow_emulation=True,
        return_params=True,
    )
    want = single_process(model, [data.batch(t, 100) for t in range(6)])
    assert_same_params(hist.params, want, sorted(hist.params))
    assert [hist.trainers[f"gpu:{i}"]["items"] for i in (0, 1)] == [12, 6]


def test_async_until_loss_stops_and_learns():
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.Adam(lr=0.01))
    data = SyntheticCTR(vocab=1000, seed=5)
    hist = train(
        model.main, data, until_loss=0.6, steps=400, batch_size=256, mode="async", allow_emulation=True
    )
    assert 10 <= hist.steps < 400
    assert np.mean(hist.loss[-10:]) <= 0.6 + 0.03  # up to LOOKAHEAD-1 steps past the target's step
    assert np.mean(hist.loss[:10]) > 0.6
    assert hist.auc_over(10) > 0.7


def test_sigkill_of_a_trainer_is_reported_within_10s_and_nothing_remains():
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.1))
    eng, killed = LocalEngine(), []

    def kill_gpu(record):
        if record["step"] == 2 and not killed:
            os.kill(eng.pids()["gpu:0"], signal.SIGKILL)
            killed.append(time.perf_counter())

    with pytest.raises(TrainingError) as err:
        train(
            model.main,
            SyntheticCTR(vocab=1000),
            steps=10_000,
            batch_size=128,
            engine=eng,
            allow_emulation=True,
            callback=kill_gpu,
        )
    assert time.perf_counter() - killed[0] < 10
    assert err.value.who == "gpu:0" and "SIGKILL" in str(err.value)
    assert not alive(eng.pids().values())


def test_trainer_exception_is_raised_with_its_traceback():
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.1))
    bad = SyntheticCTR(vocab=1000)
    batches = [bad.batch(0, 64), {**bad.batch(1, 64), "dense": np.zeros((64, 13), np.int64)}]
    eng = LocalEngine()
    with pytest.raises(TrainingError) as err:
        train(model.main, batches, epochs=1, engine=eng, allow_emulation=True)
    assert err.value.who.startswith("cpu:")
    assert "Traceback" in str(err.value) and "feed 'dense' has dtype int64" in str(err.value)
    assert not alive(eng.pids().values())


def test_ctrl_c_in_the_driver_tears_the_run_down():
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.1))
    eng = LocalEngine()

    def interrupt(record):
        if record["step"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(
            model.main,
            SyntheticCTR(vocab=1000),
            steps=10_000,
            batch_size=64,
            engine=eng,
            allow_emulation=True,
            callback=interrupt,
        )
    assert len(eng.pids()) == 4 and not alive(eng.pids().values())


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is present: nothing to refuse")
def test_gpu_trainer_without_cuda_is_refused_before_any_process_starts():
    model = wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1))
    eng = LocalEngine()
    with pytest.raises(RuntimeError, match="allow_emulation=True"):
        train(model.main, SyntheticCTR(vocab=100), steps=1, batch_size=8, engine=eng)
    assert eng.pids() == {}


def test_bad_arguments_are_refused_up_front():
    model = wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1))
    data = SyntheticCTR(vocab=100)
    with pytest.raises(ValueError, match="end condition"):
        train(model.main, data, batch_size=8, allow_emulation=True)
    with pytest.raises(ValueError, match="exactly the plan's trainer types"):
        train(model.main, data, steps=1, batch_size=8, trainers={"cpu": 1}, allow_emulation=True)
    with pytest.raises(TypeError, match="one-shot iterator"):
        train(model.main, iter([data.batch(0, 8)]), steps=1, allow_emulation=True)
    with pytest.raises(ValueError, match="batch_size"):
        train(model.main, data, steps=1, allow_emulation=True)


def held_out_auc(model, params: dict, data: SyntheticCTR, n: int = 20000) -> float:
    from runtime.evaluation.metrics import auc
    from transpiler import inference_program

    exe = Executor()
    exe.scope.update(params)
    b = data.batch(10**6, n)
    (pred,) = exe.run(
        inference_program(model.main, [model.pred]),
        feed={k: b[k] for k in model.feeds if k != "label"},
        fetch_list=[model.pred],
    )
    return auc(b["label"], pred)


@pytest.mark.slow
def test_async_reaches_the_auc_of_sync_after_the_same_examples():
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.Adam(lr=0.003))
    data = SyntheticCTR(vocab=1000, seed=11)
    aucs = {}
    for mode in ("sync", "async"):
        hist = train(
            model.main,
            data,
            steps=400,
            batch_size=256,
            mode=mode,
            servers=2,
            allow_emulation=True,
            return_params=True,
        )
        aucs[mode] = held_out_auc(model, hist.params, data)
    assert aucs["sync"] > 0.75, aucs
    assert abs(aucs["async"] - aucs["sync"]) <= 0.01, aucs
