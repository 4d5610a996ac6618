"""Checks that need a CUDA GPU (cupy): skipped without one, unless HETPS_REQUIRE_CUDA is set
(benchmarks/gpu_check.sh sets it), in which case they fail, so a GPU check cannot pass by skipping.

References: numpy on the CPU (the same kernels' host results) and single-process training with
hetps's Executor, which sync training must equal (tests/runtime/driver/test_runtime_train.py does the
same with the gpu trainer emulated on numpy; tests/runtime/exec/test_fake_device.py on a strict cupy
stand-in)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_runtime_train import assert_same_params, single_process

from ops_registry import get_op
from runtime import train
from runtime.data import SyntheticCTR
from runtime.exec.device import array_module, cuda_available
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep

pytestmark = pytest.mark.skipif(
    not cuda_available() and not os.environ.get("HETPS_REQUIRE_CUDA"),
    reason="no CUDA device (cupy); benchmarks/gpu_check.sh runs these on one",
)


def test_gpu_trainer_type_gets_cupy_on_a_cuda_device():
    xp, desc = array_module("gpu")
    assert xp.__name__ == "cupy" and "CUDA device" in desc, desc


@pytest.mark.parametrize(
    "op, ins, attrs",
    [
        ("matmul", {"A": (64, 48), "B": (48, 32)}, {}),
        ("gemm", {"A": (64, 48), "B": (48, 32), "C": (32,)}, {}),
        ("relu", {"X": (64, 48)}, {}),
        ("sigmoid_cross_entropy_with_logits", {"X": (64, 1), "Label": (64, 1)}, {}),
    ],
)
def test_kernels_on_cupy_match_numpy(op, ins, attrs):
    import cupy

    rng = np.random.default_rng(0)
    host = {k: rng.normal(size=s).astype(np.float32) for k, s in ins.items()}
    if "Label" in host:
        host["Label"] = (host["Label"] > 0).astype(np.float32)
    opdef = get_op(op)
    want = opdef.kernel(np, dict(host), {**opdef.attrs, **attrs})
    got = opdef.kernel(cupy, {k: cupy.asarray(v) for k, v in host.items()}, {**opdef.attrs, **attrs})
    for slot, w in want.items():
        np.testing.assert_allclose(cupy.asnumpy(got[slot]), w, rtol=1e-4, atol=1e-5, err_msg=slot)


def test_sync_training_with_a_real_gpu_trainer_equals_single_process():
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.2))
    data = SyntheticCTR(vocab=1000, seed=3)
    hist = train(
        model.main,
        data,
        steps=10,
        batch_size=256,
        trainers={"cpu": 1, "gpu": 1},
        servers=1,
        mode="sync",
        micro_batches=2,
        allow_emulation=False,
        return_params=True,
    )
    want = single_process(model, [data.batch(t, 256) for t in range(10)])
    tables = [t.name for t in transpile(model.main).tables]
    assert_same_params(hist.params, want, tables)


def test_two_gpu_types_on_one_device_train_with_device_to_device_tensors():
    """The MLP on `gpu`, the loss on `gpu2`, one CUDA device: the logits and their gradient go
    between the two through CUDA IPC buffers (runtime/trainer/ipc.py), the run equals one process."""
    from transpiler import TranspileConfig

    cfg = TranspileConfig(
        trainer_types=["cpu", "gpu", "gpu2"],
        category_map={"io": "cpu", "sparse": "cpu", "dense": "gpu", "loss": "gpu2"},
    )
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.2))
    data, plan = SyntheticCTR(vocab=1000, seed=3), transpile(model.main, cfg)
    hist = train(
        plan,
        data,
        steps=6,
        batch_size=256,
        trainers={"cpu": 1, "gpu": 1, "gpu2": 1},
        servers=1,
        mode="sync",
        micro_batches=2,
        allow_emulation=False,
        return_params=True,
    )
    want = single_process(model, [data.batch(t, 256) for t in range(6)])
    assert_same_params(hist.params, want, [t.name for t in plan.tables])
    for t in ("gpu:0", "gpu2:0"):  # (one tensor each way per micro-batch)
        assert hist.trainers[t]["ipc_recv"] == 12 and hist.trainers[t]["ipc_sent"] == 12, hist.trainers[t]


def test_boundary_copies_go_through_pinned_buffers_on_a_copy_stream():
    """`Copies` on real cupy: values arrive intact whichever way, kernels after a copy see it, and
    the crossings are counted."""
    import cupy

    from runtime.exec.device import CROSSINGS, Copies

    copies, before = Copies(cupy), CROSSINGS.as_dict()
    rng = np.random.default_rng(0)
    host = [rng.normal(size=(512, 416)).astype(np.float32) for _ in range(4)]
    devs = [copies.to_device(h) for h in host]  # enqueued on the copy stream, one after the other
    for h, d in zip(host, devs, strict=True):
        np.testing.assert_array_equal(copies.to_host(d * 2), h * 2)
    assert CROSSINGS.h2d - before["h2d"] == 4 and CROSSINGS.d2h - before["d2h"] == 4
    assert CROSSINGS.h2d_bytes - before["h2d_bytes"] == sum(h.nbytes for h in host)


def test_held_tables_step_on_the_device_as_on_the_host():
    """HeldTables with cupy: Adam steps on the device equal the numpy HeldTables' steps."""
    import cupy
    from test_held_dense import _ShardClient, _specs

    from runtime.ps.held_tables import HeldTables
    from runtime.ps.shard import Shard

    rng = np.random.default_rng(1)
    grads = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(4)]
    states = []
    for xp in (np, cupy):
        shard = Shard(_specs({"type": "adam", "lr": 0.1}), mode="async")
        held = HeldTables(_ShardClient(shard), ["w"], start=0, sync=False, xp=xp)
        for t, g in enumerate(grads):
            held.apply({"w": xp.asarray(g)}, t)
        states.append(held._host_states()["w"])
    for k, want in states[0].items():
        np.testing.assert_allclose(states[1][k], want, rtol=1e-5, atol=1e-7, err_msg=k)


def test_a_program_replayed_as_a_cuda_graph_equals_numpy():
    """runtime.exec.graphs on real cupy: the small MLP of test_device_graphs.py captured once and
    replayed (a capture that fails on this GPU fails here, saying why), equal to numpy by hand."""
    import cupy
    from test_device_graphs import _batch, _by_hand, _mlp

    from runtime.exec.executor import Executor
    from runtime.exec.graphs import DeviceGraphs

    main, params, y, _ = _mlp()
    exe = Executor(cupy, graphs=DeviceGraphs(cupy))
    exe.scope.update({n: cupy.asarray(v) for n, v in params.items()})
    for t in range(5):
        x = _batch(t)
        (got,) = exe.run(main, feed={"x": x}, fetch_list=[y])
        np.testing.assert_allclose(got, _by_hand(params, x)[1], rtol=1e-5, atol=1e-6)
    stats = exe.graphs.stats
    assert not stats.refused and (stats.captured, stats.replays) == (1, 4), stats
