"""`train`'s settings records: each option checked once, by its record, with an error naming it;
flat keywords and records make the same run (and the same run as one process); the tuner's
`ScaleConfig` goes to `train` as it is; a settings file maps onto the same records."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from runtime import (
    CheckpointConfig,
    EvalConfig,
    Executor,
    FailureConfig,
    RunConfig,
    ScaleConfig,
    TelemetryConfig,
    train,
)
from runtime.cli.common import UsageError, load_settings
from runtime.data import SyntheticCTR
from runtime.driver.settings import FLAT, GROUPS, ResolvedRun, Settings
from transpiler import TranspileConfig, transpile
from transpiler import builder as nn
from transpiler.cost.tune import Budget
from transpiler.models import wide_deep


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: ScaleConfig(trainers={"cpu": 0}),
            r"ScaleConfig.trainers\['cpu'\] must be a positive int, got 0",
        ),
        (lambda: ScaleConfig(trainers=[2]), "ScaleConfig.trainers must map trainer types to counts"),
        (lambda: ScaleConfig(micro_batches=0), "ScaleConfig.micro_batches must be a positive int, got 0"),
        (lambda: ScaleConfig(servers=1.5), "ScaleConfig.servers must be a positive int, got 1.5"),
        (lambda: ScaleConfig(mode="geo"), "ScaleConfig.mode 'geo': expected 'sync' or 'async'"),
        (lambda: ScaleConfig(dense_on_trainer="no"), "ScaleConfig.dense_on_trainer must be True or False"),
        (lambda: ScaleConfig(kernel_threads={"gpu": 0}), r"ScaleConfig.kernel_threads\['gpu'\] must be"),
        (lambda: ScaleConfig(device_map={"gpu": "tpu"}), r"device_map\['gpu'\] = 'tpu'"),
        (lambda: RunConfig(steps=0), "RunConfig.steps must be a positive int, got 0"),
        (lambda: RunConfig(epochs=True), "RunConfig.epochs must be a positive int, got True"),
        (lambda: RunConfig(until_loss="low"), "RunConfig.until_loss must be a number"),
        (lambda: RunConfig(batch_size=-8), "RunConfig.batch_size must be a positive int, got -8"),
        (lambda: RunConfig(stall_timeout=0), "RunConfig.stall_timeout must be a positive number, got 0"),
        (lambda: RunConfig(allow_emulation=1), "RunConfig.allow_emulation must be True or False"),
        (lambda: RunConfig(return_params=None), "RunConfig.return_params must be True or False"),
        (lambda: RunConfig(device_graphs="yes"), "RunConfig.device_graphs must be True or False"),
        (lambda: CheckpointConfig(dir=3), "CheckpointConfig.dir must be a path"),
        (lambda: CheckpointConfig(every=0, dir="d"), "CheckpointConfig.every must be a positive int"),
        (lambda: CheckpointConfig(keep=0), "CheckpointConfig.keep must be a positive int, got 0"),
        (lambda: CheckpointConfig(every=5), r"CheckpointConfig.every \(checkpoint_every=N\) needs a dir"),
        (lambda: CheckpointConfig(every_s=0, dir="d"), "CheckpointConfig.every_s must be a positive number"),
        (
            lambda: CheckpointConfig(every_s=5.0),
            r"CheckpointConfig.every_s \(checkpoint_every_s=S\) needs a dir",
        ),
        (lambda: FailureConfig(max_restarts=-1), "FailureConfig.max_restarts must be an int >= 0, got -1"),
        (lambda: FailureConfig(min_trainers=[1]), "FailureConfig.min_trainers must map trainer types"),
        (
            lambda: FailureConfig(min_trainers={"cpu": 0}),
            r"FailureConfig.min_trainers\['cpu'\] must be a positive",
        ),
        (lambda: EvalConfig(every=0, data=[]), "EvalConfig.every must be a positive int, got 0"),
        (lambda: EvalConfig(every=5), r"EvalConfig.every \(eval_every=N\) needs data"),
        (lambda: EvalConfig(group="user"), r"EvalConfig.group \(eval_group=\) needs data"),
        (lambda: EvalConfig(data=[], slice_by=3), r"EvalConfig.slice_by \(eval_slice_by=\) must be a column"),
        (lambda: TelemetryConfig(metrics=1), "TelemetryConfig.metrics must be a path"),
        (lambda: TelemetryConfig(progress="yes"), "TelemetryConfig.progress must be True or False"),
        (lambda: TelemetryConfig(callback=3), "TelemetryConfig.callback must be callable"),
    ],
)
def test_each_option_is_checked_by_its_record_with_its_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_flat_keyword_is_checked_by_the_record_that_holds_it():
    """The flat form goes through the same records: the same error, before any process starts."""
    model = wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1))
    data = SyntheticCTR(vocab=100)
    for flat, message in (
        ({"micro_batches": 0}, "ScaleConfig.micro_batches must be a positive int"),
        ({"mode": "geo"}, "ScaleConfig.mode 'geo'"),
        ({"keep": 0, "checkpoint": "ckpt"}, "CheckpointConfig.keep must be a positive int"),
        ({"eval_every": 2}, r"EvalConfig.every \(eval_every=N\) needs data"),
        ({"stall_timeout": -1.0}, "RunConfig.stall_timeout must be a positive number"),
    ):
        with pytest.raises(ValueError, match=message):
            train(model.main, data, steps=1, batch_size=8, allow_emulation=True, **flat)
    # every mode check is the one of transpiler.config.check_mode
    for make in (lambda: Budget(cpu=4, modes=("geo",)), lambda: TranspileConfig(mode="eventually")):
        with pytest.raises(ValueError, match="expected 'sync' or 'async'"):
            make()


def test_a_flat_keyword_beside_its_record_or_an_unknown_one_is_refused():
    model = wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1))
    data = SyntheticCTR(vocab=100)
    with pytest.raises(TypeError, match=r"run= and \['steps'\], which RunConfig holds"):
        train(model.main, data, run=RunConfig(steps=1, batch_size=8), steps=2)
    with pytest.raises(TypeError, match=r"checkpoint= and \['keep'\], which CheckpointConfig holds"):
        train(model.main, data, steps=1, batch_size=8, checkpoint=CheckpointConfig(dir="d"), keep=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['step'\]"):
        train(model.main, data, step=1, batch_size=8)
    with pytest.raises(TypeError, match="scale= must be a ScaleConfig, got dict"):
        train(model.main, data, scale={"trainers": {"cpu": 1}}, steps=1, batch_size=8)
    # a flat keyword of another group goes beside a record
    s = Settings.of({"steps": 3, "metrics": "m.jsonl"}, scale=ScaleConfig(servers=2))
    assert (s.scale.servers, s.run.steps, s.telemetry.metrics) == (2, 3, "m.jsonl")


def test_flat_keywords_and_records_are_the_same_settings():
    """Every flat name lands on its record's field, and back (`Settings.flat`)."""
    held_out = [{"x": np.zeros(2)}]
    flat = dict(
        trainers={"cpu": 1, "gpu": 2},
        micro_batches=2,
        servers=2,
        mode="async",
        dense_on_trainer=False,
        kernel_threads={"gpu": 2},
        device_map={"gpu": "gpu"},
        steps=4,
        epochs=None,
        until_loss=0.1,
        batch_size=16,
        stall_timeout=30.0,
        allow_emulation=True,
        return_params=True,
        device_graphs=False,
        checkpoint="ckpt",
        checkpoint_every=2,
        checkpoint_every_s=30.0,
        keep=3,
        resume="old",
        eval_data=held_out,
        eval_every=2,
        eval_output="sigmoid_0.tmp",
        eval_group="user",
        eval_slice_by="country",
        metrics="m.jsonl",
        trace="t.json",
        progress=False,
        tensorboard="tb",
        callback=print,
        max_restarts=2,
        min_trainers={"cpu": 1},
    )
    assert set(flat) == set(FLAT) and {g for g, _ in FLAT.values()} == set(GROUPS)
    records = Settings(
        ScaleConfig({"cpu": 1, "gpu": 2}, 2, 2, "async", False, {"gpu": 2}, {"gpu": "gpu"}),
        RunConfig(4, None, 0.1, 16, 30.0, True, True, False),
        CheckpointConfig("ckpt", 2, 3, "old", 30.0),
        EvalConfig(held_out, 2, "sigmoid_0.tmp", "user", "country"),
        TelemetryConfig("m.jsonl", "t.json", False, "tb", print),
        FailureConfig(2, {"cpu": 1}),
    )
    assert Settings.of(flat) == records and records.flat() == flat


def test_flat_keywords_and_records_give_the_same_run_as_one_process():
    """A short sync run given flat keywords and the same run given records: the same losses, each
    the single-process losses, and the same trainer specs (the resolved records)."""
    model = wide_deep(vocab=200, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.2))
    data = SyntheticCTR(vocab=200, seed=5)
    steps, batch = 3, 32
    flat = dict(trainers={"cpu": 1, "gpu": 1}, servers=2, mode="sync", micro_batches=2)
    a = train(model.main, data, steps=steps, batch_size=batch, allow_emulation=True, progress=False, **flat)
    b = train(
        model.main,
        data,
        scale=ScaleConfig(trainers={"cpu": 1, "gpu": 1}, servers=2, mode="sync", micro_batches=2),
        run=RunConfig(steps=steps, batch_size=batch, allow_emulation=True),
        telemetry=TelemetryConfig(progress=False),
    )
    exe = Executor()
    exe.run(model.startup)
    want = [
        float(exe.run(model.main, feed=data.batch(t, batch), fetch_list=[model.loss])[0])
        for t in range(steps)
    ]
    np.testing.assert_allclose(a.loss, want, rtol=1e-5)
    np.testing.assert_allclose(b.loss, want, rtol=1e-5)
    assert a.loss == b.loss and set(a.trainers) == set(b.trainers) == {"cpu:0", "gpu:0"}
    plan = transpile(model.main)
    by_flat = ResolvedRun.make(
        plan, data, Settings.of({**flat, "steps": steps, "batch_size": batch, "allow_emulation": True})
    )
    by_records = ResolvedRun.make(
        plan,
        data,
        Settings(ScaleConfig(**flat), RunConfig(steps=steps, batch_size=batch, allow_emulation=True)),
    )
    assert by_flat == by_records and by_flat.scale.trainer_names() == ["cpu:0", "gpu:0"]


def test_the_tuners_scale_goes_to_train_as_it_is(tmp_path):
    """`tune(...).scale` is a ScaleConfig train takes unchanged: the run has the tuned trainers,
    shards, micro-batches and mode (the metrics' start record says so)."""
    from test_cost import synthetic_profile

    from runtime.telemetry.outputs import read_metrics
    from transpiler.cost.profile import KernelCost
    from transpiler.cost.tune import tune

    model = wide_deep(vocab=100, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1))
    plan = transpile(model.main)
    prof = synthetic_profile(plan, lambda k, op: KernelCost(1e-4, 1e-6))
    res = tune(model.main, prof, Budget(cpu=3, gpu=1, micro_batches=(1, 2)), batch_size=32, placement=False)
    assert isinstance(res.scale, ScaleConfig) and res.scale.trainers is not None
    hist = train(
        transpile(model.main, res.config),
        SyntheticCTR(vocab=100),
        scale=res.scale,
        run=RunConfig(steps=2, batch_size=res.workload.batch_size, allow_emulation=True),
        telemetry=TelemetryConfig(metrics=str(tmp_path / "m.jsonl"), progress=False),
    )
    start = read_metrics(tmp_path / "m.jsonl")[0]
    assert start["trainers"] == res.scale.trainers and start["servers"] == res.scale.servers
    assert (start["micro_batches"], start["mode"]) == (res.scale.micro_batches, res.scale.mode)
    assert hist.steps == 2 and set(hist.trainers) == set(res.scale.trainer_names())


def test_a_settings_file_maps_onto_the_records(tmp_path):
    """A grouped file (`scale:`, `run:`, ...) and a flat one (train's names, as `hetps tune` writes)
    make the same records; the cost model's keys go to the Workload."""
    grouped = {
        "scale": {"trainers": {"cpu": 2, "gpu": 1}, "micro_batches": 2, "servers": 1, "mode": "async"},
        "run": {"batch_size": 64, "steps": 10},
        "checkpoint": {"dir": "ckpt", "every": 5},
        "telemetry": {"metrics": "run.jsonl"},
        "workload": {"cores": 2, "unique_fraction": 0.5},
    }
    flat = {
        "trainers": {"cpu": 2, "gpu": 1},
        "micro_batches": 2,
        "servers": 1,
        "mode": "async",
        "batch_size": 64,
        "steps": 10,
        "checkpoint": "ckpt",
        "checkpoint_every": 5,
        "metrics": "run.jsonl",
        "cores": 2,
        "unique_fraction": 0.5,
    }
    got = []
    for name, doc in (("grouped", grouped), ("flat", flat)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        got.append(load_settings(str(path)))
    assert got[0] == got[1]
    settings, workload = got[0]
    assert settings.scale == ScaleConfig({"cpu": 2, "gpu": 1}, 2, 1, "async")
    assert settings.run == RunConfig(steps=10, batch_size=64)
    assert settings.checkpoint == CheckpointConfig("ckpt", 5) and settings.eval == EvalConfig()
    assert (workload.batch_size, workload.cores, workload.unique_fraction) == (64, 2, 0.5)
    bad = tmp_path / "bad.yaml"
    for doc, message in (
        ({"scale": {"trainer": {"cpu": 1}}}, r"unknown setting\(s\) \['trainer'\] of ScaleConfig"),
        ({"scale": {}, "runs": {}}, r"unknown setting group\(s\) \['runs'\]"),
        ({"run": {"steps": 0}}, "RunConfig.steps must be a positive int"),
    ):
        bad.write_text(yaml.safe_dump(doc))
        with pytest.raises(UsageError, match=message):
            load_settings(str(bad))
