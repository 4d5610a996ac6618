"""The Ray engine on a local Ray instance (one per test session, `ray_local` in conftest.py).

The oracle is the local engine: in sync mode both must train to the same parameters on the same
batches (the runtime's own tests tie the local engine to single-process training). The Ray
cluster has 4 logical CPUs and ONE `gpu_trainer` resource, so placement by resource requests is
visible: one emulated gpu trainer is placed, a second one cannot be.

Two nodes: `two_node_run` (run in a child process, as a driver can join one Ray cluster only and
this process holds `ray_local`) starts a two-node cluster on this machine with
`ray.cluster_utils.Cluster`: the head offers a custom resource `head` (the server and the cpu
trainer ask for it), the second node the two `gpu_trainer` units the gpu trainers ask for. It
trains until step 3, then kills every process of the second node (`remove_node`, no grace).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
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


@pytest.fixture(scope="module")
def plan():
    return transpile(wide_deep(vocab=500, dim=8, hidden=(32, 16), optimizer=nn.SGD(lr=0.2)).main)


@pytest.mark.usefixtures("ray_local")
def test_sync_training_on_ray_equals_the_local_engine(plan, ray_local):
    data = SyntheticCTR(vocab=500, seed=4)
    kw = dict(
        steps=8,
        batch_size=128,
        trainers={"cpu": 2, "gpu": 1},
        servers=1,
        mode="sync",
        micro_batches=2,
        allow_emulation=True,
        return_params=True,
    )
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


@pytest.mark.usefixtures("ray_local")
def test_gpu_trainers_ask_ray_for_the_gpu_resource(plan):
    """The cluster has one `gpu_trainer`: two gpu trainers cannot fit, which is said before any
    actor starts; a resource the cluster lacks is refused too."""
    data = SyntheticCTR(vocab=500)
    eng = RayEngine(gpu_resource="gpu_trainer")
    with pytest.raises(RuntimeError, match=r"cannot fit.*'gpu_trainer': '2 asked, 1 in the cluster'"):
        train(
            plan,
            data,
            steps=1,
            batch_size=16,
            trainers={"cpu": 1, "gpu": 2},
            engine=eng,
            allow_emulation=True,
        )
    assert eng.pids() == {}
    with pytest.raises(RuntimeError, match="resource 'tpu_trainer', which this cluster lacks"):
        train(
            plan,
            data,
            steps=1,
            batch_size=16,
            trainers={"cpu": 1, "gpu": 1},
            engine=RayEngine(gpu_resource="tpu_trainer"),
            allow_emulation=True,
        )


@pytest.mark.usefixtures("ray_local")
def test_a_killed_actor_is_reported_within_15s_and_the_run_is_torn_down(plan):
    eng, killed = RayEngine(), []

    def kill_gpu(record):
        if record["step"] == 2 and not killed:
            os.kill(eng.pids()["gpu:0"], signal.SIGKILL)
            killed.append(time.perf_counter())

    with pytest.raises(TrainingError) as err:
        train(
            plan,
            SyntheticCTR(vocab=500),
            steps=100_000,
            batch_size=64,
            trainers={"cpu": 1, "gpu": 1},
            engine=eng,
            allow_emulation=True,
            callback=kill_gpu,
        )
    took = time.perf_counter() - killed[0]
    assert took < 15, f"reported {took:.1f} s after the kill"
    assert err.value.who == "gpu:0" and "Ray actor is lost" in str(err.value)
    assert not wait_dead(eng.pids().values())


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(
    "victim, probe", [("gpu:0", False), ("ps:0", True)], ids=["driver-node-proc", "probe-task-on-node"]
)
def test_a_stopped_actor_is_the_one_named_within_seconds(plan, monkeypatch, victim, probe):
    # Before the fix, a SIGSTOPped actor was noticed only by a trainer's stall timeout (60 s), which
    # named the trainer that waited on it. `probe`: treat the actors as on another node than the
    # driver's, so their state is read by the probe task Ray runs on their node.
    if probe:
        monkeypatch.setattr(RayEngine, "_driver_node", lambda self: None)
    eng, stopped = RayEngine(), []

    def stop(record):
        if record["step"] == 2 and not stopped:
            os.kill(eng.pids()[victim], signal.SIGSTOP)
            stopped.append(time.perf_counter())

    try:
        with pytest.raises(TrainingError) as err:
            train(
                plan,
                SyntheticCTR(vocab=500),
                steps=100_000,
                batch_size=64,
                trainers={"cpu": 1, "gpu": 1},
                engine=eng,
                allow_emulation=True,
                callback=stop,
                progress=False,
                stall_timeout=60.0,
            )
        took = time.perf_counter() - stopped[0]
        assert err.value.who == victim and "is stopped (SIGSTOP" in str(err.value), str(err.value)
        assert ("on Ray node 127.0.0.1" in str(err.value)) == probe, str(err.value)
        assert took < 10, f"reported {took:.1f} s after SIGSTOP"  # 1-3 s here; the old way took >= 60 s
        # the stopped actor is continued and killed at once (without SIGCONT Ray leaves it ~6 s)
        assert not wait_dead([eng.pids()[victim]], timeout=3.0)
        assert not wait_dead(eng.pids().values())
    finally:  # never leave a stopped process behind, whatever failed
        for pid in eng.pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def two_node_run() -> dict:
    """Train on a two-node cluster on this machine, kill the second node at step 3 (see the module
    docstring); what happened, as a dict. Ray's health checks are shortened (0.5 s x 3) so that the
    cluster also marks the node dead within seconds; the report does not wait for that."""
    import ray
    from ray.cluster_utils import Cluster

    checks = {
        "health_check_period_ms": 500,
        "health_check_failure_threshold": 3,
        "health_check_initial_delay_ms": 0,
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=2,
            resources={"head": 2},
            object_store_memory=80 << 20,
            include_dashboard=False,
            _system_config=checks,
        ),
    )
    try:
        second = cluster.add_node(num_cpus=2, resources={"gpu_trainer": 2}, object_store_memory=80 << 20)
        ray.init(address=cluster.address, log_to_driver=False)
        plan = transpile(wide_deep(vocab=500, dim=8, hidden=(32, 16), optimizer=nn.SGD(lr=0.2)).main)
        eng = RayEngine(
            cluster.address, gpu_resource="gpu_trainer", resources={"ps": {"head": 1}, "cpu": {"head": 1}}
        )
        out: dict = {"second_node": second.node_id, "head_node": cluster.head_node.node_id, "losses": []}

        def kill_second_node(record):
            out["losses"].append(record["loss"])
            if record["step"] == 3 and "killed_at" not in out:
                out["nodes"], out["addresses"] = dict(eng.node_of), dict(eng.addresses)
                out["killed_at"] = time.perf_counter()
                cluster.remove_node(second, allow_graceful=False)

        try:
            train(
                plan,
                SyntheticCTR(vocab=500),
                steps=100_000,
                batch_size=64,
                trainers={"cpu": 1, "gpu": 2},
                engine=eng,
                allow_emulation=True,
                callback=kill_second_node,
                progress=False,
            )
        except TrainingError as e:
            out.update(reported_after_s=time.perf_counter() - out["killed_at"], who=e.who, error=str(e))
        out["left_alive"] = wait_dead(eng.pids().values())
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_two_nodes_trainers_placed_by_resources_and_a_lost_node_is_named():
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # (this file's imports: tests/procs.py)
    proc = subprocess.run(
        [sys.executable, __file__, "--two-nodes"], capture_output=True, text=True, timeout=300, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    # placed by resources: the gpu trainers on the second node, the server and cpu trainer on the head
    assert out["nodes"] == {
        "ps:0": out["head_node"],
        "cpu:0": out["head_node"],
        "gpu:0": out["second_node"],
        "gpu:1": out["second_node"],
    }
    # the data plane is tcp on 127.0.0.1, across the two nodes, and it trained up to the kill
    assert all(a.startswith("tcp://127.0.0.1:") for a in out["addresses"].values()), out["addresses"]
    assert len(out["losses"]) >= 4 and all(np.isfinite(out["losses"]))
    # the loss of the node is reported within seconds, naming both trainers that were on it
    assert out["who"] in ("gpu:0", "gpu:1"), out
    assert out["reported_after_s"] < 15, out
    assert "Ray actor is lost" in out["error"] and "lost on Ray node 127.0.0.1" in out["error"]
    assert "gpu:0, gpu:1" in out["error"] and "cpu:0" not in out["error"].split("lost on")[1], out["error"]
    assert out["left_alive"] == []


if __name__ == "__main__" and sys.argv[1:] == ["--two-nodes"]:
    import shutil
    import tempfile

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # as conftest.py: loopback only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # the cluster's sessions and its address file go to a private temp dir, removed afterwards
    os.environ["RAY_TMPDIR"] = tmp = tempfile.mkdtemp(prefix="hetps-ray2-")
    try:
        print("RESULT " + json.dumps(two_node_run()), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
