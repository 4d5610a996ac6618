"""`train(..., max_restarts=N)`: a run whose trainers, shards or gpu trainer are killed (or stopped)
at random steps restarts from its last complete checkpoint and ends exactly as the uninterrupted
run (sync mode); without a checkpoint it restarts from the start, and after N restarts it raises
the last error with every restart; a checkpoint being written when a shard died is never the one
restored; checkpoints by time; async mode applies no gradient twice."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from procs import alive

import runtime.ps.checkpoint as ps_checkpoint
from runtime import FailureConfig, TrainingError
from runtime.data import SyntheticCTR
from runtime.driver.train import train
from runtime.engines import LocalEngine
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep

STEPS, BATCH = 16, 64
SLOTS, VOCAB = 4, 100
RUN = dict(
    steps=STEPS,
    batch_size=BATCH,
    trainers={"cpu": 2, "gpu": 1},
    servers=2,
    allow_emulation=True,
    progress=False,
)


def model():
    return wide_deep(num_slots=SLOTS, vocab=VOCAB, dim=4, hidden=(8,), optimizer=nn.Adam(lr=0.02))


def data():
    return SyntheticCTR(vocab=VOCAB, num_slots=SLOTS)


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted sync run."""
    return train(model().main, data(), mode="sync", return_params=True, **RUN)


class Killer:
    """A step callback that sends `signal` to process `name` of the engine's current attempt when
    the driver reports step `step` or later (each fault once, at most one per attempt), and
    remembers every pid it saw."""

    def __init__(self, eng: LocalEngine, faults: dict[int, tuple[str, signal.Signals]]) -> None:
        self.eng, self.faults, self.pids, self.hit = eng, dict(faults), set(), frozenset()

    def __call__(self, record: dict) -> None:
        attempt = frozenset(p for p in self.eng.pids().values() if p)
        self.pids |= attempt
        due = [s for s in self.faults if s <= record["step"]]
        if due and attempt != self.hit:
            name, sig = self.faults.pop(min(due))
            self.hit = attempt
            os.kill(self.eng.pids()[name], sig)


def assert_same_run(got, want):
    """The same per-step losses, examples and final tables as the uninterrupted run (1e-6)."""
    assert got.first_step == 0 and got.steps == STEPS
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-6)
    assert got.examples == [BATCH] * STEPS  # every batch trained once
    for name, value in want.params.items():
        scale = max(1.0, float(np.max(np.abs(value))))
        assert np.max(np.abs(got.params[name] - value)) <= 1e-6 * scale, name


KILL, STOP = signal.SIGKILL, signal.SIGSTOP


@pytest.mark.parametrize(
    "victims",
    [
        [("cpu:1", KILL), ("cpu:0", STOP)],  # a reader trainer killed, another one stopped
        [("ps:0", KILL), ("ps:1", KILL)],  # both shards
        [("gpu:0", KILL), ("gpu:0", STOP)],  # the gpu trainer
    ],
    ids=["cpu-trainers", "shards", "gpu-trainer"],
)
def test_a_sync_run_killed_at_random_steps_ends_as_the_uninterrupted_run(reference, victims, tmp_path):
    rng = np.random.default_rng(len(victims[0][0]) + sum(map(ord, victims[0][0])))
    at = sorted(int(s) for s in rng.choice(np.arange(2, STEPS - 7), size=len(victims), replace=False))
    eng = LocalEngine()
    kill = Killer(eng, dict(zip(at, victims, strict=True)))
    ckpt = tmp_path / "ckpt"
    h = train(
        model().main,
        data(),
        mode="sync",
        return_params=True,
        checkpoint=str(ckpt),
        checkpoint_every=4,
        max_restarts=len(victims),
        engine=eng,
        callback=kill,
        **RUN,
    )
    assert_same_run(h, reference)
    assert [r.culprit for r in h.restarts] == [v for v, _ in victims]
    for r in h.restarts:
        assert r.resumed_from % 4 == 0 and r.resumed_from <= r.failed_at_step
        assert r.checkpoint in (None, str(ckpt / f"step-{r.resumed_from:08d}"))
        assert r.steps_lost == r.failed_at_step - r.resumed_from and r.seconds_lost >= 0
        assert r.trainers == RUN["trainers"] and r.servers == 2 and r.note == ""
    assert all(b >= a for a, b in zip(h.time, h.time[1:], strict=False))  # one clock over the attempts
    assert alive(kill.pids) == []


def test_without_a_checkpoint_it_restarts_from_the_start_and_gives_up_after_n(tmp_path):
    eng = LocalEngine()
    kill = Killer(eng, {3: ("cpu:0", KILL), 5: ("cpu:1", KILL)})
    with pytest.raises(
        TrainingError, match=r"(?s)cpu:1 failed: was killed by signal SIGKILL.*giving up"
    ) as e:
        # 400 steps, not 16: on a quiet machine the trainers ran all 16 steps before the driver's
        # callback saw step 3, so the kill came after cpu:0 had finished (rightly no restart)
        run = {**RUN, "steps": 400}
        train(model().main, data(), mode="sync", engine=eng, callback=kill, failure=FailureConfig(1), **run)
    err = e.value
    assert err.who == "cpu:1" and "after 1 restart(s)" in str(err)
    assert [(r.culprit, r.resumed_from, r.checkpoint) for r in err.restarts] == [("cpu:0", 0, None)]
    assert err.restarts[0].steps_lost == err.restarts[0].failed_at_step >= 4
    assert "cpu:0 failed (was killed by signal SIGKILL); restarted from step 0 (the start)" in str(err)
    assert err.history.first_step == 0 and err.history.steps >= 6  # the second attempt's steps
    assert alive(kill.pids) == []


def test_a_checkpoint_being_written_when_a_shard_dies_is_never_restored(reference, tmp_path, monkeypatch):
    """Shard ps:1 is killed once the save of step 8 has begun (its stage made, ps:0 writing into it):
    the run restarts from step 4, and no trace of the broken save is left."""
    eng, real_begin, broken = LocalEngine(), ps_checkpoint.begin, []

    def begin(path):
        stage = real_begin(path)
        if path.name == "step-00000008" and not broken:
            broken.append(stage)
            pid = eng.pids()["ps:1"]
            os.kill(pid, KILL)
            while alive([pid]):
                time.sleep(0.01)
        return stage

    monkeypatch.setattr(ps_checkpoint, "begin", begin)
    ckpt = tmp_path / "ckpt"
    h = train(
        model().main,
        data(),
        mode="sync",
        return_params=True,
        checkpoint=str(ckpt),
        checkpoint_every=4,
        max_restarts=1,
        engine=eng,
        stall_timeout=30,
        **RUN,
    )
    assert broken and not broken[0].exists()
    (r,) = h.restarts
    assert r.culprit == "ps:1" and r.resumed_from == 4 and r.checkpoint == str(ckpt / "step-00000004")
    assert_same_run(h, reference)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000012", "step-00000016"]  # keep=2, no stage


def test_checkpoints_by_time_bound_the_work_a_restart_loses(reference, tmp_path):
    eng = LocalEngine()
    kill = Killer(eng, {7: ("cpu:0", KILL)})
    ckpt = tmp_path / "ckpt"
    h = train(
        model().main,
        data(),
        mode="sync",
        return_params=True,
        checkpoint=str(ckpt),
        checkpoint_every_s=0.01,
        keep=20,
        max_restarts=1,
        engine=eng,
        callback=kill,
        **RUN,
    )
    assert_same_run(h, reference)
    steps = [int(p.rsplit("-", 1)[1]) for p in h.saved]
    assert len([s for s in steps if s < STEPS]) >= 2  # timed saves before the end
    (r,) = h.restarts
    assert r.checkpoint in h.saved and 0 < r.resumed_from <= r.failed_at_step


def beta1_pow(path) -> dict[str, float]:
    """Adam's Beta1Pow of every dense table in checkpoint `path`, read with numpy from its files."""
    doc = json.loads((path / "manifest.json").read_text())
    out = {}
    for e in doc["files"]:
        with np.load(path / e["file"]) as z:
            if "Beta1Pow" in z.files and z["Beta1Pow"].size == 1:
                out[e["table"]] = float(z["Beta1Pow"].reshape(()))
    return out


def test_an_async_restart_applies_no_gradient_twice_and_trains_each_batch_once(tmp_path):
    """Adam multiplies a table's Beta1Pow (which starts at beta1) by beta1 at each applied push:
    after a restarted async run it is beta1 ** (1 + the pushes of STEPS steps), so the lost steps'
    pushes are gone and none from before the checkpoint was applied again."""
    eng = LocalEngine()
    kill = Killer(eng, {9: ("gpu:0", KILL)})
    ckpt = tmp_path / "ckpt"
    h = train(
        model().main,
        data(),
        mode="async",
        checkpoint=str(ckpt),
        checkpoint_every=4,
        max_restarts=1,
        engine=eng,
        callback=kill,
        **RUN,
    )
    (r,) = h.restarts
    assert r.culprit == "gpu:0" and r.resumed_from in (8, 12) and h.steps == STEPS
    assert h.examples == [BATCH] * STEPS
    pows = beta1_pow(ckpt / f"step-{STEPS:08d}")
    per_step = transpile(model().main).pushes(RUN["trainers"])  # trainers pushing each table per step
    assert pows and set(pows) <= set(per_step)
    for name, got in pows.items():  # Beta1Pow starts at beta1 (0.9) and is multiplied per push
        assert round(np.log(got) / np.log(0.9)) == 1 + STEPS * per_step[name], name


def click_csv(path, rows: int) -> None:
    rng = np.random.default_rng(3)
    a, b, x = rng.integers(0, 20, rows), rng.integers(0, 30, rows), rng.normal(0, 1, rows)
    click = (((a % 3 == 0) | (x > 0.8)) & (rng.random(rows) < 0.9)).astype(int)
    lines = ["a,b,x,click"] + [f"u{a[i]},i{b[i]},{x[i]:.4f},{click[i]}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")


def test_a_file_dataset_resumes_at_the_checkpoints_position_and_trains_each_row_once(tmp_path):
    """A CSV read by 2 reader trainers for 2 epochs, a reader killed in the second epoch: the
    restarted run trains every row once per epoch (examples counted) and ends as the
    uninterrupted run."""
    from runtime.data import open_dataset
    from runtime.data.models import fit

    rows = 320
    click_csv(tmp_path / "log.csv", rows)
    schema = {"label": "click", "dense": ["x"], "sparse": ["a", "b"], "vocab": 50}
    kw = dict(epochs=2, trainers={"cpu": 2, "gpu": 1}, mode="sync", allow_emulation=True, progress=False)

    def dataset():
        return open_dataset(tmp_path / "log.csv", schema, batch_size=32)

    _, want, _ = fit("wide_deep", dataset(), **kw)
    per_epoch = want.steps // 2
    eng = LocalEngine()
    kill = Killer(eng, {per_epoch + 4: ("cpu:1", KILL)})
    ckpt = tmp_path / "ckpt"
    _, got, _ = fit(
        "wide_deep",
        dataset(),
        checkpoint=str(ckpt),
        checkpoint_every=4,
        max_restarts=1,
        engine=eng,
        callback=kill,
        **kw,
    )
    (r,) = got.restarts
    assert r.culprit == "cpu:1" and r.resumed_from % 4 == 0 and per_epoch < r.resumed_from <= r.failed_at_step
    assert sum(got.examples) == 2 * rows == sum(want.examples)
    assert got.examples == want.examples and got.steps == want.steps
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-6)
    for name, value in want.params.items():
        assert np.max(np.abs(got.params[name] - value)) <= 1e-6 * max(1.0, float(np.max(np.abs(value)))), name


def test_the_max_restarts_flag_reaches_the_failure_record():
    from runtime.cli.app import build_parser
    from runtime.cli.lifecycle import train_kwargs
    from runtime.driver.settings import Settings

    args = build_parser().parse_args(["train", "plan/", "--data", "synthetic", "--max-restarts", "2"])
    flat = train_kwargs(args, None, {})
    assert flat["max_restarts"] == 2
    assert Settings.of({k: v for k, v in flat.items() if v is not None}).failure == FailureConfig(2)
    default = train_kwargs(build_parser().parse_args(["train", "plan/", "--data", "synthetic"]), None, {})
    assert Settings.of(default).failure == FailureConfig(0)


class ShrunkEngine(LocalEngine):
    """The local engine on a machine that, once the first attempt is torn down, has room for
    `cpu` cpu trainers only (as a Ray cluster that lost a node: `RayEngine.fits`)."""

    def __init__(self, cpu: int) -> None:
        super().__init__()
        self.cpu, self.failed = cpu, False

    def stop(self, timeout: float = 3.0) -> None:
        self.failed = self.failed or bool(self.procs)
        super().stop(timeout)

    def fits(self, needs) -> bool:
        return not self.failed or sum(n.startswith("cpu:") for n in needs) <= self.cpu


def test_a_restart_goes_on_with_fewer_trainers_when_they_do_not_fit(reference, tmp_path):
    eng = ShrunkEngine(cpu=1)
    kill = Killer(eng, {6: ("cpu:1", KILL)})
    h = train(
        model().main,
        data(),
        mode="sync",
        return_params=True,
        checkpoint=str(tmp_path / "ckpt"),
        checkpoint_every=4,
        failure=FailureConfig(max_restarts=1, min_trainers={"cpu": 1}),
        engine=eng,
        callback=kill,
        **RUN,
    )
    (r,) = h.restarts
    assert (
        r.trainers == {"cpu": 1, "gpu": 1}
        and r.servers == 2
        and set(eng.pids()) == {"ps:0", "ps:1", "cpu:0", "gpu:0"}
    )
    assert r.note == (
        "fewer processes fit: restarted with trainers {'cpu': 1, 'gpu': 1} and 2 shard(s) "
        "(was {'cpu': 2, 'gpu': 1} and 2)"
    )
    # one reader trains the same global batches as two: the same run up to float32 summation order
    assert h.steps == STEPS and h.examples == [BATCH] * STEPS
    np.testing.assert_allclose(h.loss, reference.loss, rtol=1e-5)


def test_the_fewest_trainers_allowed_that_still_do_not_fit_end_the_restarts():
    from runtime.driver.restart import _fitting
    from transpiler.settings import ScaleConfig

    scale = ScaleConfig(trainers={"cpu": 3, "gpu": 1}, servers=2)
    asked = []

    def fits(s):
        asked.append((dict(s.trainers), s.servers))
        return s.trainers["cpu"] == 1 and s.servers == 1

    got, note = _fitting(scale, {"cpu": 1}, fits)  # cpu 3 -> 2 -> 1, then shards 2 -> 1
    assert (got.trainers, got.servers) == ({"cpu": 1, "gpu": 1}, 1) and "fewer processes fit" in note
    assert asked[:3] == [({"cpu": 3, "gpu": 1}, 2), ({"cpu": 2, "gpu": 1}, 2), ({"cpu": 1, "gpu": 1}, 2)]
    none, why = _fitting(scale, {"cpu": 2}, lambda s: False)  # gpu not named: never fewer
    assert (
        none is None
        and why
        == "cannot place even {'cpu': 2, 'gpu': 1} trainers and 1 shard (min_trainers {'cpu': 2, 'gpu': 1})"
    )


@pytest.mark.slow  # three runs of four processes: about a minute on two cores
def test_a_stream_source_resumes_at_the_checkpoints_position_and_trains_each_record_once(tmp_path):
    """Pass directories (runtime.data.streams) read by 2 reader trainers, a reader killed mid-run:
    the restarted run reads the stream from the checkpoint's step on, so it trains every record
    once (examples counted; a batch never spans passes, so the batch sizes name the passes) and
    ends as the uninterrupted run."""
    from test_streams import write_pass

    from runtime.data.streams import PassDirectorySource

    root = tmp_path / "logs"
    write_pass(root, "20240101/23", [list(range(0, 7)), list(range(7, 17))])  # 17 records: 8, 8, 1
    write_pass(root, "20240102/00", [list(range(17, 30)), list(range(30, 33))])  # 16: 8, 8
    write_pass(root, "20240102/01", [list(range(33, 45))])  # 12: 8, 4
    schema = {"label": "click", "dense": ["rid"], "sparse": ["user"], "vocab": 64}
    kw = dict(steps=7, trainers={"cpu": 2, "gpu": 1}, mode="sync", allow_emulation=True, progress=False)
    net = wide_deep(num_slots=1, num_dense=1, vocab=64, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1))

    def source():
        return PassDirectorySource(root, schema, batch_size=8, follow=False)

    want = train(net.main, source(), return_params=True, **kw)
    assert want.examples == [8, 8, 1, 8, 8, 8, 4]  # the whole stream, each record once
    eng = LocalEngine()
    kill = Killer(eng, {4: ("cpu:1", KILL)})
    got = train(
        net.main,
        source(),
        return_params=True,
        checkpoint=str(tmp_path / "ckpt"),
        checkpoint_every=2,
        max_restarts=1,
        engine=eng,
        callback=kill,
        **kw,
    )
    (r,) = got.restarts
    assert r.culprit == "cpu:1" and 0 < r.resumed_from <= r.failed_at_step and r.resumed_from % 2 == 0
    assert got.examples == want.examples and sum(got.examples) == 45  # none twice, none skipped
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-6)
    for name, value in want.params.items():
        assert np.max(np.abs(got.params[name] - value)) <= 1e-6 * max(1.0, float(np.max(np.abs(value)))), name
    assert alive(kill.pids) == []
