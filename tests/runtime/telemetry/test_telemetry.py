"""runtime.telemetry (outputs, plot) in isolation: the metrics file, throughput, the progress
bar, the Chrome-trace layout, the curves. (End to end, test_cli.py checks a real run's files.)"""

from __future__ import annotations

import json
import math
import time

import pytest

from runtime.telemetry.outputs import (
    MetricsLog,
    Progress,
    Recorder,
    Telemetry,
    chrome_trace,
    pack_spans,
    read_metrics,
    unpack_spans,
)
from runtime.telemetry.plot import plot_metrics


def test_metrics_file_records_steps_with_windowed_throughput(tmp_path):
    path = tmp_path / "m.jsonl"
    tel = Telemetry(metrics=path, progress=False, meta={"mode": "sync"}, window=2)
    # steps finish at 1, 2, 4, 5 s with 100 examples each
    for step, t in enumerate([1.0, 2.0, 4.0, 5.0]):
        tel.step(
            {
                "step": step,
                "loss": 0.5 - step / 100,
                "auc": float("nan") if step == 0 else 0.6,
                "examples": 100,
                "time": t,
            }
        )
    tel.close({"steps": 4})
    recs = read_metrics(path)
    assert [r["kind"] for r in recs] == ["start", "step", "step", "step", "step", "end"]
    assert recs[0]["mode"] == "sync" and recs[-1]["steps"] == 4
    steps = recs[1:-1]
    assert steps[0]["auc"] is None  # NaN is not JSON: written as null
    assert [r["examples"] for r in steps] == [100, 200, 300, 400]
    # over the last 2 steps: (0,0)->(1,100): 100/s; (0,0)->(2,200): 100/s; (1,100)->(4,300): 66.7/s;
    # (2,200)->(5,400): 66.7/s
    got = [r["examples_per_s"] for r in steps]
    assert got == pytest.approx([100.0, 100.0, 200 / 3, 200 / 3])
    assert [r["elapsed_s"] for r in steps] == [1.0, 2.0, 4.0, 5.0]


def test_an_interrupted_metrics_file_still_reads(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path)
    log.write("step", step=0, loss=0.7)
    log.close()
    with open(path, "a") as f:
        f.write('{"kind": "step", "st')  # killed mid-line
    assert [r["step"] for r in read_metrics(path)] == [0]
    path.write_text('{"kind": "step"}\n[1, 2]\n{"kind": "end"}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2 is not a JSON object"):
        read_metrics(path)


def test_progress_bar_shows_loss_auc_and_throughput(capsys):
    bar = Progress(total=3, enabled=True)
    bar.update(1, loss=0.6, auc=float("nan"))
    bar.update(1, loss=0.69314, auc=0.5123, examples_per_s=12345.6)
    bar.close()  # shows the last state
    err = capsys.readouterr().err
    assert "2/3" in err and "loss=0.6931, auc=0.5123, ex/s=12,346" in err
    Progress(total=3, enabled=False).update(1, loss=0.1)
    assert capsys.readouterr().err == ""


def test_chrome_trace_one_process_per_track_servers_first_lanes_as_threads():
    rec = Recorder()
    t = time.perf_counter()
    rec.span("segment 0", "compute", t, t + 0.002, step=0, mb=1)
    assert abs(rec.spans[0][2] / 1e6 - time.time()) < 5  # wall-clock microseconds
    spans = rec.take()
    assert rec.take() == []
    spans.append(["push", "ps", spans[0][2] + 500.0, 100.0, {"step": 0}, 1])  # a background-thread span
    tracks = {
        "gpu:0": [["recv", "comm", spans[0][2] - 1000.0, 10.0, {}, 0]],
        "cpu:0": spans,
        "ps:0": [["pull", "ps", spans[0][2] + 100.0, 50.0, {"table": "w"}, 0]],
    }
    trace = json.loads(json.dumps(chrome_trace(tracks, {"mode": "sync"})))
    ev = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert procs == {1: "ps shard 0", 2: "trainer cpu:0", 3: "trainer gpu:0"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert threads == {(1, 0): "ps:0", (2, 0): "cpu:0", (2, 1): "cpu:0 background", (3, 0): "gpu:0"}
    x = sorted((e for e in ev if e["ph"] == "X"), key=lambda e: e["ts"])
    assert x[0]["ts"] == 0 and x[0]["name"] == "recv"  # time starts at the earliest span
    assert [(e["name"], e["pid"], e["tid"], e["ts"]) for e in x[1:]] == [
        ("segment 0", 2, 0, 1000.0),
        ("pull", 1, 0, 1100.0),
        ("push", 2, 1, 1500.0),
    ]
    seg = next(e for e in x if e["name"] == "segment 0")
    assert seg["dur"] == pytest.approx(2000, abs=1) and seg["args"] == {"step": 0, "mb": 1}
    assert trace["otherData"] == {"mode": "sync"}
    assert unpack_spans(pack_spans(spans)) == spans


def test_disabled_recorder_records_nothing():
    rec = Recorder(on=False)
    rec.span("x", "y", 0.0, 1.0)
    assert rec.take() == []


def test_plot_compares_runs_and_refuses_files_without_steps(tmp_path):
    for name, slope in (("sync", 0.01), ("async", 0.02)):
        log = MetricsLog(tmp_path / f"{name}.jsonl")
        for s in range(30):
            log.write("step", step=s, loss=math.exp(-slope * s), auc=0.5 + s / 100, examples_per_s=1000.0 + s)
        log.close()
    out = plot_metrics([tmp_path / "sync.jsonl", tmp_path / "async.jsonl"], tmp_path / "c.png")
    assert out.stat().st_size > 20_000
    empty = MetricsLog(tmp_path / "empty.jsonl")
    empty.write("start")
    empty.close()
    with pytest.raises(ValueError, match="holds no step records"):
        plot_metrics([tmp_path / "empty.jsonl"], tmp_path / "e.png")


def read_tensorboard(logdir) -> dict[str, list[tuple[int, float]]]:
    """Scalars of the event files in `logdir` as TensorBoard itself reads them: {tag: [(step, value)]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_history_beside_the_jsonl(tmp_path):
    """A real run with `tensorboard=` and `metrics=`: TensorBoard's own reader finds loss, AUC and
    examples/s at every step, equal to the History (loss, AUC) and to the JSONL file (examples/s),
    and `hetps plot` still draws that JSONL file."""
    import numpy as np

    from runtime import train
    from runtime.data import SyntheticCTR
    from transpiler import builder as nn
    from transpiler import transpile
    from transpiler.models import wide_deep

    plan = transpile(wide_deep(vocab=100, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1)).main)
    steps = 6
    hist = train(
        plan,
        SyntheticCTR(vocab=100, seed=1),
        steps=steps,
        batch_size=64,
        trainers={"cpu": 1, "gpu": 1},
        servers=1,
        micro_batches=1,
        allow_emulation=True,
        progress=False,
        metrics=str(tmp_path / "run.jsonl"),
        tensorboard=str(tmp_path / "tb"),
    )
    assert hist.steps == steps and all(math.isfinite(a) for a in hist.auc)
    got = read_tensorboard(tmp_path / "tb")
    assert {t for t in got if not t.startswith("tables/")} == {"loss", "auc", "examples_per_s"}
    assert [s for s, _ in got["loss"]] == [s for s, _ in got["auc"]] == list(range(steps))
    # event files hold float32: equal to the History's float64 values at float32 precision
    np.testing.assert_allclose([v for _, v in got["loss"]], hist.loss, rtol=1e-6)
    np.testing.assert_allclose([v for _, v in got["auc"]], hist.auc, rtol=1e-6)
    jsonl = [r for r in read_metrics(tmp_path / "run.jsonl") if r["kind"] == "step"]
    rates = {r["step"]: r["examples_per_s"] for r in jsonl if r["examples_per_s"] is not None}
    assert rates and dict(got["examples_per_s"]) == pytest.approx(rates, rel=1e-6)
    assert plot_metrics([tmp_path / "run.jsonl"], tmp_path / "curves.png").stat().st_size > 10_000


def test_per_shard_table_counts_reach_tensorboard_and_the_jsonl(tmp_path):
    """A run over 2 shards with count admission (an id gets a row at its 2nd sighting): the event
    file read back by TensorBoard's reader holds tables/<table>/<count>/shard_<k> at the last step,
    equal to the JSONL "tables" record; summed over the shards, rows = admitted = the ids seen at
    least twice in the steps' batches, counted by hand."""
    from collections import Counter

    from runtime import train
    from runtime.data import SyntheticCTR
    from transpiler import TranspileConfig, transpile
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    m = wide_deep(num_slots=4, vocab=100, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1))
    plan = transpile(m.main, TranspileConfig(sparse_entry={"type": "count", "threshold": 2}))
    steps, data = 4, SyntheticCTR(vocab=100, num_slots=4, seed=1)
    hist = train(
        plan,
        data,
        steps=steps,
        batch_size=32,
        trainers={"cpu": 1, "gpu": 1},
        servers=2,
        allow_emulation=True,
        progress=False,
        metrics=str(tmp_path / "run.jsonl"),
        tensorboard=str(tmp_path / "tb"),
    )
    # a sighting is one push (one step: 1 trainer, 1 micro-batch) holding the id
    seen = Counter(i for t in range(steps) for i in set(data.batch(t, 32)["sparse"].ravel().tolist()))
    twice = sum(1 for c in seen.values() if c >= 2)
    got = read_tensorboard(tmp_path / "tb")
    (record,) = [r for r in read_metrics(tmp_path / "run.jsonl") if r["kind"] == "tables"]
    assert record["step"] == steps and set(record["shards"]) == {"wide_emb.w_0", "deep_emb.w_0"}
    for table, shards in record["shards"].items():
        assert len(shards) == 2 and shards == hist.tables[table]["shards"]
        for k, counts in enumerate(shards):
            assert set(counts) == {"rows", "admitted", "evicted", "spilled"}
            for count, v in counts.items():
                assert got[f"tables/{table}/{count}/shard_{k}"] == [(steps, v)]
        assert sum(c["rows"] for c in shards) == sum(c["admitted"] for c in shards) == twice
        assert all(c["rows"] > 0 for c in shards)


def test_tensorboard_leaves_out_undefined_auc(tmp_path):
    tel = Telemetry(progress=False, tensorboard=tmp_path)
    for step, a in enumerate([float("nan"), 0.75]):
        tel.step({"step": step, "loss": 1.0 - step / 4, "auc": a, "examples": 10, "time": step + 1.0})
    tel.close()
    got = read_tensorboard(tmp_path)
    assert got["auc"] == [(1, 0.75)] and got["loss"] == [(0, 1.0), (1, 0.75)]
