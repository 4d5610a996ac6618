"""The online pass loop (runtime/driver/online.py) and publishing (runtime/driver/publish.py) on
real pass directories, real trainer and server processes, onnxruntime as the serving reference.

Passes are click logs where a user's click rate depends on the user; `runtime.predict` on the
pass's checkpoint is the reference the published model (full ONNX + deltas, scored by
onnxruntime) must match."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ops_registry.errors import ConfigError
from runtime import OnlineConfig, predict, train
from runtime.data.streams import PassDirectorySource, StreamStalled
from runtime.driver.online import BadPass
from runtime.driver.publish import ServedModel, apply_delta, read_latest
from runtime.telemetry.outputs import read_metrics
from transpiler import builder as nn
from transpiler.config import TranspileConfig
from transpiler.models import wide_deep
from transpiler.plan import transpile

SCHEMA = {"label": "click", "dense": ["x"], "sparse": ["user"], "vocab": 64}
BATCH = 32


def write_pass(logs: Path, hour: int, n: int = 128, *, flip: bool = False, flag: bool = True) -> Path:
    rng = np.random.default_rng(hour)
    d = logs / f"20240101/{hour:02d}"
    d.mkdir(parents=True)
    user, x = rng.integers(0, 16, n), rng.normal(size=n)
    click = (rng.random(n) < 1 / (1 + np.exp(-(3 * (user % 2) - 1.5 + x)))).astype(int)
    if flip:
        click = 1 - click
    rows = "".join(f"{c},{v:.4f},u{u}\n" for c, v, u in zip(click, x, user, strict=True))
    (d / "part-00000.csv").write_text("click,x,user\n" + rows)
    if flag:
        (d / "_SUCCESS").write_text("")
    return d


@pytest.fixture(scope="module")
def plan():
    """Wide&Deep with every op on the cpu trainer (one trainer process)."""
    model = wide_deep(num_slots=1, num_dense=1, vocab=64, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.5))
    return transpile(model.main, TranspileConfig(name_devices={"*": "cpu"}))


def source(logs: Path, **kw) -> PassDirectorySource:
    return PassDirectorySource(logs, SCHEMA, batch_size=BATCH, follow=False, **kw)


def run(plan, logs, root, online=None, **kw):
    return train(
        plan,
        source(logs),
        checkpoint=root / "ck",
        trainers={"cpu": 1},
        mode="sync",
        progress=False,
        online=online,
        **kw,
    )


def batches_of(logs: Path, pass_id: str) -> list[dict]:
    src = source(logs)
    for p in src.passes():
        got = list(p.batches)
        if p.id == pass_id:
            return got
    raise AssertionError(pass_id)


def scores(served: ServedModel, batches: list[dict]) -> np.ndarray:
    return np.concatenate([served.predict(b) for b in batches])


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["all", "existing"])
def test_after_every_pass_the_published_model_plus_deltas_scores_as_predict_on_its_checkpoint(
    plan, tmp_path, rows
):
    """One pass per call (resume in between): full, delta, delta, full with full_every=3; after
    each, onnxruntime on the published chain == runtime.predict on the committed checkpoint."""
    logs = tmp_path / "logs"
    for h in range(4):
        write_pass(logs, h)
    cfg = OnlineConfig(publish=tmp_path / "pub", full_every=3, rows=rows, max_passes=1)
    kinds = []
    for h in range(4):
        hist = run(plan, logs, tmp_path, cfg, resume=tmp_path / "ck" if h else None)
        (rec,) = hist.passes
        assert rec["pass"] == f"20240101/{h:02d}" and rec["examples"] == 128 and rec["steps"] == 4
        kinds.append(rec["published"]["kind"])
        ck = tmp_path / "ck" / hist.state.checkpoint
        served = ServedModel.load(tmp_path / "pub")
        for pid in ("20240101/00", f"20240101/{h:02d}"):
            data = batches_of(logs, pid)
            np.testing.assert_allclose(scores(served, data), predict(plan, data, checkpoint=ck), atol=1e-5)
    assert kinds == ["full", "delta", "delta", "full"]
    latest = read_latest(tmp_path / "pub")
    assert latest["chain"] == ["v00000004-full"] and latest["pass"] == "20240101/03"
    assert not list((tmp_path / "pub").glob(".tmp-*"))


def test_a_pass_is_scored_before_training_then_published_as_predict_scores_its_checkpoint(plan, tmp_path):
    """Two passes: pass 2's online loss is the log loss (numpy, by hand) of pass 1's checkpoint's
    predictions on pass 2; the published full model + delta scores as that checkpoint."""
    logs = tmp_path / "logs"
    for h in range(2):
        write_pass(logs, h, 64)
    cfg = OnlineConfig(publish=tmp_path / "pub")
    hist = run(plan, logs, tmp_path, cfg, metrics=tmp_path / "m.jsonl", keep=3)
    assert [p["published"]["kind"] for p in hist.passes] == ["full", "delta"]
    data = batches_of(logs, "20240101/01")
    y = np.concatenate([b["label"] for b in data])
    q = np.clip(predict(plan, data, checkpoint=tmp_path / "ck" / "step-00000002"), 1e-7, 1 - 1e-7)
    logloss = float(np.mean(-(y * np.log(q) + (1 - y) * np.log(1 - q))))
    assert hist.passes[1]["online_loss"] == pytest.approx(logloss, rel=1e-4)
    ck = tmp_path / "ck" / hist.state.checkpoint
    served = ServedModel.load(tmp_path / "pub")
    np.testing.assert_allclose(scores(served, data), predict(plan, data, checkpoint=ck), atol=1e-5)
    recs = [r for r in read_metrics(tmp_path / "m.jsonl") if r["kind"] == "pass"]
    assert [r["pass"] for r in recs] == ["20240101/00", "20240101/01"]
    assert all(r["lag_ready_published_s"] >= r["lag_ready_trained_s"] >= 0 for r in recs)
    assert recs[1]["changed_rows"] > 0 and recs[1]["published"]["rows"] == recs[1]["changed_rows"]


def test_apply_delta_inserts_replaces_and_removes_rows_by_raw_id(tmp_path):
    """The delta format by hand: ids 5 and 9 held; a delta changes 9, adds 7, removes 5."""
    d = tmp_path / "v00000002-delta"
    d.mkdir()
    np.savez(
        d / "delta.npz",
        **{
            "t0.ids": np.array([9, 7]),
            "t0.rows": np.array([[90.0], [70.0]], np.float32),
            "t0.removed": np.array([5]),
            "t1.value": np.ones((2, 2), np.float32),
        },
    )
    manifest = {"format": 1, "kind": "delta", "version": 2, "base": 1, "previous": 1, "pass": "p",
                "tables": {"emb": {"kind": "sparse", "key": "t0", "rows": 2},
                           "w": {"kind": "dense", "key": "t1", "rows": 2}}}  # fmt: skip
    (d / "manifest.json").write_text(json.dumps(manifest))
    tables = {"emb": (np.array([5, 9]), np.array([[5.0], [9.0]], np.float32)), "w": np.zeros((2, 2))}
    out = apply_delta(tables, d)
    np.testing.assert_array_equal(out["emb"][0], [7, 9])
    np.testing.assert_array_equal(out["emb"][1], [[70.0], [90.0]])
    np.testing.assert_array_equal(out["w"], np.ones((2, 2)))
    assert tables["emb"][0].tolist() == [5, 9]  # the input is left alone


class Kill(Exception):
    pass


@pytest.mark.slow
def test_a_run_killed_mid_pass_resumes_and_trains_every_example_exactly_once(plan, tmp_path):
    """The trainers' own step reports, by step number (a re-trained step overwrites the killed
    run's): steps 0..N-1 once each, their examples the records written; the metrics' pass records
    of both runs name each pass once."""
    logs = tmp_path / "logs"
    sizes = [100, 70, 90]  # 4, 3 and 3 global batches of 32 (the last of each pass shorter)
    for h, n in enumerate(sizes):
        write_pass(logs, h, n)
    seen: dict[int, int] = {}

    def killer(rec):
        seen[rec["step"]] = rec["examples"]
        if rec["step"] == 5:  # the second step of the second pass
            raise Kill

    with pytest.raises(Exception) as e:  # noqa: PT011 (train may wrap it)
        run(plan, logs, tmp_path, metrics=tmp_path / "a.jsonl", callback=killer)
    assert "Kill" in repr(e.value) or isinstance(e.value, Kill)
    hist = run(
        plan,
        logs,
        tmp_path,
        resume=tmp_path / "ck",
        metrics=tmp_path / "b.jsonl",
        callback=lambda r: seen.__setitem__(r["step"], r["examples"]),
    )
    assert sorted(seen) == list(range(10))
    assert sum(seen.values()) == sum(sizes)
    done = [r for f in ("a.jsonl", "b.jsonl") for r in read_metrics(tmp_path / f) if r["kind"] == "pass"]
    assert [r["pass"] for r in done] == ["20240101/00", "20240101/01", "20240101/02"]
    assert sum(r["examples"] for r in done) == sum(sizes)
    assert hist.state.step == 10 and hist.state.checkpoint == "step-00000010"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hold", "rollback"])
def test_a_poisoned_pass_is_not_published_and_rollback_drops_its_training(plan, tmp_path, mode):
    """Pass 3 has its labels flipped: its online AUC falls far below the trailing passes'; the
    published model stays what pass 2 published (same LATEST, same scores)."""
    logs = tmp_path / "logs"
    for h in range(2):
        write_pass(logs, h, 192)
    write_pass(logs, 2, 192, flip=True)
    cfg = OnlineConfig(publish=tmp_path / "pub", on_regression=mode, auc_drop=0.1)
    hist = run(plan, logs, tmp_path, cfg, metrics=tmp_path / "m.jsonl")
    good, poisoned = hist.passes[1], hist.passes[2]
    assert good["action"] == "published"
    assert poisoned["action"] == ("held" if mode == "hold" else "rolled back")
    assert "below the mean" in poisoned["verdict"] and poisoned["published"] is None
    latest = read_latest(tmp_path / "pub")
    assert latest["version"] == 2 and latest["pass"] == "20240101/01"
    data = batches_of(logs, "20240101/01")
    pass2 = tmp_path / "ck" / "step-00000012"
    np.testing.assert_allclose(
        scores(ServedModel.load(tmp_path / "pub"), data), predict(plan, data, checkpoint=pass2), atol=1e-5
    )
    recs = [r for r in read_metrics(tmp_path / "m.jsonl") if r["kind"] == "pass"]
    assert [r["action"] for r in recs] == [r["action"] for r in hist.passes]
    if mode == "rollback":  # training goes on from pass 2's checkpoint
        assert hist.state.checkpoint == "step-00000012" and hist.state.last_pass == "20240101/02"
    else:
        assert hist.state.checkpoint == "step-00000018"


@pytest.mark.slow
def test_a_malformed_file_stops_before_training_the_pass_and_a_resume_reads_it_fixed(plan, tmp_path):
    logs = tmp_path / "logs"
    d = write_pass(logs, 0, 40)
    (d / "part-00000.csv").write_text("click,x,user\n1,0.5,u1\nnot,a,number\n")
    bad_file_is_refused(plan, logs, tmp_path)
    (d / "part-00000.csv").unlink()
    write_pass(logs, 1, 40)
    (d / "part-00000.csv").write_text("click,x,user\n1,0.5,u1\n0,0.1,u2\n")
    hist = run(plan, logs, tmp_path, resume=tmp_path / "ck")
    assert [p["examples"] for p in hist.passes] == [2, 40]


def bad_file_is_refused(plan, logs, tmp_path):
    with pytest.raises(BadPass, match=r"pass 20240101/00 cannot be read.*resume=DIR"):
        run(plan, logs, tmp_path)
    assert not (tmp_path / "ck" / "online.json").exists()  # nothing committed


def test_a_malformed_file_is_refused_before_its_pass_trains(plan, tmp_path):
    d = write_pass(tmp_path / "logs", 0, 40)
    (d / "part-00000.csv").write_text("click,x,user\n1,0.5,u1\nnot,a,number\n")
    bad_file_is_refused(plan, tmp_path / "logs", tmp_path)


def test_a_pass_without_its_done_flag_is_a_reported_stall(plan, tmp_path):
    logs = tmp_path / "logs"
    write_pass(logs, 0, 40, flag=False)
    src = PassDirectorySource(logs, SCHEMA, batch_size=BATCH, follow=True, poll=0.05, timeout=0.3)
    with pytest.raises(StreamStalled, match=r"20240101/00 has had no done flag"):
        train(plan, src, checkpoint=tmp_path / "ck", trainers={"cpu": 1}, metrics=tmp_path / "m.jsonl",
              progress=False)  # fmt: skip
    (stall,) = [r for r in read_metrics(tmp_path / "m.jsonl") if r["kind"] == "stall"]
    assert "no done flag" in stall["error"]


def test_settings_that_do_not_fit_a_stream_are_refused(plan, tmp_path):
    logs = tmp_path / "logs"
    with pytest.raises(ConfigError, match="needs checkpoint=DIR"):
        train(plan, source(logs), trainers={"cpu": 1})
    with pytest.raises(ConfigError, match="do not apply"):
        train(
            plan,
            source(logs),
            checkpoint=tmp_path / "ck",
            steps=3,
            trainers={"cpu": 1},
            online=OnlineConfig(),
        )
    with pytest.raises(ConfigError, match="shard=\\(0, 1\\)"):
        train(plan, source(logs, shard=(0, 2)), checkpoint=tmp_path / "ck", trainers={"cpu": 1})
    with pytest.raises(ConfigError, match="on_regression"):
        OnlineConfig(on_regression="panic")
    with pytest.raises(TypeError, match="needs a stream source"):
        train(plan, [{}], online=OnlineConfig(), checkpoint=tmp_path / "ck")


def test_hetps_plot_draws_the_passes_online_auc(tmp_path):
    """The same steps with and without "pass" records: the online line adds diamond-marked pixels
    in matplotlib's second colour (the step line takes the first)."""
    import matplotlib.image

    from runtime.telemetry.outputs import MetricsLog
    from runtime.telemetry.plot import plot_metrics

    for name, with_passes in (("plain", False), ("online", True)):
        log = MetricsLog(tmp_path / f"{name}.jsonl")
        for s in range(8):
            log.write(
                "step", step=s, loss=0.7 - 0.01 * s, auc=0.6, examples=32 * (s + 1), examples_per_s=100.0
            )
            if with_passes and s % 4 == 3:
                log.write("pass", pass_=str(s), step=s + 1, online_loss=0.9, online_auc=0.9)
        log.close()
        plot_metrics([tmp_path / f"{name}.jsonl"], tmp_path / f"{name}.png")
    orange = np.array([1.0, 0.498, 0.055])  # matplotlib's C1, the second line of a panel
    counts = {}
    for name in ("plain", "online"):
        img = matplotlib.image.imread(tmp_path / f"{name}.png")[..., :3].reshape(-1, 3)
        counts[name] = int((np.abs(img - orange).max(axis=1) < 0.02).sum())
    assert counts["plain"] == 0 and counts["online"] > 50


@pytest.mark.slow
def test_the_loop_on_nats_survives_a_broker_restart_without_losing_or_repeating_a_record(plan, tmp_path):
    """Two windows of messages on a real nats-server; the server is killed and restarted (same
    port, same JetStream store) while the first pass trains: every record is trained once."""
    import time

    from test_streams import NatsServer, publish

    from runtime.data.streams import NatsStreamSource

    server = NatsServer(tmp_path / "js")
    server.start()
    try:
        rng = np.random.default_rng(0)

        def msgs(lo, hi):
            rows = [
                json.dumps({"click": int(rng.integers(0, 2)), "x": 0.1, "user": f"u{r % 9}"})
                for r in range(lo, hi)
            ]
            return ["\n".join(rows[k : k + 10]).encode() for k in range(0, len(rows), 10)]

        time.sleep(2 - time.time() % 2 + 0.05)
        publish(server.url, msgs(0, 100))
        time.sleep(2 - time.time() % 2 + 0.05)  # the next 2 s window: the second pass
        publish(server.url, msgs(100, 170))
        restarted = []

        def restart(rec):
            if rec["step"] == 1 and not restarted:
                server.stop()
                server.start()
                restarted.append(rec["step"])

        src = NatsStreamSource("CLICKS", "clicks.log", SCHEMA, BATCH, servers=server.url, follow=False,
                               pass_seconds=2, reconnect_timeout=20)  # fmt: skip
        with src:
            hist = train(plan, src, checkpoint=tmp_path / "ck", trainers={"cpu": 1}, progress=False,
                         callback=restart)  # fmt: skip
    finally:
        server.stop()
    assert restarted == [1]
    assert [p["examples"] for p in hist.passes] == [100, 70] and hist.state.step == 4 + 3
    assert len({p["pass"] for p in hist.passes}) == 2 and not any(p["late"] for p in hist.passes)


def test_a_publish_that_fails_midway_leaves_the_served_model_whole_and_nan_rows_are_flagged(
    plan, tmp_path, monkeypatch
):
    """Publisher without training: the plan's initial tables published full, then a delta whose
    write fails (disk full, as the reader would see it): LATEST and the served scores stay; a
    NaN in a changed row is reported by the update, which the loop never publishes."""
    from runtime.driver import publish as pub_mod
    from runtime.evaluation.evaluate import full_tables

    tables = full_tables(plan, None)
    pub = pub_mod.Publisher(plan, tmp_path / "pub", full_every=5)
    pub.publish(pub.prepare_tables(tables), "p0")
    feed = {"sparse": np.array([[3], [9]]), "dense": np.zeros((2, 1), np.float32)}
    before = ServedModel.load(tmp_path / "pub").predict(feed)
    changed = {k: v.copy() for k, v in tables.items()}
    changed["deep_emb.w_0"][3] += 1.0
    update = pub.prepare_tables(changed)
    assert update.changed == {"deep_emb.w_0": 1} and not update.not_finite

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pub_mod.np, "savez", disk_full)
    with pytest.raises(OSError, match="No space"):
        pub.publish(update, "p1")
    monkeypatch.undo()
    assert read_latest(tmp_path / "pub")["version"] == 1
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == [pub_mod.LATEST, "v00000001-full"]
    np.testing.assert_array_equal(ServedModel.load(tmp_path / "pub").predict(feed), before)
    pub.publish(update, "p1")  # the next try publishes the delta
    after = ServedModel.load(tmp_path / "pub")
    assert after.version == 2 and not np.array_equal(after.predict(feed)[0], before[0])
    np.testing.assert_array_equal(after.predict(feed)[1], before[1])  # id 9's row did not change
    changed["wide_emb.w_0"][5] = np.nan
    assert pub.prepare_tables(changed).not_finite == ["wide_emb.w_0"]
