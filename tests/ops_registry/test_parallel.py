"""Matrix products over several threads (ops_registry/parallel.py) against numpy's own `@`, the
gemm / matmul kernels and their gradients with 2 threads against numpy by hand, and a run with
`kernel_threads` against single-process training (sync training must equal it)."""

from __future__ import annotations

import threading
from contextlib import closing

import numpy as np
import pytest
from test_runtime_train import assert_same_params, single_process

from ops_registry import get_op, parallel
from runtime import train
from runtime.data import SyntheticCTR
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep

RNG = np.random.default_rng(0)


def _pair(m, k, n, dtype=np.float32):
    return RNG.normal(size=(m, k)).astype(dtype), RNG.normal(size=(k, n)).astype(dtype)


@pytest.fixture
def pool():
    p = parallel.Pool(3)
    yield p
    p.close()


@pytest.mark.parametrize("m, k, n", [(512, 429, 400), (301, 257, 199), (7, 3000, 3000)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_equal_numpys(pool, m, k, n, dtype):
    a, b = _pair(m, k, n, dtype)
    got = pool.matmul(a, b)
    assert got.dtype == (a @ b).dtype and got.shape == (m, n)
    np.testing.assert_allclose(got, a @ b, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-3)


def test_transposed_and_strided_operands(pool):
    a, b = _pair(400, 512, 300)
    for x, y in [(a.T.T, b), (b.T, a.T), (a[:, ::2], b[::2]), (np.asfortranarray(a), b)]:
        np.testing.assert_allclose(pool.matmul(x, y), x @ y, rtol=1e-5, atol=1e-3)


def test_small_products_and_one_thread_use_the_caller_alone():
    a, b = _pair(16, 16, 16)
    with closing(parallel.Pool(2)) as p:
        np.testing.assert_array_equal(p.matmul(a, b), a @ b)
    a, b = _pair(512, 400, 400)
    with closing(parallel.Pool(1)) as p:
        np.testing.assert_array_equal(p.matmul(a, b), a @ b)


def test_concurrent_callers_each_get_their_own_product(pool):
    # the pool posts one job at a time: a helper may miss a caller's job, whose caller then
    # computes every chunk itself — no product may be lost, mixed up or left waiting
    pairs = [_pair(512, 300 + 10 * i, 200) for i in range(6)]
    got: dict[int, np.ndarray] = {}

    def run(i):
        for _ in range(5):
            got[i] = pool.matmul(*pairs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for i, (a, b) in enumerate(pairs):
        np.testing.assert_allclose(got[i], a @ b, rtol=1e-5, atol=1e-3)


def test_a_failing_product_raises_in_the_caller(pool):
    a, _ = _pair(512, 400, 400)
    b = RNG.normal(size=(300, 400)).astype(np.float32)  # contracted dims differ
    with pytest.raises(ValueError, match="mismatch"):
        pool.matmul(a, b)
    a, b = _pair(512, 400, 400)
    np.testing.assert_allclose(pool.matmul(a, b), a @ b, rtol=1e-5, atol=1e-3)  # still serves


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_thread_counts_are_checked(bad):
    with pytest.raises(ValueError, match="positive int"):
        parallel.set_threads(bad)
    assert parallel.threads() == 1


@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_and_its_gradients_on_two_threads(trans_a, trans_b):
    a, b = _pair(512, 300, 256)
    a_in, b_in = (a.T.copy() if trans_a else a), (b.T.copy() if trans_b else b)
    c, g = RNG.normal(size=256).astype(np.float32), RNG.normal(size=(512, 256)).astype(np.float32)
    op = get_op("gemm")
    attrs = {**op.attrs, "transA": trans_a, "transB": trans_b}
    ins = {"A": a_in, "B": b_in, "C": c}
    parallel.set_threads(2)
    try:
        y = op.kernel(np, ins, attrs)["Y"]
        grads = op.vjp(np, ins, {"Y": y}, {"Y": g}, attrs)
    finally:
        parallel.set_threads(1)
    np.testing.assert_allclose(y, a @ b + c, rtol=1e-4, atol=1e-3)
    ga, gb = g @ b.T, a.T @ g  # by hand: dY/dA = G B^T, dY/dB = A^T G (then transposed back)
    np.testing.assert_allclose(grads["A"], ga.T if trans_a else ga, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(grads["B"], gb.T if trans_b else gb, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(grads["C"], g.sum(0), rtol=1e-4, atol=1e-3)


def test_matmul_op_and_its_gradients_on_two_threads():
    a, b = _pair(512, 300, 256)
    g = RNG.normal(size=(512, 256)).astype(np.float32)
    op = get_op("matmul")
    parallel.set_threads(2)
    try:
        y = op.kernel(np, {"A": a, "B": b}, op.attrs)["Y"]
        grads = op.vjp(np, {"A": a, "B": b}, {"Y": y}, {"Y": g}, op.attrs)
    finally:
        parallel.set_threads(1)
    np.testing.assert_allclose(y, a @ b, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(grads["A"], g @ b.T, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(grads["B"], a.T @ g, rtol=1e-4, atol=1e-3)


def test_sync_training_with_kernel_threads_equals_single_process():
    # an MLP wide enough that its products use the pool (> parallel.MIN_FLOPS at 128 rows)
    model = wide_deep(vocab=500, dim=8, hidden=(400, 400), optimizer=nn.SGD(lr=0.1))
    data = SyntheticCTR(vocab=500, seed=4)
    hist = train(
        model.main,
        data,
        steps=4,
        batch_size=256,
        trainers={"cpu": 1, "gpu": 1},
        servers=1,
        mode="sync",
        micro_batches=2,
        allow_emulation=True,
        return_params=True,
        kernel_threads={"gpu": 2},
    )
    assert hist.trainers["gpu:0"]["kernel_threads"] == 2 and hist.trainers["cpu:0"]["kernel_threads"] == 1
    want = single_process(model, [data.batch(t, 256) for t in range(4)])
    assert_same_params(hist.params, want, [t.name for t in transpile(model.main).tables])


@pytest.mark.parametrize("threads, match", [({"tpu": 2}, "trainer type 'tpu'"), ({"gpu": 0}, "positive int")])
def test_train_checks_kernel_threads(threads, match):
    model = wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1))
    with pytest.raises(ValueError, match=match):
        train(
            model.main,
            SyntheticCTR(vocab=100),
            steps=1,
            batch_size=8,
            allow_emulation=True,
            kernel_threads=threads,
        )
