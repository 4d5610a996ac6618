"""PaddleRec's multi-task ESMM (models/multitask/esmm/net.py: shared slot embeddings sum-pooled,
a CTR and a CVR tower each ending in a 2-way softmax, ctr_prop_one = its positive column,
ctcvr_prop_one = ctr_prop_one x cvr_prop_one, cost = log_loss(ctr_prop_one, ctr_label) +
log_loss(ctcvr_prop_one, ctcvr_label) averaged; sizes small) and its MMOE (experts, softmax
gates, towers, 2-way softmax per task), imported with `from_paddle(..., tasks=...)` and trained:
the loss trajectory follows PaddlePaddle 3.3.1's own on the same batches and weights, and on
the parameter servers each task has its own AUC."""

from __future__ import annotations

import numpy as np
import pytest
from test_paddle_import import assert_same_trajectory, hetps_run
from test_paddlerec import _emb, _mlp

from runtime.data import SyntheticMultiTask
from transpiler import from_paddle, transpile

STEPS, BATCH, VOCAB, SLOTS, BAG, DIM, DENSE = 40, 64, 300, 4, 2, 4, 13
TOWER = [SLOTS * DIM + DENSE, 16, 8, 2]


def _inputs(paddle):
    slots = [paddle.static.data(f"slot_{i}", [-1, BAG], "int64") for i in range(SLOTS)]
    dense = paddle.static.data("dense", [-1, DENSE], "float32")
    labels = [paddle.static.data(n, [-1, 1], "int64") for n in ("click", "buy")]
    emb = _emb(paddle, DIM)
    pooled = [paddle.sum(emb(s), axis=1) for s in slots]  # PaddleRec: sum-pooled slot embeddings
    return paddle.concat([*pooled, dense], axis=1), labels


def _positive(paddle, logits):
    """PaddleRec's `paddle.slice(softmax(logits), axes=[1], starts=[1], ends=[2])`."""
    return paddle.slice(paddle.nn.functional.softmax(logits), axes=[1], starts=[1], ends=[2])


def esmm(paddle):
    x, (click, buy) = _inputs(paddle)
    ctr_one = _positive(paddle, _mlp(paddle, x, TOWER))
    cvr_one = _positive(paddle, _mlp(paddle, x, TOWER))
    ctcvr_one = paddle.multiply(ctr_one, cvr_one)
    f = paddle.nn.functional
    cost = f.log_loss(ctr_one, paddle.cast(click, "float32")) + f.log_loss(
        ctcvr_one, paddle.cast(buy, "float32")
    )
    return paddle.mean(cost), {"ctr": (ctr_one, click), "ctcvr": (ctcvr_one, buy)}


def mmoe(paddle, experts=3, expert_size=8):
    """PaddleRec's MMOE: expert outputs concatenated and reshaped to [B, E, size], per task a
    softmax gate reshaped to [B, E, 1], the gated sum, a tower, a 2-way softmax."""
    x, labels = _inputs(paddle)
    width = SLOTS * DIM + DENSE
    f = paddle.nn.functional
    outs = [f.relu(paddle.nn.Linear(width, expert_size)(x)) for _ in range(experts)]
    stacked = paddle.reshape(paddle.concat(outs, axis=1), [-1, experts, expert_size])
    cost, tasks = 0.0, {}
    for name, label in zip(("click", "buy"), labels, strict=True):
        gate = paddle.reshape(f.softmax(paddle.nn.Linear(width, experts)(x)), [-1, experts, 1])
        mixed = paddle.sum(paddle.multiply(stacked, gate), axis=1)
        one = _positive(paddle, _mlp(paddle, mixed, [expert_size, 4, 2]))
        cost = cost + f.log_loss(one, paddle.cast(label, "float32"))
        tasks[name] = (one, label)
    return paddle.mean(cost), tasks


MODELS = {"esmm": esmm, "mmoe": mmoe}


def feeds(steps=STEPS, chained=True):
    data = SyntheticMultiTask(vocab=VOCAB, num_slots=SLOTS * BAG, num_dense=DENSE, seed=5, chained=chained)
    out = []
    for i in range(steps):
        b = data.batch(i, BATCH)
        f = {f"slot_{j}": b["sparse"][:, BAG * j : BAG * (j + 1)] for j in range(SLOTS)}
        out.append(
            {**f, "dense": b["dense"], "click": b["click"].astype(np.int64), "buy": b["buy"].astype(np.int64)}
        )
    return out


@pytest.fixture(scope="module")
def paddle():
    paddle = pytest.importorskip("paddle")
    paddle.enable_static()
    return paddle


def _imported(paddle, model, batches):
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 3
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        loss, tasks = MODELS[model](paddle)
        # PaddleRec's Adam for ESMM; SGD for MMOE, whose gate and tower weights get gradients near
        # float32 rounding that Adam's normalisation turns into lr-sized steps of either sign (with
        # Adam both sides drift apart by 1e-3 in 40 steps; with SGD they agree to 2e-7)
        (paddle.optimizer.Adam(0.01) if model == "esmm" else paddle.optimizer.SGD(0.1)).minimize(loss)
    scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        exe.run(startup)
        program = from_paddle(main, scope=scope, fetch=[loss], tasks=tasks)
        ref = [float(exe.run(main, feed=f, fetch_list=[loss])[0]) for f in batches]
    return program, ref


@pytest.mark.parametrize("model", list(MODELS))
def test_paddlerec_multi_task_trains_like_paddle(paddle, model):
    batches = feeds(chained=model == "esmm")
    program, ref = _imported(paddle, model, batches)
    assert [t["name"] for t in program.attrs["tasks"]] == (
        ["ctr", "ctcvr"] if model == "esmm" else ["click", "buy"]
    )
    ours = hetps_run(program, batches, program.attrs["fetch_names"])
    assert_same_trajectory([float(o[0]) for o in ours], ref)


def test_paddlerec_esmm_on_parameter_servers(paddle):
    """Transpiled (embeddings on a sparse PS table, towers dense on the gpu type) and trained by
    trainer and server processes: the same losses as Paddle, and an AUC per task."""
    from runtime import train

    batches = feeds(12)
    program, ref = _imported(paddle, "esmm", batches)
    plan = transpile(program)
    assert plan.tasks == ["ctr", "ctcvr"]
    assert [t.kind for t in plan.tables if t.kind == "sparse"] == ["sparse"]
    assert {t for t, p in plan.programs.items() for op in p.ops if op.type in ("matmul", "gemm")} == {"gpu"}
    hist = train(plan, batches, epochs=1, trainers={"cpu": 1, "gpu": 1}, allow_emulation=True, progress=False)
    assert_same_trajectory(hist.loss, ref)
    assert sorted(hist.task_auc) == ["ctcvr", "ctr"] and all(len(v) == 12 for v in hist.task_auc.values())
    assert all(0.0 <= a <= 1.0 for v in hist.task_auc.values() for a in v if np.isfinite(a))
