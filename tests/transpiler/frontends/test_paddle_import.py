"""`transpiler.from_paddle` imports real paddle.static programs (legacy ProgramDesc and PIR) and the
imported program trains exactly like Paddle's own `exe.run`.

Reference: PaddlePaddle 3.3.1 itself. Each model is built with `paddle.static`, Paddle's startup
program is run, the program is imported (weights read from Paddle's scope), and then Paddle and
hetps' Executor each train 50 steps on the same SyntheticCTR batches; loss trajectories must agree
within 1e-4 relative. Legacy programs are built and run inside `paddle.pir_utils.OldIrGuard()`,
PIR programs in Paddle's default mode, both in this process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import multiprocessing

import numpy as np
import pytest
from paddle_fresh import agreed

from runtime import Executor
from runtime.data import SyntheticCTR
from transpiler import PaddleImportError, from_paddle

STEPS, BATCH, VOCAB, SLOTS, DIM, NUM_DENSE, HIDDEN = 50, 64, 200, 6, 8, 13, (32, 16)
IRS = ("legacy", "pir")


@pytest.fixture(scope="module")
def paddle():
    paddle = pytest.importorskip("paddle")
    paddle.enable_static()
    return paddle


def ir_guard(paddle, ir: str):
    return paddle.pir_utils.OldIrGuard() if ir == "legacy" else contextlib.nullcontext()


# -- models, written with what works in each IR (3.3.1's legacy mode lacks paddle.sum etc.) ------
def _embedding(paddle, ir, ids, dim, sparse):
    if ir == "legacy":
        return paddle.static.nn.embedding(ids, size=[VOCAB, dim], is_sparse=sparse)
    return paddle.nn.Embedding(VOCAB, dim, sparse=sparse)(ids)


def _sum1(paddle, ir, x, n, keepdim):
    """Sum over axis 1 of length n: reduce_sum in PIR; reduce_mean + scale in legacy."""
    if ir == "legacy":
        return paddle.mean(x, axis=1, keepdim=keepdim) * float(n)
    return paddle.sum(x, axis=1, keepdim=keepdim)


def _mlp(paddle, x, last_act=None):
    for size in HIDDEN:
        x = paddle.static.nn.fc(x, size, activation="relu")
    return paddle.static.nn.fc(x, 1, activation=last_act)


def _inputs(paddle, label_dtype="float32"):
    return (
        paddle.static.data("sparse", [-1, SLOTS], "int64"),
        paddle.static.data("dense", [-1, NUM_DENSE], "float32"),
        paddle.static.data("label", [-1, 1], label_dtype),
    )


def wide_deep(paddle, ir, sparse, gpu="gpu", gpu_embedding=False):
    """Wide (per-id scalar weights, summed) + deep (MLP over embeddings and dense features); the
    MLP (and the deep embedding when asked) is under device_guard(gpu) (a no-op in PIR)."""
    ids, dense, label = _inputs(paddle)
    wide = _sum1(paddle, ir, paddle.reshape(_embedding(paddle, ir, ids, 1, sparse), [-1, SLOTS]), SLOTS, True)
    with paddle.static.device_guard(gpu) if gpu_embedding else contextlib.nullcontext():
        emb = _embedding(paddle, ir, ids, DIM, sparse)
    with paddle.static.device_guard(gpu):
        deep = _mlp(paddle, paddle.concat([paddle.reshape(emb, [-1, SLOTS * DIM]), dense], axis=1))
    logit = paddle.add(deep, wide)
    loss = paddle.mean(paddle.nn.functional.binary_cross_entropy_with_logits(logit, label, reduction="none"))
    return loss, logit


def deepfm(paddle, ir, sparse):
    """DeepFM: first-order weights + factorisation-machine pairwise term + MLP."""
    ids, dense, label = _inputs(paddle)
    first = _sum1(
        paddle, ir, paddle.reshape(_embedding(paddle, ir, ids, 1, sparse), [-1, SLOTS]), SLOTS, True
    )
    v = _embedding(paddle, ir, ids, DIM, sparse)
    square_of_sum = paddle.square(_sum1(paddle, ir, v, SLOTS, False))
    sum_of_square = _sum1(paddle, ir, paddle.square(v), SLOTS, False)
    fm = _sum1(paddle, ir, square_of_sum - sum_of_square, DIM, True) * 0.5
    deep = _mlp(paddle, paddle.concat([paddle.reshape(v, [-1, SLOTS * DIM]), dense], axis=1))
    logit = paddle.add(paddle.add(first, fm), deep)
    loss = paddle.nn.functional.binary_cross_entropy_with_logits(logit, label, reduction="mean")
    return loss, logit


def dnn(paddle, ir, sparse):
    """A plain DNN CTR model: two embedding tables summed (add_n), MLP with a sigmoid output,
    log loss against an int64 label cast to float."""
    ids, dense, label = _inputs(paddle, "int64")
    emb = paddle.add_n([_embedding(paddle, ir, ids, DIM, sparse), _embedding(paddle, ir, ids, DIM, sparse)])
    pred = _mlp(
        paddle, paddle.concat([paddle.reshape(emb, [-1, SLOTS * DIM]), dense], axis=1), last_act="sigmoid"
    )
    loss = paddle.mean(paddle.nn.functional.log_loss(pred, paddle.cast(label, "float32")))
    return loss, pred


MODELS = {"wide_deep": wide_deep, "deepfm": deepfm, "dnn": dnn}
OPTIMIZERS = {
    "sgd": lambda p: p.optimizer.SGD(0.05),
    "adam": lambda p: p.optimizer.Adam(0.01),
    "adam_lazy": lambda p: p.optimizer.Adam(0.01, lazy_mode=True),
    "adagrad": lambda p: p.optimizer.Adagrad(0.05),
}


def build(paddle, ir, model, opt=None, sparse=True, seed=7):
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = seed
    # fresh variable names for every build: Paddle's legacy sparse Adam trajectory depends on the
    # generated names (the 11th build in a process drifted 1e-3 from the other builds)
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        loss, out = MODELS[model](paddle, ir, sparse)
        if opt is not None:
            OPTIMIZERS[opt](paddle).minimize(loss)
    return main, startup, loss, out


def batches(model, steps=STEPS):
    data = SyntheticCTR(vocab=VOCAB, num_slots=SLOTS, num_dense=NUM_DENSE, seed=3)
    out = [data.batch(i, BATCH) for i in range(steps)]
    if model == "dnn":
        for b in out:
            b["label"] = b["label"].astype(np.int64)
    return out


def paddle_run(paddle, main, startup, fetch_list, feeds, scope, **import_kw):
    """Run startup, import (weights read before Paddle trains), then Paddle's trajectory."""
    exe = paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        exe.run(startup)
        program = from_paddle(main, scope=scope, **import_kw)
        ref = [exe.run(main, feed=f, fetch_list=fetch_list) for f in feeds]
    return program, ref


def paddle_reference(ir, model, opt, fetch_loss, steps=STEPS):
    """Build `model`, import it, and run Paddle's trajectory: (program, per-step fetches)."""
    import paddle

    paddle.enable_static()
    with ir_guard(paddle, ir):
        main, startup, loss, _ = build(paddle, ir, model, opt)
        kw = {"fetch": [loss]} if fetch_loss else {}
        return paddle_run(paddle, main, startup, [loss], batches(model, steps), paddle.static.Scope(), **kw)


def fresh_paddle_reference(ir, model, opt, fetch_loss=False, steps=STEPS):
    """`paddle_reference` in new Python processes, the trajectory two of them agree on to the bit:
    Paddle 3.3.1's legacy-IR sparse Adam is not reproducible (tests/paddle_fresh.py)."""
    return agreed(paddle_reference, ir, model, opt, fetch_loss, steps, compare=lambda got: got[1])


def hetps_run(program, feeds, fetch_names):
    exe = Executor()
    return [exe.run(program, feed=f, fetch_list=fetch_names) for f in feeds]


def fresh_hetps_run(program, feeds, fetch_names):
    """`hetps_run` in a new Python process, like the Paddle reference it is compared with, so that
    neither side depends on what the test process ran before. (hetps's trajectory was the same to the
    bit in every fresh process tried; the 2.5e-4 failure once seen in the full suite was Paddle's
    reference moving, tests/paddle_fresh.py.)"""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(hetps_run, program, feeds, fetch_names).result(timeout=600)


def assert_same_trajectory(ours, ref, rtol=1e-4):
    ours, ref = np.array(ours, dtype=np.float64), np.array(ref, dtype=np.float64)
    rel = np.abs(ours / ref - 1)
    assert rel.max() < rtol, f"max relative loss error {rel.max():.2e} at step {rel.argmax()}"
    assert ref[-5:].mean() < ref[:5].mean() - 0.01, "the reference did not train; comparison is moot"


# -- must show (1): trajectories ---------------------------------------------------------------
CASES = [
    ("wide_deep", "sgd"),
    ("wide_deep", "adam"),
    ("deepfm", "sgd"),
    ("deepfm", "adam"),
    ("deepfm", "adam_lazy"),
    ("dnn", "adagrad"),
]


@pytest.mark.parametrize("ir", IRS)
@pytest.mark.parametrize("model,opt", CASES)
def test_trains_like_paddle(paddle, ir, model, opt):
    feeds = batches(model)
    if ir == "legacy":
        program, ref = fresh_paddle_reference(ir, model, opt, fetch_loss=True)
    else:
        program, ref = paddle_reference(ir, model, opt, fetch_loss=True)
    assert program.attrs["paddle_ir"] == ir and program.attrs["optimizer"]["type"] == opt.split("_")[0]
    tables = [v for v in program.vars.values() if v.is_parameter and v.is_sparse]
    assert len(tables) == 2
    run = fresh_hetps_run if ir == "legacy" else hetps_run
    ours = run(program, feeds, program.attrs["fetch_names"])
    assert_same_trajectory([o[0] for o in ours], [r[0] for r in ref])


@pytest.mark.parametrize("opt", ["adam", "adam_lazy", "adagrad"])
def test_legacy_sparse_tables_follow_paddles_selected_rows_kernels(paddle, opt):
    """Issue 14 item 5: the legacy-IR DeepFM with is_sparse=True follows Paddle for 50 steps.
    Paddle 3.3.1's CPU Adam for SelectedRows gradients advances Beta1Pow/Beta2Pow before its update
    reads them (bias correction one step ahead) and, without lazy_mode, decays and moves the rows
    without a gradient with an unscaled epsilon; the import marks those tables `paddle_sparse` so
    hetps runs the same step. Only the tables with SelectedRows gradients are marked."""
    feeds = batches("deepfm")
    program, ref = fresh_paddle_reference("legacy", "deepfm", opt)
    tables = {v.name for v in program.vars.values() if v.is_parameter and v.is_sparse}
    marked = {
        op.inputs["Param"][0] for op in program.ops if op.role == "optimize" and op.attrs.get("paddle_sparse")
    }
    assert len(tables) == 2 and marked == (tables if opt.startswith("adam") else set())
    ours = fresh_hetps_run(program, feeds, [program.attrs["loss_name"]])
    assert_same_trajectory([o[0] for o in ours], [r[0] for r in ref])


def test_pir_and_dense_legacy_adam_stay_plain(paddle):
    """PIR densifies embedding gradients and legacy is_sparse=False has none: no table is marked."""
    for ir, sparse in (("pir", True), ("legacy", False)):
        with ir_guard(paddle, ir):
            main, startup, _, _ = build(paddle, ir, "deepfm", "adam", sparse=sparse)
            program = from_paddle(main, startup_program=startup, scope=paddle.static.Scope())
        assert not [op for op in program.ops if op.attrs.get("paddle_sparse")]


# -- must show (2): device_guard -----------------------------------------------------------------
def test_device_guard_reaches_ops_and_their_grad_ops(paddle):
    with ir_guard(paddle, "legacy"):
        main, startup, loss, _ = build(paddle, "legacy", "wide_deep", "sgd")
        exe = paddle.static.Executor(paddle.CPUPlace())
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            exe.run(startup)
        program = from_paddle(main, scope=scope)
        paddle_dev = {op.type: set() for op in main.global_block().ops}
        for op in main.global_block().ops:
            if op.attr("op_role") == 0:
                paddle_dev[op.type].add(op.attr("op_device"))
    ops = {op.id: op for op in program.ops}
    fwd = [op for op in program.ops if op.role in ("forward", "loss") and op.type != "data"]
    on_gpu = {op.type for op in fwd if op.device == "gpu"}
    assert on_gpu == {"reshape", "concat", "matmul", "add", "relu"}  # the MLP and its input
    assert paddle_dev["mul"] == {"gpu"} and paddle_dev["lookup_table_v2"] == {""}
    assert {op.device for op in fwd if op.type == "embedding"} == {""}
    grads = [op for op in program.ops if op.role == "backward"]
    assert grads and all(op.device == ops[op.attrs["fwd_id"]].device for op in grads)
    assert {op.type for op in grads if op.device == "gpu"} >= {"matmul_grad", "relu_grad", "add_grad"}


def test_transpile_puts_device_guarded_ops_and_their_grads_on_gpu(paddle):
    """device_guard beats the type-based default: the deep embedding lookup (category sparse,
    placed on cpu by default) is guarded onto gpu, and so is its gradient; the unguarded wide one
    stays on cpu."""
    plan_mod = pytest.importorskip("transpiler.plan", reason="transpiler.transpile not available")
    with ir_guard(paddle, "legacy"):
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            loss, _ = wide_deep(paddle, "legacy", True, gpu_embedding=True)
            paddle.optimizer.SGD(0.05).minimize(loss)
        program = from_paddle(main, startup_program=startup, scope=paddle.static.Scope())
    plan = plan_mod.transpile(program)
    placed = {op.id: plan.placement[str(op.id)]["device"] for op in program.ops}
    guarded = [op for op in program.ops if op.device == "gpu"]
    assert {op.role for op in guarded} == {"forward", "backward"}
    assert all(placed[op.id] == "gpu" for op in guarded)
    lookups = [op for op in program.ops if op.type in ("embedding", "embedding_grad")]
    assert sorted((op.type, op.device, placed[op.id]) for op in lookups) == [
        ("embedding", "", "cpu"),
        ("embedding", "gpu", "gpu"),
        ("embedding_grad", "", "cpu"),
        ("embedding_grad", "gpu", "gpu"),
    ]


def test_device_guard_index_is_dropped_and_pir_ignores_it(paddle):
    with ir_guard(paddle, "legacy"):
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            wide_deep(paddle, "legacy", True, gpu="gpu:0")
        scope = paddle.static.Scope()
        program = from_paddle(main, startup_program=startup, scope=scope)
    assert {op.device for op in program.ops if op.type == "matmul"} == {"gpu"}
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        wide_deep(paddle, "pir", True)
    program = from_paddle(main, startup_program=startup, scope=paddle.static.Scope())
    assert {op.device for op in program.ops} == {""}


# -- names, feeds, fetches, forward-only programs, initial values -------------------------------
def test_pir_fetch_names_are_stable_and_fetch_the_values(paddle):
    main, startup, loss, logit = build(paddle, "pir", "wide_deep")  # forward only: no minimize
    feed = batches("wide_deep", 1)[0]
    scope = paddle.static.Scope()
    program, (ref,) = paddle_run(
        paddle,
        main,
        startup,
        [loss, logit],
        [feed],
        scope,
        fetch=[loss, logit],
        feed=["sparse", "dense", "label"],
    )
    names = program.attrs["fetch_names"]
    assert program.fetch_names is names  # the attribute the issue asked for, same one list
    again = from_paddle(main, scope=scope, fetch=[loss, logit])
    assert len(names) == 2 and names == again.attrs["fetch_names"]
    assert program.attrs["feed_names"] == ["sparse", "dense", "label"]
    assert "optimizer" not in program.attrs and not any(op.role == "backward" for op in program.ops)
    ours = Executor().run(program, feed=feed, fetch_list=names)
    for o, r in zip(ours, ref, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-6)


def test_initial_values_from_scope_or_startup(paddle):
    main, startup, _, _ = build(paddle, "pir", "dnn", "adagrad")
    scope = paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        paddle.static.Executor(paddle.CPUPlace()).run(startup)
    from_scope = from_paddle(main, scope=scope)
    from_startup = from_paddle(main, startup_program=startup, scope=paddle.static.Scope())
    params = [v.name for v in from_scope.parameters()]
    assert len(params) == 2 + 2 * (len(HIDDEN) + 1)
    for name in params:
        np.testing.assert_array_equal(from_scope.params[name], np.array(scope.find_var(name).get_tensor()))
        np.testing.assert_array_equal(from_startup.params[name], from_scope.params[name])
    with pytest.raises(PaddleImportError, match="run the startup program"):
        from_paddle(main, scope=paddle.static.Scope())


# -- op coverage beyond the three models ---------------------------------------------------------
def _raw(paddle, type, inputs, attrs, dtype="float32"):
    """Append a legacy op directly (for ops whose 3.3.1 Python API is broken in legacy mode)."""
    from paddle.base.layer_helper import LayerHelper

    helper = LayerHelper(type)
    out = helper.create_variable_for_type_inference(dtype)
    helper.append_op(type=type, inputs=inputs, outputs={"Out": [out]}, attrs=attrs)
    return out


def coverage_model(paddle, ir):
    """Ops the CTR models above do not use: tanh, mul/div/sub, matmul with a transposed operand,
    scale with bias_after_scale=False, a filled constant used as a tensor, cast, softmax cross
    entropy, log loss, fc on a 3-D input; in legacy also lookup_table (v1) and an elementwise_add
    that aligns its Y at axis=1."""
    ids, dense, label = _inputs(paddle)
    emb = _embedding(paddle, ir, ids, DIM, True)  # [N, S, D]
    h = paddle.static.nn.fc(emb, 4, activation="tanh")  # [N, 4]
    w_t = paddle.create_parameter([4, NUM_DENSE], "float32")
    if ir == "legacy":
        t = _raw(paddle, "matmul_v2", {"X": [dense], "Y": [w_t]}, {"trans_x": False, "trans_y": True})
        prod = _raw(paddle, "elementwise_mul", {"X": [h], "Y": [t]}, {"axis": -1})
        table = paddle.create_parameter([VOCAB, 3], "float32")
        v1 = _raw(
            paddle,
            "lookup_table",
            {"W": [table], "Ids": [paddle.reshape(ids, [-1, 1])]},
            {"is_sparse": True, "padding_idx": -1},
        )  # [N*S, 3]
        rows = paddle.reshape(v1, [-1, SLOTS, 3])
        bias = paddle.create_parameter([SLOTS], "float32")
        extra = paddle.mean(_raw(paddle, "elementwise_add", {"X": [rows], "Y": [bias]}, {"axis": 1}))
    else:
        t = paddle.matmul(dense, w_t, transpose_y=True)
        prod = h * t
        extra = paddle.mean(paddle.tanh(h))
    denom = paddle.scale(paddle.square(h), 2.0, 3.0, bias_after_scale=False) + paddle.full([1], 2.0)
    logits = paddle.concat([prod / denom - h, t], axis=1)  # [N, 8]
    ce = paddle.nn.functional.softmax_with_cross_entropy(logits, paddle.cast(label, "int64"))
    pred = paddle.static.nn.fc(logits, 1, activation="sigmoid")
    loss = paddle.mean(ce) + paddle.mean(paddle.nn.functional.log_loss(pred, label)) + extra
    return loss, logits


@pytest.mark.parametrize("ir", IRS)
def test_more_ops_forward_and_gradients(paddle, ir):
    feeds = batches("wide_deep", 8)
    with ir_guard(paddle, ir):
        main, startup = paddle.static.Program(), paddle.static.Program()
        main.random_seed = startup.random_seed = 5
        with paddle.static.program_guard(main, startup):
            loss, logits = coverage_model(paddle, ir)
            paddle.optimizer.SGD(0.5).minimize(loss)
        program, ref = paddle_run(
            paddle, main, startup, [loss, logits], feeds, paddle.static.Scope(), fetch=[loss, logits]
        )
    types = {op.type for op in program.ops}
    assert {"tanh", "gemm", "div", "cast", "softmax_cross_entropy", "log_loss", "fill_constant"} <= types
    ours = hetps_run(program, feeds, program.attrs["fetch_names"])
    np.testing.assert_allclose(ours[0][1], ref[0][1], rtol=1e-5, atol=1e-6)  # forward, step 0
    rel = np.abs(np.array([o[0] for o in ours]) / [r[0] for r in ref] - 1)  # gradients via SGD
    assert rel.max() < 1e-4 and abs(ref[-1][0] - ref[0][0]) > 1e-3


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ir", IRS)
def test_unsupported_op_names_type_index_and_call_site(paddle, ir):
    with ir_guard(paddle, ir):
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [-1, 3, 4], "float32")
            line = inspect.currentframe().f_lineno + 1
            y = paddle.flip(x, [1])
            paddle.mean(y)
        with pytest.raises(PaddleImportError) as err:
            from_paddle(main, startup_program=startup, scope=paddle.static.Scope())
    msg = str(err.value)
    kind = "flip" if ir == "legacy" else "pd_op.flip"
    index = next(
        i
        for i, op in enumerate(main.global_block().ops)
        if (op.type if ir == "legacy" else op.name()) == kind
    )
    assert f"#{index} '{kind}'" in msg and f"{__file__}:{line}" in msg and "supported ops:" in msg


@pytest.mark.parametrize("ir", IRS)
@pytest.mark.parametrize(
    "make_opt,match",
    [
        (lambda p, ir: p.optimizer.Momentum(0.1), "only SGD, Adam, AdamW and Adagrad"),
        (lambda p, ir: p.optimizer.SGD(0.1, weight_decay=p.regularizer.L1Decay(0.01)), "weight decay"),
        (
            lambda p, ir: p.optimizer.SGD(p.optimizer.lr.PiecewiseDecay([3], [0.1, 0.01])),
            "LR scheduler PiecewiseDecay is not imported",
        ),
        (
            lambda p, ir: p.optimizer.SGD(
                0.1, grad_clip=p.nn.ClipGradByValue(1.0) if ir == "legacy" else p.nn.ClipGradByNorm(1.0)
            ),
            "clipping",
        ),
    ],
)
def test_unsupported_optimizer_setting_is_an_error(paddle, ir, make_opt, match):
    """Settings hetps cannot reproduce fail loudly instead of training something else."""
    with ir_guard(paddle, ir):
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            loss, _ = wide_deep(paddle, ir, True)
            make_opt(paddle, ir).minimize(loss)
        with pytest.raises(PaddleImportError, match=match):
            from_paddle(main, startup_program=startup, scope=paddle.static.Scope())
