"""simulate(transpile(program)) trains exactly like the single-process program.

Reference: the untranspiled program run by `runtime.Executor` (itself checked against PaddlePaddle
in test_paddle_equivalence.py). 20 steps in float64; losses and every parameter must agree to 1e-9
for Wide&Deep and DLRM, with SGD, Adagrad and Adam, placed by type and with an override that
forces a three-stage chain (cpu -> gpu -> cpu).
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime import Executor, InMemoryServer, simulate
from runtime.exec.comm_ops import comm_handlers
from runtime.exec.simulate import MemoryComm
from transpiler import TranspileConfig, models, transpile
from transpiler import builder as nn

STEPS, BATCH = 20, 16
OPTIMIZERS = {
    "sgd": lambda: nn.SGD(0.1),
    "adagrad": lambda: nn.Adagrad(0.1, initial_accumulator_value=0.1),
    "adam": lambda: nn.Adam(0.01),
}
THREE_STAGE = TranspileConfig(op_type_devices={"sigmoid_cross_entropy_with_logits": "cpu"})


def build(model: str, opt: str) -> tuple[models.Model, list[dict]]:
    rng = np.random.default_rng(7)
    if model == "wide_deep":
        m = models.wide_deep(
            num_slots=5,
            vocab=40,
            dim=4,
            num_dense=6,
            hidden=(16, 8),
            optimizer=OPTIMIZERS[opt](),
            dtype="float64",
        )
        feed = lambda: {"sparse": rng.integers(0, 40, (BATCH, 5)), "dense": rng.normal(size=(BATCH, 6))}
    else:
        m = models.dlrm(
            num_slots=3,
            vocab=30,
            dim=4,
            bag=3,
            num_dense=5,
            bottom=(8,),
            top=(8,),
            pooling="mean" if opt == "adam" else "sum",
            optimizer=OPTIMIZERS[opt](),
            dtype="float64",
        )
        feed = lambda: {
            **{f"slot_{i}": rng.integers(0, 30, (BATCH, 3)) for i in range(3)},
            "dense": rng.normal(size=(BATCH, 5)),
        }
    batches = [{**feed(), "label": (rng.random((BATCH, 1)) < 0.4).astype("float64")} for _ in range(STEPS)]
    return m, batches


_REFERENCE: dict = {}


def reference(model: str, opt: str):
    """Single-process losses and final parameters (cached across placements)."""
    if (model, opt) not in _REFERENCE:
        m, batches = build(model, opt)
        exe = Executor()
        exe.run(m.startup)
        losses = [exe.run(m.main, feed=b, fetch_list=[m.loss])[0] for b in batches]
        params = {p.name: exe.scope[p.name] for p in m.main.parameters()}
        _REFERENCE[(model, opt)] = (losses, params)
    return _REFERENCE[(model, opt)]


@pytest.mark.parametrize("placement", ["by_type", "three_stage"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model", ["wide_deep", "dlrm"])
def test_simulate_matches_single_process(model, opt, placement):
    ref_losses, ref_params = reference(model, opt)
    m, batches = build(model, opt)
    plan = transpile(m.main, THREE_STAGE if placement == "three_stage" else None)
    if placement == "three_stage":  # cpu (lookups) -> gpu (MLP) -> cpu (loss), forward and backward
        assert plan.programs["cpu"].attrs.get("loss_name") == m.loss.name
        assert {(c["src"], c["dst"]) for c in plan.channels} == {("cpu", "gpu"), ("gpu", "cpu")}
    server = InMemoryServer(plan)
    losses = simulate(plan, batches, server=server)
    np.testing.assert_allclose([x[0] for x in losses], ref_losses, rtol=1e-9, atol=0)
    assert set(ref_params) == {t.name for t in plan.tables}
    for name, want in ref_params.items():
        np.testing.assert_allclose(server.value(name), want, rtol=1e-9, atol=1e-12, err_msg=name)
    assert not np.allclose(server.value(name), server.__class__(plan).value(name)), "nothing trained"


def test_program_without_optimize_ops_uses_config_optimizer():
    """An imported forward program with a loss: transpile appends backward; tables get config.optimizer."""
    m, batches = build("wide_deep", "sgd")  # reference: the builder's SGD(0.1) step
    fwd = models.wide_deep(num_slots=5, vocab=40, dim=4, num_dense=6, hidden=(16, 8), dtype="float64")
    fwd.main.attrs["loss_name"] = fwd.loss.name
    plan = transpile(fwd.main, TranspileConfig(optimizer={"type": "sgd", "lr": 0.1}))
    assert {t.optimizer.type for t in plan.tables} == {"sgd"}
    losses = simulate(plan, batches)
    np.testing.assert_allclose([x[0] for x in losses], reference("wide_deep", "sgd")[0], rtol=1e-9)


def test_fetch_list_and_micro_batch_keys():
    """Fetching a tensor from the trainer that computes it; the pred of step k uses step-k params."""
    m, batches = build("wide_deep", "sgd")
    exe = Executor()
    exe.run(m.startup)
    want = [exe.run(m.main, feed=b, fetch_list=[m.pred, m.loss]) for b in batches[:3]]
    got = simulate(transpile(m.main), batches[:3], fetch_list=[m.pred, m.loss.name])
    for (p, loss), (gp, gl) in zip(want, got, strict=True):
        np.testing.assert_allclose(gp, p, rtol=1e-12)
        np.testing.assert_allclose(gl, loss, rtol=1e-12)
    with pytest.raises(KeyError, match="wide_emb.w_0.*it is a table"):
        simulate(transpile(m.main), batches[:1], fetch_list=["wide_emb.w_0"])


def test_free_running_trainers_do_not_deadlock():
    """Each sub-program in its own thread, nothing coordinating them: sends never block, a recv
    blocks (10 s timeout) until its message arrives. Every step finishes and the losses equal
    simulate's — deadlock freedom by construction, not by the scheduler."""
    import queue
    import threading

    m, batches = build("dlrm", "adam")
    plan = transpile(m.main, THREE_STAGE)
    server = InMemoryServer(plan)
    boxes: dict = {}
    lock = threading.Lock()

    def box(key):
        with lock:
            return boxes.setdefault(key, queue.Queue())

    class Threaded(MemoryComm):  # simulate's backend, with a blocking queue per (tensor, destination)
        def send(self, ctx, dst, name, value):
            box((name, dst)).put(value)

        def recv(self, ctx, name):
            return box((name, self.me)).get(timeout=10)

    exes = {t: Executor(handlers=comm_handlers(Threaded(t, {}, server))) for t in plan.programs}
    losses, errors = [], []
    for feed in batches:
        out = {}

        def run(t, feed=feed, out=out):
            try:
                fetch = [m.loss.name] if plan.programs[t].attrs.get("loss_name") else []
                out[t] = exes[t].run(plan.programs[t], feed=feed, fetch_list=fetch)
            except Exception as e:  # noqa: BLE001  (reported below)
                errors.append(f"{t}: {e!r}")

        threads = [threading.Thread(target=run, args=(t,)) for t in reversed(list(plan.programs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not errors and not any(th.is_alive() for th in threads), errors
        server.apply()
        losses.append(out["cpu"][0])
    np.testing.assert_allclose(losses, [x[0] for x in simulate(plan, batches)], rtol=1e-12)


def test_oracle_server_refuses_ids_outside_a_table():
    """The registry's id-range check (the one the embedding kernel runs), with the table named."""
    plan = transpile(models.wide_deep(vocab=30).main)
    server = InMemoryServer(plan)
    sparse = next(t.name for t in plan.tables if t.kind == "sparse")
    assert server.pull(sparse, np.array([0, 29])).shape[0] == 2
    with pytest.raises(IndexError, match=rf"'{sparse}': ids out of range \[0, 30\): \[30, -1\]"):
        server.pull(sparse, np.array([3, 30, -1]))
