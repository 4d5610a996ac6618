"""The model's life after `train` (issue 15): periodic checkpoints, exact resume, held-out evaluation
during training, evaluate / predict from a checkpoint, the servable ONNX export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from procs import wait_dead

from ops_registry import init_rows
from runtime.data import SyntheticCTR
from runtime.driver.checkpoints import checkpoints, latest, read_state
from runtime.driver.train import train
from runtime.evaluation.evaluate import evaluate, export, predict
from runtime.exec.executor import Executor
from runtime.ps import CheckpointError, make_table
from runtime.telemetry.outputs import read_metrics
from transpiler import builder as nn
from transpiler import transpile
from transpiler.exporters.forward import inference_program
from transpiler.models import wide_deep
from transpiler.tables import TableSpec

REPO = Path(__file__).resolve().parents[3]
SLOTS, VOCAB = 4, 100


def model(hidden=(8,)):
    return wide_deep(num_slots=SLOTS, vocab=VOCAB, dim=4, hidden=hidden, optimizer=nn.Adam(lr=0.02))


def data():
    return SyntheticCTR(vocab=VOCAB, num_slots=SLOTS)


def held_out(batches=3, n=128):
    return [data().batch(10**6 + i, n) for i in range(batches)]


RUN = dict(batch_size=64, trainers={"cpu": 2, "gpu": 1}, allow_emulation=True, mode="sync", progress=False)


# -- references, by hand -----------------------------------------------------------------------------
def tables_by_hand(path: Path, plan) -> dict[str, np.ndarray]:
    """Every table of checkpoint `path`, read with numpy from its files (unseen sparse rows: their
    initial values)."""
    doc = json.loads((path / "manifest.json").read_text())
    out = {}
    for t in plan.tables:
        shape = tuple(t.shape)
        full = init_rows(t.initializer, shape, t.dtype) if t.kind == "sparse" else None
        for e in (e for e in doc["files"] if e["table"] == t.name):
            with np.load(path / e["file"]) as z:
                if t.kind == "dense":
                    full = z["Param"]
                else:
                    full[z["ids"]] = z["Param"]
        out[t.name] = full
    return out


def predict_by_hand(m, tables: dict[str, np.ndarray], batches) -> np.ndarray:
    """The builder program's own forward pass (not the plan's) with `tables` as its parameters."""
    prog = inference_program(m.main, [m.pred])
    prog.params = dict(tables)
    exe = Executor()
    return np.concatenate(
        [exe.run(prog, feed={k: b[k] for k in ("sparse", "dense")}, fetch_list=[m.pred])[0] for b in batches]
    )


def auc_by_hand(y: np.ndarray, s: np.ndarray) -> float:
    """Mann-Whitney: the probability a positive scores above a negative (ties count half)."""
    pos, neg = s[y == 1], s[y == 0]
    return float(
        ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
        / (pos.size * neg.size)
    )


def log_loss_by_hand(y: np.ndarray, p: np.ndarray) -> float:
    p = p.astype(np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


# -- kill and resume ------------------------------------------------------------------------------
KILLED_RUN = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
from test_lifecycle import RUN, data, model
from runtime.driver.train import train

if __name__ == "__main__":
    train(model().main, data(), steps=40, checkpoint={ckpt!r}, checkpoint_every=20, metrics={metrics!r},
          servers=1, stall_timeout=15, **RUN)
"""


def descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def test_a_run_killed_after_its_step_20_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    m = model()
    ref = train(m.main, data(), steps=40, return_params=True, **RUN)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "killed.jsonl"
    script = tmp_path / "killed.py"
    script.write_text(
        KILLED_RUN.format(
            tests=str(Path(__file__).resolve().parent),
            root=str(Path(__file__).resolve().parents[2]),
            ckpt=str(ckpt),
            metrics=str(metrics),
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 300
    while not (ckpt / "step-00000020" / "manifest.json").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no step-20 checkpoint within 300 s"
        time.sleep(0.05)
    family = descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    # a trainer blocked in a parameter-server call notices the dead server at its stall_timeout (15 s)
    assert wait_dead(family, 60) == [], "the killed driver's trainers and servers must exit"
    killed = [r for r in read_metrics(metrics) if r["kind"] == "step"]
    assert len(killed) >= 20 and (ckpt / "step-00000020").is_dir()
    assert not (ckpt / "step-00000040").exists()  # it was killed before the end
    assert latest(ckpt).name == "step-00000020" and read_state(latest(ckpt)).step == 20

    # resumed with another shard count: steps 20-39
    resumed = train(m.main, data(), steps=40, resume=str(ckpt), return_params=True, servers=2, **RUN)
    assert resumed.first_step == 20 and resumed.steps == 20
    np.testing.assert_allclose([r["loss"] for r in killed[:20]], ref.loss[:20], rtol=1e-6)
    np.testing.assert_allclose(resumed.loss, ref.loss[20:], rtol=1e-6)
    for name, want in ref.params.items():
        got = resumed.params[name]
        assert np.max(np.abs(got - want)) <= 1e-6 * max(1.0, np.max(np.abs(want))), name


def test_periodic_checkpoints_keep_the_newest_and_resume_skips_an_incomplete_one(tmp_path):
    m = model()
    ckpt = tmp_path / "ckpt"
    hist = train(m.main, data(), steps=9, checkpoint=str(ckpt), checkpoint_every=3, keep=2, **RUN)
    assert hist.steps == 9 and [p.name for p in checkpoints(ckpt)] == ["step-00000006", "step-00000009"]
    state = read_state(ckpt / "step-00000006")
    assert state.step == 6 and state.settings["mode"] == "sync" and state.settings["batch_size"] == 64
    (ckpt / "step-00000009" / "manifest.json").unlink()  # as if its save had been killed
    assert latest(ckpt).name == "step-00000006"
    resumed = train(m.main, data(), steps=8, resume=str(ckpt), **RUN)
    assert resumed.first_step == 6 and resumed.steps == 2


def test_a_checkpoint_of_another_plan_is_refused_with_the_reason(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(model().main, data(), steps=2, checkpoint=str(ckpt), **RUN)
    with pytest.raises(CheckpointError, match=r"table 'fc_0.b_0' has shape \[8\], this plan's has \[16\]"):
        train(model(hidden=(16,)).main, data(), steps=4, resume=str(ckpt), **RUN)
    other = wide_deep(num_slots=SLOTS, vocab=VOCAB, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1))
    with pytest.raises(CheckpointError, match="trained with optimizer"):
        train(other.main, data(), steps=4, resume=str(ckpt), **RUN)
    with pytest.raises(ValueError, match="nothing left to train"):
        train(model().main, data(), steps=2, resume=str(ckpt), **RUN)


# -- evaluation -------------------------------------------------------------------------------------
def test_held_out_evaluation_during_training_matches_a_forward_pass_by_hand(tmp_path):
    m = model()
    plan = transpile(m.main)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    ev = held_out()
    hist = train(
        plan,
        data(),
        steps=8,
        checkpoint=str(ckpt),
        checkpoint_every=4,
        eval_data=ev,
        eval_every=4,
        metrics=str(metrics),
        **RUN,
    )
    assert [e["step"] for e in hist.eval] == [4, 8] and hist.steps == 8
    y = np.concatenate([b["label"] for b in ev]).ravel()
    for e in hist.eval:
        p = predict_by_hand(m, tables_by_hand(ckpt / f"step-{e['step']:08d}", plan), ev).ravel()
        assert e["examples"] == y.size
        assert e["loss"] == pytest.approx(log_loss_by_hand(y, p), rel=1e-5)
        assert e["auc"] == pytest.approx(auc_by_hand(y, p), abs=1e-9)
    assert [r["step"] for r in read_metrics(metrics) if r["kind"] == "eval"] == [4, 8]


def test_held_out_figures_reach_tensorboard_and_the_progress_bar(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = held_out(batches=2)
    hist = train(
        model().main,
        data(),
        steps=4,
        eval_data=ev,
        eval_every=2,
        tensorboard=str(tmp_path / "tb"),
        **{**RUN, "progress": True},
    )
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in ("eval_loss", "eval_auc")}
    assert [s for s, _ in got["eval_loss"]] == [2, 4]
    np.testing.assert_allclose([v for _, v in got["eval_loss"]], [e["loss"] for e in hist.eval], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in got["eval_auc"]], [e["auc"] for e in hist.eval], rtol=1e-6)
    assert f"val_loss={hist.eval[0]['loss']:.4f}" in capsys.readouterr().err


def gauc_by_hand(y: np.ndarray, s: np.ndarray, groups: np.ndarray) -> float:
    """The impression-weighted mean of each group's AUC, over groups with both classes."""
    got = [
        (auc_by_hand(y[groups == g], s[groups == g]), int((groups == g).sum()))
        for g in np.unique(groups)
        if 0 < y[groups == g].sum() < (groups == g).sum()
    ]
    return sum(a * n for a, n in got) / sum(n for _, n in got)


def test_periodic_evaluation_records_gauc_and_slices_like_numpy_by_hand(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = model()
    plan = transpile(m.main)
    rng = np.random.default_rng(3)
    ev = [
        {
            **b,
            "user": rng.integers(0, 6, (len(b["label"]), 1)),
            "country": rng.integers(0, 3, (len(b["label"]),)),
        }
        for b in held_out()
    ]
    ckpt, metrics, tb = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "tb"
    hist = train(
        plan,
        data(),
        steps=4,
        checkpoint=str(ckpt),
        checkpoint_every=2,
        eval_data=ev,
        eval_every=2,
        eval_group="user",
        eval_slice_by="country",
        metrics=str(metrics),
        tensorboard=str(tb),
        **{**RUN, "trainers": {"cpu": 1, "gpu": 1}},
    )
    y = np.concatenate([b["label"] for b in ev]).ravel()
    users = np.concatenate([b["user"] for b in ev]).ravel()
    countries = np.concatenate([b["country"] for b in ev])
    assert [e["step"] for e in hist.eval] == [2, 4]
    for e in hist.eval:
        p = predict_by_hand(m, tables_by_hand(ckpt / f"step-{e['step']:08d}", plan), ev).ravel()
        assert e["gauc"] == pytest.approx(gauc_by_hand(y, p, users), abs=1e-9)
        assert sorted(e["slices"]) == ["0", "1", "2"]
        for c, got in e["slices"].items():
            rows = countries == int(c)
            assert got["examples"] == int(rows.sum())
            assert got["auc"] == pytest.approx(auc_by_hand(y[rows], p[rows]), abs=1e-9)
            assert got["logloss"] == pytest.approx(log_loss_by_hand(y[rows], p[rows]), rel=1e-5)
            assert got["calibration"] == pytest.approx(p[rows].mean() / y[rows].mean(), rel=1e-5)
    logged = [r for r in read_metrics(metrics) if r["kind"] == "eval"]
    assert [r["gauc"] for r in logged] == [e["gauc"] for e in hist.eval]
    assert logged[-1]["slices"]["1"]["auc"] == pytest.approx(hist.eval[-1]["slices"]["1"]["auc"])
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("eval_gauc")]
    np.testing.assert_allclose([v for _, v in got], [e["gauc"] for e in hist.eval], rtol=1e-6)
    sliced = [e.value for e in acc.Scalars("eval_auc/slice_2")]
    np.testing.assert_allclose(sliced, [e["slices"]["2"]["auc"] for e in hist.eval], rtol=1e-6)


def test_periodic_evaluation_refuses_an_unknown_group_column_before_training():
    with pytest.raises(ValueError, match="cannot group or slice by 'user'"):
        train(transpile(model().main), data(), steps=2, eval_data=held_out(1), eval_group="user", **RUN)


def test_resume_continues_an_iterable_source_at_its_batch_in_the_right_epoch(tmp_path):
    batches = [data().batch(100 + i, 48) for i in range(5)]  # one epoch: 5 steps
    m = model()
    ref = train(m.main, batches, epochs=2, return_params=True, **{**RUN, "batch_size": None})
    ckpt = tmp_path / "ckpt"
    first = train(m.main, batches, epochs=2, steps=7, checkpoint=str(ckpt), **{**RUN, "batch_size": None})
    state = read_state(latest(ckpt))
    assert (state.step, state.epoch, state.batch) == (7, 1, 2)
    rest = train(
        m.main, batches, epochs=2, resume=str(ckpt), return_params=True, **{**RUN, "batch_size": None}
    )
    assert rest.first_step == 7 and rest.steps == 3
    np.testing.assert_allclose(first.loss + rest.loss, ref.loss, rtol=1e-6)
    for name, want in ref.params.items():
        assert np.max(np.abs(rest.params[name] - want)) <= 1e-6 * max(1.0, np.max(np.abs(want))), name


def test_evaluate_and_predict_read_a_checkpoint(tmp_path):
    m = model()
    plan = transpile(m.main)
    ckpt = tmp_path / "ckpt"
    train(plan, data(), steps=5, checkpoint=str(ckpt), **RUN)
    ev = held_out()
    want = predict_by_hand(m, tables_by_hand(latest(ckpt), plan), ev)
    got = predict(plan, ev, checkpoint=str(ckpt))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    res = evaluate(plan, ev, checkpoint=str(ckpt))
    y = np.concatenate([b["label"] for b in ev]).ravel()
    assert res["examples"] == y.size
    assert res["loss"] == pytest.approx(log_loss_by_hand(y, want.ravel()), rel=1e-5)
    assert res["auc"] == pytest.approx(auc_by_hand(y, want.ravel()), abs=1e-9)


def test_a_peek_pull_reads_initial_rows_without_creating_them():
    t = make_table(
        TableSpec(
            name="e",
            kind="sparse",
            shape=[50, 3],
            initializer={"type": "normal", "seed": 3},
            optimizer={"type": "adam", "lr": 0.1},
        )
    )
    t.pull(np.array([1, 2]))
    got = t.peek(np.array([2, 7, 9]))
    assert len(t) == 2  # nothing created
    np.testing.assert_array_equal(
        got[1:], init_rows({"type": "normal", "seed": 3}, (50, 3), "float32", np.array([7, 9]))
    )
    np.testing.assert_array_equal(got, t.pull(np.array([2, 7, 9])))  # what a pull then creates


# -- export ---------------------------------------------------------------------------------------
def test_the_servable_export_scores_like_predict_in_onnxruntime(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    plan = transpile(model().main)
    ckpt = tmp_path / "ckpt"
    train(plan, data(), steps=5, checkpoint=str(ckpt), **RUN)
    path = export(plan, tmp_path / "model.onnx", checkpoint=str(ckpt))
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert {n.domain for n in proto.graph.node} <= {""} and [o.domain for o in proto.opset_import] == [""]
    assert not {n.op_type for n in proto.graph.node} & {"Gradient", "pull_sparse", "send"}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in sess.get_inputs()) == ["dense", "sparse"]  # no label
    ev = held_out()
    got = np.concatenate([sess.run(None, {"sparse": b["sparse"], "dense": b["dense"]})[0] for b in ev])
    np.testing.assert_allclose(got, predict(plan, ev, checkpoint=str(ckpt)), rtol=1e-5, atol=1e-6)


def test_an_async_run_resumed_reaches_the_held_out_auc_of_an_uninterrupted_one(tmp_path):
    # one reader trainer: async staleness stays small, so uninterrupted runs agree to ~1e-4 in AUC
    m, ev = model(), held_out(batches=16, n=256)
    kw = {**RUN, "trainers": {"cpu": 1, "gpu": 1}, "mode": "async", "eval_data": ev}
    ref = train(m.main, data(), steps=200, **kw)
    ckpt = tmp_path / "ckpt"
    first = train(m.main, data(), steps=100, checkpoint=str(ckpt), **kw)
    resumed = train(m.main, data(), steps=200, resume=str(ckpt), **kw)
    assert first.eval[-1]["step"] == 100 and resumed.first_step == 100 and resumed.eval[-1]["step"] == 200
    assert resumed.eval[-1]["loss"] < first.eval[-1]["loss"] - 0.005  # it went on learning
    assert resumed.eval[-1]["auc"] == pytest.approx(ref.eval[-1]["auc"], abs=0.005)


def test_a_checkpoint_of_an_async_run_resumes_in_sync_mode(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(model().main, data(), steps=4, checkpoint=str(ckpt), **{**RUN, "mode": "async"})
    hist = train(model().main, data(), steps=7, resume=str(ckpt), **RUN)  # sync counts steps from 4
    assert hist.first_step == 4 and hist.steps == 3


def test_a_big_export_keeps_its_weights_in_an_external_data_file(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    plan = transpile(model().main)
    ckpt = tmp_path / "ckpt"
    train(plan, data(), steps=2, checkpoint=str(ckpt), **RUN)
    path = export(plan, tmp_path / "m" / "model.onnx", checkpoint=str(ckpt), external_over=0)  # "big"
    assert (tmp_path / "m" / "model.onnx.data").stat().st_size >= VOCAB * 4 * 4  # deep_emb [vocab, 4]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ev = held_out(batches=1)
    got = sess.run(None, {"sparse": ev[0]["sparse"], "dense": ev[0]["dense"]})[0]
    np.testing.assert_allclose(got, predict(plan, ev, checkpoint=str(ckpt)), rtol=1e-5, atol=1e-6)


def test_an_export_of_the_existing_rows_only_scores_remapped_ids_like_predict(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from runtime.evaluation.evaluate import remap_ids

    plan = transpile(model().main)
    ckpt = tmp_path / "ckpt"
    train(plan, data(), steps=1, checkpoint=str(ckpt), **{**RUN, "batch_size": 16})
    path = export(plan, tmp_path / "model.onnx", checkpoint=str(ckpt), rows="existing")
    with np.load(tmp_path / "model.ids.npz") as z:
        ids = {k: z[k] for k in z.files}
    seen = np.unique(data().batch(0, 16)["sparse"])  # the ids step 0 trained
    np.testing.assert_array_equal(ids["sparse"], seen)
    inits = {i.name: i for i in onnx.load(str(path)).graph.initializer}
    assert list(inits["deep_emb.w_0"].dims) == [seen.size + 1, 4]  # the rows that exist + a zero row
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batch = data().batch(0, 16)
    got = sess.run(None, remap_ids(ids, {"sparse": batch["sparse"], "dense": batch["dense"]}))[0]
    np.testing.assert_allclose(got, predict(plan, [batch], checkpoint=str(ckpt)), rtol=1e-5, atol=1e-6)
    unseen = remap_ids(ids, {"sparse": np.array([[int(np.setdiff1d(np.arange(VOCAB), seen)[0])] * SLOTS])})
    assert unseen["sparse"].tolist() == [[seen.size] * SLOTS]  # an id never trained: the zero row


def test_resume_keeps_the_admission_and_eviction_state_of_streaming_tables(tmp_path):
    from transpiler import TranspileConfig

    cfg = TranspileConfig(sparse_entry={"type": "count", "threshold": 2}, evict_after=4)
    plan = transpile(model().main, cfg)
    kw = {**RUN, "trainers": {"cpu": 1, "gpu": 1}}
    ref = train(plan, data(), steps=12, return_params=True, **kw)
    ckpt = tmp_path / "ckpt"
    first = train(plan, data(), steps=6, checkpoint=str(ckpt), **kw)
    rest = train(plan, data(), steps=12, resume=str(ckpt), return_params=True, servers=2, **kw)
    np.testing.assert_allclose(first.loss + rest.loss, ref.loss, rtol=1e-6)
    rows = lambda h: {n: t["rows"] for n, t in h.tables.items()}  # noqa: E731
    assert rows(rest) == rows(ref)  # the same rows admitted and kept (over 2 shards now)
    for name, want in ref.params.items():
        assert np.max(np.abs(rest.params[name] - want)) <= 1e-6 * max(1.0, np.max(np.abs(want))), name


def test_an_imported_onnx_models_servable_export_reproduces_the_original(tmp_path):
    """paddle2onnx's Wide&Deep with an attached loss (the loss reads the prediction): exported with its
    imported weights, the servable model gives what the original model gives in onnxruntime."""
    import onnxruntime as ort
    from assets import MODELS

    from transpiler import from_onnx, transpile

    plan = transpile(from_onnx(MODELS / "wide_deep.onnx", loss="bce"))
    path = plan.export_inference(tmp_path / "m.onnx", dict(plan.params))
    io = np.load(MODELS / "wide_deep_io.npz")
    feed = {"sparse": io["arr_0"], "dense": io["arr_1"]}
    want = ort.InferenceSession(str(MODELS / "wide_deep.onnx")).run(None, feed)[0]
    got = ort.InferenceSession(str(path)).run(None, feed)[0]
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-7)
