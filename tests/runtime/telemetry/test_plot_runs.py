"""`hetps plot` on a metrics file that several runs appended to: each new run is its own line, a
resumed run continues the line of the run it resumes."""

from __future__ import annotations

from runtime.telemetry.outputs import MetricsLog
from runtime.telemetry.plot import plot_metrics, split_runs


def _run(log: MetricsLog, steps: range) -> None:
    log.write("start", trainers={"cpu": 1})
    for s in steps:
        log.write("step", step=s, loss=1.0 / (s + 1), auc=0.5)
    log.write("end", steps=len(steps))


def test_new_runs_split_resumed_runs_continue(tmp_path):
    from runtime.telemetry.outputs import read_metrics

    path = tmp_path / "run.jsonl"
    log = MetricsLog(path)
    _run(log, range(0, 5))
    _run(log, range(5, 8))  # resumed from step 5: the same run
    _run(log, range(0, 4))  # a new run from step 0
    log.close()
    runs = split_runs(read_metrics(path))
    assert [[r["step"] for r in run if r["kind"] == "step"] for run in runs] == [
        list(range(8)),
        list(range(4)),
    ]
    assert plot_metrics([path], tmp_path / "c.png").stat().st_size > 0


def test_held_out_ctr_figures_reach_tensorboard_and_the_metrics_file(tmp_path):
    from test_telemetry import read_tensorboard

    from runtime.telemetry.outputs import Telemetry, read_metrics

    tel = Telemetry(tmp_path / "m.jsonl", progress=False, tensorboard=tmp_path / "tb")
    tel.step({"step": 0, "loss": 0.7, "auc": 0.5, "examples": 10, "time": 1.0})
    rec = {"step": 1, "loss": 0.6, "auc": 0.7, "examples": 50, "logloss": 0.6, "calibration": 1.25}
    tel.eval(rec)
    tel.close()
    got = read_tensorboard(tmp_path / "tb")
    assert got["eval_calibration"] == [(1, 1.25)] and got["eval_logloss"] == [(1, 0.6000000238418579)]
    (ev,) = [r for r in read_metrics(tmp_path / "m.jsonl") if r["kind"] == "eval"]
    assert ev["calibration"] == 1.25


def test_the_auc_panel_draws_the_held_out_gauc_when_recorded(tmp_path):
    from runtime.telemetry.outputs import eval_records, read_metrics, step_records
    from runtime.telemetry.plot import panel_lines

    path = tmp_path / "run.jsonl"
    log = MetricsLog(path)
    _run(log, range(0, 4))
    log.write("eval", step=2, loss=0.6, auc=0.7, examples=64, gauc=0.66)
    log.write("eval", step=4, loss=0.5, auc=0.75, examples=64, gauc=0.68)
    log.write("eval", step=5, loss=0.5, auc=0.75, examples=64)  # an evaluation without a group
    log.close()
    records = read_metrics(path)
    steps, evals = step_records(records), eval_records(records)
    lines = {name: (xs, ys) for name, xs, ys, _ in panel_lines("auc", "r", steps, evals, [])}
    assert lines["r held-out GAUC"] == ((2, 4), (0.66, 0.68))
    assert lines["r held-out"] == ((2, 4, 5), (0.7, 0.75, 0.75))
    assert "r held-out GAUC" not in {n for n, *_ in panel_lines("loss", "r", steps, evals, [])}
    assert plot_metrics([path], tmp_path / "c.png").stat().st_size > 0
