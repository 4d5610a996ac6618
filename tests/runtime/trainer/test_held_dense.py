"""Dense tables held by the one trainer that uses them (transpiler/passes/held.py, runtime/ps/held_tables.py).

Which tables qualify (by hand from each plan), the shard's side of the protocol (hold, refusals
while held, checked write-backs that count as applied steps), and whole runs: a sync run with held
tables equals the untranspiled program in one process (the Executor) at every checkpoint and at
the end, with no dense request from the holder to the servers in its trace."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from runtime import Executor, train
from runtime.data import SyntheticCTR
from runtime.driver.checkpoints import checkpoints
from runtime.ps import PSError, Servers, Shard
from runtime.ps import held_tables as ps_hold
from transpiler import TranspileConfig, transpile
from transpiler import builder as nn
from transpiler.models import wide_deep
from transpiler.passes.held import held_dense
from transpiler.tables import tables_from_dicts

VOCAB = 200
MLP = ["fc_0.b_0", "fc_0.w_0", "fc_1.b_0", "fc_1.w_0"]  # wide_deep(hidden=(8,)): the gpu type's tables


def model(optimizer=None):
    return wide_deep(num_slots=4, vocab=VOCAB, dim=4, hidden=(8,), optimizer=optimizer or nn.Adam(lr=0.02))


# -- which tables --------------------------------------------------------------------------------
def test_the_dense_tables_of_a_single_trainer_are_held_and_no_others():
    plan = transpile(model().main)
    # by hand: the gpu program pulls and pushes the 4 MLP tables, the cpu program only sparse rows
    assert held_dense(plan.programs, plan.tables, {"cpu": 2, "gpu": 1}) == dict.fromkeys(MLP, "gpu")
    # two gpu trainers push each MLP table every step: the servers must sum them
    assert held_dense(plan.programs, plan.tables, {"cpu": 1, "gpu": 2}) == {}
    # clipped by global norm: the servers clip, so they keep the tables
    clipped = transpile(model(nn.SGD(lr=0.1, grad_clip_norm=1.0)).main)
    assert held_dense(clipped.programs, clipped.tables, {"cpu": 1, "gpu": 1}) == {}


def test_dense_tables_on_the_reader_type_are_held_by_a_single_reader():
    plan = transpile(model().main, TranspileConfig(name_devices={"*": "cpu"}))
    assert list(plan.programs) == ["cpu"]  # everything on the reader
    assert held_dense(plan.programs, plan.tables, {"cpu": 1}) == dict.fromkeys(MLP, "cpu")
    assert held_dense(plan.programs, plan.tables, {"cpu": 2}) == {}
    # the reader holds them: a sync run still equals one process (it starts step t + 1 after its push)
    data = SyntheticCTR(vocab=VOCAB, num_slots=4, seed=4)
    hist = train(
        plan,
        data,
        steps=5,
        batch_size=32,
        trainers={"cpu": 1},
        mode="sync",
        micro_batches=2,
        progress=False,
        return_params=True,
    )
    want = _single_process(model(), [data.batch(t, 32) for t in range(5)])
    for name in MLP:
        np.testing.assert_allclose(hist.params[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


# -- the shard's side ------------------------------------------------------------------------------
def _specs(optimizer):
    return tables_from_dicts(
        [
            {
                "name": "w",
                "kind": "dense",
                "shape": [3, 2],
                "dtype": "float32",
                "initializer": {"type": "constant", "value": 1.0},
                "optimizer": optimizer,
            },
            {
                "name": "frozen",
                "kind": "dense",
                "shape": [2],
                "dtype": "float32",
                "initializer": {"type": "constant", "value": 1.0},
                "optimizer": None,
            },
            {
                "name": "emb",
                "kind": "sparse",
                "shape": [10, 2],
                "dtype": "float32",
                "initializer": {"type": "constant", "value": 0.0},
                "optimizer": {"type": "sgd", "lr": 0.1},
            },
        ]
    )


def test_a_held_table_refuses_pushes_and_pulls_and_loads_checked_write_backs():
    shard = Shard(_specs({"type": "adam", "lr": 0.1}), mode="sync")
    state = ps_hold.hold(shard, "w")
    assert sorted(state) == ["Beta1Pow", "Beta2Pow", "Moment1", "Moment2", "Param"]
    np.testing.assert_array_equal(state["Param"], np.ones((3, 2), np.float32))
    for call in (
        lambda: shard.push("w", np.ones((3, 2), np.float32), step=0),
        lambda: shard.pull("w", step=0),
    ):
        with pytest.raises(PSError, match="the trainer that updates it holds it"):
            call()
    np.testing.assert_array_equal(shard.pull("w", peek=True), np.ones((3, 2)))  # evaluation may read
    with pytest.raises(PSError, match="held already"):
        ps_hold.hold(shard, "w")
    for why, other in (("not a dense table", "emb"), ("frozen", "frozen")):
        with pytest.raises(PSError, match=why):
            ps_hold.hold(shard, other)

    # the holder's 3 Adam steps, by hand: what it writes back
    new = {k: np.array(v) for k, v in state.items()}
    new["Param"] -= 0.3
    new["Moment1"] += 0.1
    new["Beta1Pow"] *= 0.9**3
    keys, arrays = list(new), list(new.values())
    bad = [
        (["Param"], [new["Param"]], 3, "arrays"),
        (keys, [a.reshape(-1) if k == "Moment1" else a for k, a in new.items()], 3, "shape"),
        (keys, [np.full_like(a, np.nan) if k == "Param" else a for k, a in new.items()], 3, "NaN"),
        (keys[:-1] + ["Velocity"], arrays, 3, "arrays"),
    ]
    for k, a, steps, why in bad:
        with pytest.raises(PSError, match=why):
            ps_hold.write_back(shard, "w", k, a, steps, False)
        np.testing.assert_array_equal(shard.pull("w", peek=True), np.ones((3, 2)))  # nothing loaded
    ps_hold.write_back(shard, "w", keys, arrays, 3, False)
    np.testing.assert_allclose(shard.pull("w", peek=True), np.full((3, 2), 0.7))
    assert (shard.version["w"], shard.applied["w"]) == (3, 3)  # 3 sync steps, as 3 pushes would
    with pytest.raises(PSError, match="fewer than"):
        ps_hold.write_back(shard, "w", keys, arrays, 2, False)
    ps_hold.write_back(shard, "w", keys, arrays, 5, True)  # the end of the run: released
    assert (shard.version["w"], shard.applied["w"]) == (5, 5)
    shard.push("w", np.ones((3, 2), np.float32), step=5)  # the servers' table again
    assert shard.version["w"] == 6
    with pytest.raises(PSError, match="no trainer holds it"):
        ps_hold.write_back(shard, "w", keys, arrays, 6, True)


class _ShardClient:
    """The two calls HeldTables makes of a PSClient, answered by a Shard in this process."""

    def __init__(self, shard):
        self.shard, self.specs = shard, {s.name: s for s in shard.specs}

    def hold(self, names):
        return {n: ps_hold.hold(self.shard, n) for n in names}


def test_the_holder_reads_its_table_without_a_copy_and_copies_it_only_for_a_later_step():
    shard = Shard(_specs({"type": "sgd", "lr": 0.5}), mode="async")
    held = ps_hold.HeldTables(_ShardClient(shard), ["w"], start=0, sync=False)
    g = np.arange(6, dtype=np.float32).reshape(3, 2)
    v0 = held.pull("w", 0)
    assert not v0.flags.writeable
    held.apply({"w": g}, 0)  # step 0 is done with its view: updated in place, no copy
    want = 1.0 - 0.5 * g
    np.testing.assert_array_equal(held.tables["w"].param, want)
    assert np.shares_memory(v0, held.tables["w"].param)
    v2 = held.pull("w", 2)  # (async: step 2 started before step 1 was applied)
    held.apply({"w": g}, 1)
    np.testing.assert_array_equal(v2, want)  # step 2 keeps the value it was given...
    np.testing.assert_array_equal(held.tables["w"].param, want - 0.5 * g)  # ...the table moves on
    assert not np.shares_memory(v2, held.tables["w"].param)
    held.apply({}, 2)  # no gradient: a zero step
    np.testing.assert_array_equal(held.tables["w"].param, want - 0.5 * g)
    assert held.steps == 3


def test_a_table_two_trainers_push_or_one_clipped_is_not_held():
    two = Shard(_specs({"type": "sgd", "lr": 0.1}), mode="sync", pushes_per_step=2)
    with pytest.raises(PSError, match="2 trainers push it each step"):
        ps_hold.hold(two, "w")
    specs = [s if s.name != "w" else replace(s, clip_norm=1.0) for s in _specs({"type": "sgd", "lr": 0.1})]
    with pytest.raises(PSError, match="clipped by global norm"):
        ps_hold.hold(Shard(specs, mode="sync"), "w")


def test_hold_and_write_back_through_a_server_refuse_a_second_client():
    with (
        Servers(_specs({"type": "sgd", "lr": 0.5}), mode="async", secret=b"k" * 32) as servers,
        servers.client() as holder,
        servers.client() as other,
    ):
        state = holder.hold(["w"])["w"]
        with pytest.raises(PSError, match="holds it"):
            other.push("w", np.ones((3, 2), np.float32))
        with pytest.raises(PSError, match="another client holds it"):  # only the holder writes it back
            other.write_back({"w": state}, 1, final=True)
        state["Param"] = state["Param"] - 0.5  # one SGD step of a gradient of ones, by hand
        holder.write_back({"w": state}, 1, final=True)
        np.testing.assert_allclose(other.pull("w"), np.full((3, 2), 0.5))
        assert other.stats()[0]["w"]["applied"] == 1


# -- whole runs -------------------------------------------------------------------------------------
def _single_process(m, batches):
    exe = Executor()
    exe.run(m.startup)
    for b in batches:
        exe.run(m.main, feed=b)
    return exe.scope


def _checkpoint_params(path, names):
    """A checkpoint's dense parameters, read with numpy from its files."""
    doc = json.loads((path / "manifest.json").read_text())
    out = {}
    for e in doc["files"]:
        if e["table"] in names:
            with np.load(path / e["file"]) as f:
                out[e["table"]] = f["Param"]
    return out


def test_a_sync_run_with_held_tables_equals_one_process_at_every_checkpoint(tmp_path):
    m, data = model(), SyntheticCTR(vocab=VOCAB, num_slots=4, seed=5)
    trace = tmp_path / "trace.json"
    hist = train(
        m.main,
        data,
        steps=12,
        batch_size=64,
        trainers={"cpu": 2, "gpu": 1},
        mode="sync",
        micro_batches=2,
        allow_emulation=True,
        progress=False,
        return_params=True,
        checkpoint=str(tmp_path / "ckpt"),
        checkpoint_every=5,
        keep=5,
        trace=str(trace),
    )
    batches = [data.batch(t, 64) for t in range(12)]
    for step, path in [(int(p.name.split("-")[1]), p) for p in checkpoints(tmp_path / "ckpt")]:
        want = _single_process(model(), batches[:step])
        for name, got in _checkpoint_params(path, MLP).items():
            np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6, err_msg=f"{name} at {step}")
    assert sorted(int(p.name.split("-")[1]) for p in checkpoints(tmp_path / "ckpt")) == [5, 10, 12]
    want = _single_process(model(), batches)
    for name in MLP + ["deep_emb.w_0"]:
        np.testing.assert_allclose(hist.params[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # the holder never asked the servers for its tables; it wrote them back before each save
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("args", {}).get("name") == "gpu:0"}
    names = [e["name"] for e in spans if e["pid"] in gpu]
    assert "pull dense" not in names and "push" not in names, sorted(set(names))
    assert names.count("apply") == 12
    assert [e["args"]["step"] for e in spans if e["pid"] in gpu and e["name"] == "write back"] == [4, 9, 11]


def test_the_servers_path_is_kept_on_request_and_trains_alike():
    m, data = model(nn.SGD(lr=0.2)), SyntheticCTR(vocab=VOCAB, num_slots=4, seed=6)
    runs = [
        train(
            m.main,
            data,
            steps=6,
            batch_size=64,
            trainers={"cpu": 1, "gpu": 1},
            mode="sync",
            micro_batches=1,
            allow_emulation=True,
            progress=False,
            return_params=True,
            dense_on_trainer=held,
        )
        for held in (True, False)
    ]
    assert runs[0].loss == runs[1].loss  # sync: the same arithmetic, to the bit
    for name in MLP:
        np.testing.assert_array_equal(runs[0].params[name], runs[1].params[name])


def test_two_gpu_trainers_share_the_mlp_through_the_servers_and_each_gets_items():
    # not held (two trainers push each table); the default micro-batches (2 here: one per gpu trainer)
    m, data = model(nn.SGD(lr=0.2)), SyntheticCTR(vocab=VOCAB, num_slots=4, seed=7)
    hist = train(
        m.main,
        data,
        steps=4,
        batch_size=64,
        trainers={"cpu": 1, "gpu": 2},
        mode="sync",
        allow_emulation=True,
        progress=False,
        return_params=True,
    )
    assert [hist.trainers[f"gpu:{i}"]["items"] for i in (0, 1)] == [4, 4]
    want = _single_process(model(nn.SGD(lr=0.2)), [data.batch(t, 64) for t in range(4)])
    for name in MLP:
        np.testing.assert_allclose(hist.params[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
