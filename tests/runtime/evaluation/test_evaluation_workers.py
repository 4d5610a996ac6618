"""`evaluate` / `predict` with workers=N, servers=S (issue 15, item 4: "through the same engines"):
the same figures as the one-process path and as numpy by hand, predictions in the data's order,
a reader-sharded dataset, and failures named with nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal

import numpy as np
import pytest
from procs import wait_dead
from test_ingest import CRITEO, criteo_lines
from test_lifecycle import (
    RUN,
    auc_by_hand,
    data,
    held_out,
    log_loss_by_hand,
    model,
    predict_by_hand,
    tables_by_hand,
)

from runtime.cli.app import main
from runtime.data import open_dataset
from runtime.driver.checkpoints import latest
from runtime.driver.train import train
from runtime.engines import LocalEngine
from runtime.evaluation.evaluate import evaluate, predict
from runtime.evaluation.workers import EvaluationError
from runtime.ps import CheckpointError, PSError
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model, its plan and the checkpoint directory of a short sync `train` run."""
    tmp = tmp_path_factory.mktemp("evalpar")
    m = model()
    plan = transpile(m.main)
    train(plan, data(), steps=4, checkpoint=str(tmp / "ckpt"), **RUN)
    return m, plan, tmp / "ckpt"


def uneven_batches() -> list[dict]:
    """Five held-out batches of different sizes: a batch out of place shows in the predictions."""
    return [data().batch(10**6 + i, n) for i, n in enumerate((50, 17, 64, 9, 33))]


class KillingEngine(LocalEngine):
    """The local engine, but when process `when` has been started, `victim` gets `sig`."""

    def __init__(self, victim: str, when: str, sig: int = signal.SIGKILL) -> None:
        super().__init__()
        self.victim, self.when, self.sig = victim, when, sig
        self.run_dir: str | None = None

    def start(self, name, target, kwargs, **kw) -> None:
        super().start(name, target, kwargs, **kw)
        self.run_dir = self.tmp
        if name == self.when:
            os.kill(self.procs[self.victim].pid, self.sig)


def assert_nothing_left(eng: LocalEngine) -> None:
    assert eng.procs, "the engine started nothing"
    assert wait_dead([p.pid for p in eng.procs.values()]) == []
    assert eng.run_dir is not None and not os.path.exists(eng.run_dir)


def test_two_workers_and_two_shards_evaluate_as_one_process_and_as_numpy_by_hand(trained):
    m, plan, ckpt = trained
    ev = uneven_batches()
    one = evaluate(plan, ev, checkpoint=str(ckpt))
    par = evaluate(plan, ev, checkpoint=str(ckpt), workers=2, servers=2)
    want = predict_by_hand(m, tables_by_hand(latest(ckpt), plan), ev).ravel()
    y = np.concatenate([b["label"] for b in ev]).ravel()
    assert par["examples"] == one["examples"] == y.size == 173
    assert par["loss"] == pytest.approx(one["loss"], rel=1e-12)
    assert par["auc"] == pytest.approx(one["auc"], abs=1e-12)
    assert par["loss"] == pytest.approx(log_loss_by_hand(y, want), rel=1e-5)
    assert par["auc"] == pytest.approx(auc_by_hand(y, want), abs=1e-9)


def test_parallel_predict_returns_the_predictions_in_the_datas_order(trained):
    m, plan, ckpt = trained
    ev = uneven_batches()
    got = predict(plan, ev, checkpoint=str(ckpt), workers=3, servers=2)
    np.testing.assert_allclose(got, predict(plan, ev, checkpoint=str(ckpt)), rtol=1e-6, atol=1e-7)
    want = predict_by_hand(m, tables_by_hand(latest(ckpt), plan), ev)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_dataset_is_read_by_reader_shards_and_scored_in_its_order(tmp_path):
    path = tmp_path / "day_0.txt"
    path.write_text("\n".join(criteo_lines(90, seed=3)) + "\n")
    plan = transpile(wide_deep(num_slots=26, vocab=1000, dim=4, hidden=(8,), optimizer=nn.SGD(0.1)).main)
    ds = open_dataset(path, CRITEO, batch_size=16)
    one_pred, one = predict(plan, ds), evaluate(plan, ds)
    np.testing.assert_allclose(predict(plan, ds, workers=2), one_pred, rtol=1e-6, atol=1e-7)
    par = evaluate(plan, ds, workers=2, servers=2)
    assert par["examples"] == one["examples"] == 90
    assert par["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert par["auc"] == pytest.approx(one["auc"], abs=1e-6)
    with pytest.raises(ValueError, match="workers=17 is more than the dataset's batch_size 16"):
        evaluate(plan, ds, workers=17)
    shuffled = open_dataset(path, CRITEO, batch_size=16, shuffle=32)
    with pytest.raises(ValueError, match="shuffled dataset.*shuffle=0"):
        predict(plan, shuffled, workers=2)


def test_a_checkpoint_of_another_plan_is_refused_before_any_process_starts(trained):
    _, _, ckpt = trained
    other = transpile(model(hidden=(4,)).main)
    eng = KillingEngine("none", "none")
    with pytest.raises(CheckpointError, match="hidden|shape"):
        evaluate(other, held_out(1), checkpoint=str(ckpt), workers=2, engine=eng)
    with pytest.raises(CheckpointError, match="nothing to resume from"):
        predict(other, held_out(1), checkpoint=str(ckpt / "missing"), workers=2, engine=eng)
    assert eng.procs == {}


def test_a_corrupt_checkpoint_file_is_named_by_the_shards_and_nothing_is_left(trained, tmp_path):
    _, plan, ckpt = trained
    bad = tmp_path / "bad"
    shutil.copytree(latest(ckpt), bad)
    victim = next(p for p in sorted(bad.iterdir()) if p.suffix == ".npz")
    victim.write_bytes(victim.read_bytes()[:100])
    eng = KillingEngine("none", "none")
    with pytest.raises(PSError, match=rf"file '{victim.name}' .* does not match its manifest entry"):
        evaluate(plan, held_out(1), checkpoint=str(bad), workers=2, servers=2, engine=eng)
    assert_nothing_left(eng)


@pytest.mark.parametrize(
    ("victim", "when", "sig", "how"),
    [
        ("eval:1", "eval:1", signal.SIGKILL, "killed by signal SIGKILL"),
        ("ps:1", "eval:0", signal.SIGKILL, "killed by signal SIGKILL"),
        ("eval:0", "eval:1", signal.SIGSTOP, "is stopped"),
    ],
)
def test_a_killed_or_stopped_worker_or_shard_is_named_and_nothing_is_left(trained, victim, when, sig, how):
    _, plan, ckpt = trained
    eng = KillingEngine(victim, when, sig)
    with pytest.raises(EvaluationError, match=rf"^{victim} failed: .*{how}"):
        evaluate(plan, uneven_batches(), checkpoint=str(ckpt), workers=2, servers=2, engine=eng)
    assert_nothing_left(eng)


def test_a_failing_worker_is_named_with_its_traceback(trained):
    _, plan, ckpt = trained
    ev = uneven_batches()
    del ev[3]["dense"]  # batch 3 goes to worker 3 % 2 = 1
    eng = KillingEngine("none", "none")
    with pytest.raises(EvaluationError, match=r"(?s)^eval:1 failed: .*KeyError.*lacks the feeds \['dense'\]"):
        predict(plan, ev, checkpoint=str(ckpt), workers=2, engine=eng)
    assert_nothing_left(eng)


def test_hetps_eval_and_predict_with_workers(trained, tmp_path, capsys):
    _, plan, ckpt = trained
    plan.save(tmp_path / "plan")
    run = [str(tmp_path / "plan"), "--checkpoint", str(ckpt), "--data", "synthetic", "--batch-size", "32"]
    capsys.readouterr()
    assert main(["eval", *run, "--batches", "3"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["eval", *run, "--batches", "3", "--workers", "2", "--servers", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == pytest.approx(one, rel=1e-12)
    one_out, par_out = tmp_path / "one.npy", tmp_path / "par.npy"
    assert main(["predict", *run, "--batches", "3", "-o", str(one_out)]) == 0
    assert main(["predict", *run, "--batches", "3", "--workers", "2", "-o", str(par_out)]) == 0
    assert np.load(par_out).shape == (96, 1)
    np.testing.assert_allclose(np.load(par_out), np.load(one_out), rtol=1e-6, atol=1e-7)
    assert main(["eval", *run, "--servers", "2"]) == 2
    assert "--servers S goes with --workers N" in capsys.readouterr().err
