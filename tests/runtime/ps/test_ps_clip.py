"""Gradient clipping by global norm on the parameter servers (runtime/ps/clip.py), sync mode.

References: numpy by hand (the norm over every pusher's gradient of every clipped table on every
shard, Paddle's scale clip_norm / max(norm, clip_norm), then the SGD step), and the single-process
Executor running the program's own `clip_by_global_norm` op. PaddlePaddle's trajectories on the
servers: tests/test_optim_paddle.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_ps_hostile import Raw
from test_runtime_train import assert_same_params, single_process

from runtime import Executor, InMemoryServer, simulate, train
from runtime.data import SyntheticCTR
from runtime.ps import PSClient, PSError, Servers, Shard
from runtime.ps.shard import NotReady
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep
from transpiler.tables import tables_from_dicts

LR, CLIP, DIM = 0.5, 0.1, 2
ONE = {"type": "constant", "value": 1.0}
SGD = {"type": "sgd", "lr": LR}
SPECS = tables_from_dicts(
    [
        {
            "name": "w",
            "kind": "dense",
            "shape": [3],
            "dtype": "float32",
            "initializer": ONE,
            "optimizer": SGD,
            "clip_norm": CLIP,
        },
        {
            "name": "emb",
            "kind": "sparse",
            "shape": [-1, DIM],
            "dtype": "float32",
            "initializer": ONE,
            "optimizer": SGD,
            "clip_norm": CLIP,
        },
    ]
)
GW = {"a": np.array([0.3, -0.2, 0.1], np.float32), "b": np.array([0.1, 0.4, -0.3], np.float32)}
IDS = {"a": np.array([1, 2, 5]), "b": np.array([2, 7])}  # id 2 from both pushers: summed before squaring
GE = {
    "a": np.array([[0.2, 0.1], [-0.3, 0.2], [0.1, 0.1]], np.float32),
    "b": np.array([[0.4, -0.1], [0.2, 0.3]], np.float32),
}


def _by_hand() -> tuple[float, np.ndarray, dict[int, np.ndarray]]:
    """(global norm, w after the clipped step, emb rows after it) in numpy."""
    gw = GW["a"] + GW["b"]
    ge: dict[int, np.ndarray] = {}
    for p in "ab":
        for i, g in zip(IDS[p], GE[p], strict=True):
            ge[int(i)] = ge.get(int(i), 0) + g.astype(np.float64)
    norm = np.sqrt(np.sum(gw.astype(np.float64) ** 2) + sum(np.sum(g**2) for g in ge.values()))
    scale = CLIP / max(norm, CLIP)
    return norm, 1 - LR * scale * gw, {i: 1 - LR * scale * g for i, g in ge.items()}


@pytest.fixture
def servers():
    with Servers(SPECS, num_shards=2, mode="sync", pushes_per_step=2) as s:
        yield s


def _push_step(servers: Servers, step: int) -> list[PSClient]:
    clients = [PSClient(servers.endpoints, secret=servers.secret, timeout=20, pusher=p) for p in "ab"]
    for c, p in zip(clients, "ab", strict=True):
        c.push_many([("w", GW[p], None), ("emb", GE[p], IDS[p])], step=step)
    return clients


def test_two_shards_two_pushers_apply_the_step_clipped_by_its_global_norm(servers):
    a, b = _push_step(servers, 0)
    try:
        norm, w, rows = _by_hand()
        assert norm > CLIP  # the clip is active
        assert a.clip_step(0, CLIP, "float32") == pytest.approx(norm, rel=1e-6)
        np.testing.assert_allclose(b.pull("w", step=1), w, rtol=1e-6)
        ids = np.array(sorted(rows))
        np.testing.assert_allclose(b.pull("emb", ids, step=1), np.stack([rows[i] for i in ids]), rtol=1e-6)
        assert [s[t]["version"] for s in a.stats() for t in s] == [1, 1, 1]  # emb on both shards, w on one
    finally:
        a.close()
        b.close()


def test_norm_waits_for_every_pusher_and_a_held_step_takes_no_more_pushes():
    shard = Shard(SPECS, mode="sync", pushes_per_step=2)
    shard.push("w", GW["a"], step=0, pusher="a")
    shard.push("emb", GE["a"], IDS["a"], step=0, pusher="a")
    with pytest.raises(NotReady):
        shard.clip_sum_squares(0)
    with pytest.raises(PSError, match=r"tables \['emb', 'w'\] do not hold that step"):
        shard.clip_apply(0, 0.5)
    shard.push("w", GW["b"], step=0, pusher="b")
    shard.push("emb", GE["b"], IDS["b"], step=0, pusher="b")
    assert np.sqrt(shard.clip_sum_squares(0)) == pytest.approx(_by_hand()[0], rel=1e-6)
    with pytest.raises(PSError, match="held for its global-norm clip scale"):
        shard.push("w", GW["b"], step=0, pusher="c")
    np.testing.assert_array_equal(shard.pull("w", step=0), np.ones(3, np.float32))  # nothing applied yet


@pytest.mark.parametrize(
    "bad",
    [
        ({"step": 0, "scale": float("nan")}, "scale nan is not a number in"),
        ({"step": 0, "scale": 1.5}, "scale 1.5 is not a number in"),
        ({"step": 0, "scale": "0.5"}, "scale '0.5' is not a number in"),
        ({"step": 3, "scale": 0.5}, "apply for step 3: tables ['emb', 'w'] do not hold that step"),
        ({"step": -1, "scale": 0.5}, "apply for step -1"),
        ({"scale": 0.5}, "needs field 'step' of type int"),
    ],
)
def test_a_hostile_apply_is_refused_and_changes_nothing(servers, bad):
    fields, error = bad
    clients = _push_step(servers, 0)
    raw = Raw(servers)
    try:
        reply = raw.ask(raw.sign({"op": "apply", **fields}))
        assert reply["ok"] is False and error in reply["error"]
        reply = raw.ask(raw.sign({"op": "norm", "step": 1000}))
        assert reply["ok"] is False and "norm for step 1000" in reply["error"]
        assert [s[t]["version"] for s in clients[0].stats() for t in s] == [0, 0, 0]
        assert clients[0].clip_step(0, CLIP, "float32") == pytest.approx(_by_hand()[0], rel=1e-6)
        np.testing.assert_allclose(clients[1].pull("w", step=1), _by_hand()[1], rtol=1e-6)
    finally:
        raw.close()
        for c in clients:
            c.close()


def test_clipped_tables_are_refused_outside_sync_mode():
    with pytest.raises(PSError, match="train them in sync mode, not 'async'"):
        Shard(SPECS, mode="async")
    model = wide_deep(vocab=100, dim=4, hidden=(8,), optimizer=nn.SGD(0.1, grad_clip_norm=0.5))
    with pytest.raises(ValueError, match="async mode has no such step .* mode='sync'"):
        train(
            transpile(model.main),
            SyntheticCTR(vocab=100, seed=1),
            steps=2,
            batch_size=8,
            mode="async",
            allow_emulation=True,
        )
    with pytest.raises(PSError, match="clip_norm -1 must be a positive finite number"):
        Shard([dataclasses.replace(SPECS[0], clip_norm=-1)], mode="sync")


def _global_norms(model, batches: list[dict], clip) -> list[float]:
    """The single-process run's global gradient norm per step, from the gradients the clip op reads."""
    exe = Executor()
    exe.run(model.startup)
    norms = []
    for b in batches:
        grads = exe.run(model.main, feed=b, fetch_list=clip.inputs["X"])
        total = 0.0
        for g in grads:
            if hasattr(g, "rows"):  # row-sparse: rows of repeated ids summed by hand
                dense = np.zeros((int(g.rows.max()) + 1, g.values.shape[1]), np.float64)
                np.add.at(dense, np.asarray(g.rows), np.asarray(g.values, np.float64))
                g = dense
            total += float(np.sum(np.square(np.asarray(g, np.float64))))
        norms.append(float(np.sqrt(total)))
    return norms


def test_builder_model_with_grad_clip_norm_trains_like_the_single_process_executor():
    """wide_deep with SGD, clipped at every step: 2 cpu + 1 emulated gpu trainers, 2 shards, 4
    micro-batches, sync; the parameters equal the Executor's (which runs the clip op). (SGD: the
    scale moves every parameter directly; Adam's m / sqrt(v) would magnify the float-order noise
    of micro-batch sums past 1e-5 on near-zero entries. test_optim_paddle.py's adam_clip_l2_step
    runs Adam with L2 decay after the clip against Paddle within 1e-4.)"""
    steps, clip_norm = 8, 0.05
    model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(0.2, grad_clip_norm=clip_norm))
    data = SyntheticCTR(vocab=1000, seed=3)
    batches = [data.batch(t, 256) for t in range(steps)]
    (clip,) = [op for op in model.main.ops if op.type == "clip_by_global_norm"]
    assert min(_global_norms(model, batches, clip)) > clip_norm  # the clip is active at every step
    hist = train(
        model.main,
        data,
        steps=steps,
        batch_size=256,
        trainers={"cpu": 2, "gpu": 1},
        servers=2,
        mode="sync",
        micro_batches=4,
        allow_emulation=True,
        return_params=True,
    )
    want = single_process(model, batches)
    assert_same_params(hist.params, want, sorted(hist.params))
    plan = transpile(model.main)
    server = InMemoryServer(plan)  # the in-process oracle clips too
    simulate(plan, batches, server=server)
    assert_same_params(server.values, want, sorted(hist.params))
