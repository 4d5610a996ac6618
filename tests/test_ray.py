"""The Ray engine on a local Ray instance (one per test session, `ray_local` in conftest.py).

The oracle is the local engine: in sync mode both must train to the same parameters on the same
batches (the runtime's own tests tie the local engine to single-process training). The Ray
cluster has 4 logical CPUs and ONE `gpu_trainer` resource, so placement by resource requests is
visible: one emulated gpu trainer is placed, a second one cannot be.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from procs import wait_dead

from runtime import TrainingError, train
from runtime.data import SyntheticCTR
from runtime.engines import RayEngine
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def plan():
    return transpile(wide_deep(vocab=500, dim=8, hidden=(32, 16), optimizer=nn.SGD(lr=0.2)).main)


def test_sync_training_on_ray_equals_the_local_engine(plan, ray_local):
    data = SyntheticCTR(vocab=500, seed=4)
    kw = dict(steps=8, batch_size=128, trainers={"cpu": 2, "gpu": 1}, servers=1, mode="sync",
              micro_batches=2, allow_emulation=True, return_params=True)
    eng = RayEngine(gpu_resource="gpu_trainer")
    on_ray = train(plan, data, engine=eng, **kw)
    local = train(plan, data, engine="local", **kw)
    assert on_ray.steps == local.steps == 8
    np.testing.assert_allclose(on_ray.loss, local.loss, rtol=1e-5)
    assert sorted(on_ray.params) == sorted(local.params) and len(local.params) == 8
    for name, want in local.params.items():
        np.testing.assert_allclose(on_ray.params[name], want, rtol=1e-5, atol=1e-7, err_msg=name)
    assert on_ray.loss[-1] != on_ray.loss[0]  # it trained: the comparison is not of two no-ops
    # every process was an actor with a tcp address on the Ray node, and none survives
    node = ray_local.nodes()[0]["NodeManagerAddress"]
    assert node == "127.0.0.1"  # a local Ray stays on loopback (conftest / RayEngine)
    assert set(eng.addresses) == {"ps:0", "cpu:0", "cpu:1", "gpu:0"}
    assert all(a.startswith(f"tcp://{node}:") for a in eng.addresses.values()), eng.addresses
    assert set(on_ray.trainers) == {"cpu:0", "cpu:1", "gpu:0"}
    assert not wait_dead(eng.pids().values())


def test_gpu_trainers_ask_ray_for_the_gpu_resource(plan):
    """The cluster has one `gpu_trainer`: two gpu trainers cannot fit, which is said before any
    actor starts; a resource the cluster lacks is refused too."""
    data = SyntheticCTR(vocab=500)
    eng = RayEngine(gpu_resource="gpu_trainer")
    with pytest.raises(RuntimeError, match=r"cannot fit.*'gpu_trainer': '2 asked, 1 in the cluster'"):
        train(plan, data, steps=1, batch_size=16, trainers={"cpu": 1, "gpu": 2}, engine=eng,
              allow_emulation=True)
    assert eng.pids() == {}
    with pytest.raises(RuntimeError, match="resource 'tpu_trainer', which this cluster lacks"):
        train(plan, data, steps=1, batch_size=16, trainers={"cpu": 1, "gpu": 1},
              engine=RayEngine(gpu_resource="tpu_trainer"), allow_emulation=True)


def test_a_killed_actor_is_reported_within_15s_and_the_run_is_torn_down(plan):
    eng, killed = RayEngine(), []

    def kill_gpu(record):
        if record["step"] == 2 and not killed:
            os.kill(eng.pids()["gpu:0"], signal.SIGKILL)
            killed.append(time.perf_counter())

    with pytest.raises(TrainingError) as err:
        train(plan, SyntheticCTR(vocab=500), steps=100_000, batch_size=64, trainers={"cpu": 1, "gpu": 1},
              engine=eng, allow_emulation=True, callback=kill_gpu)
    took = time.perf_counter() - killed[0]
    assert took < 15, f"reported {took:.1f} s after the kill"
    assert err.value.who == "gpu:0" and "Ray actor is lost" in str(err.value)
    assert not wait_dead(eng.pids().values())
