"""The `hetps` command line: the round trip transpile -> inspect -> draw -> train -> plot on the
torch-exported ONNX model (tutorials/models), the formats `transpile` reads, and exit codes / usage
on bad arguments.

The round trip trains `widedeep_bce_ts.onnx` (a torch export with its BCE loss inside, batch fixed
at 4) on the local engine; its first step's loss is checked against the single-process Executor
on the same batch, and the trace must be valid Chrome-trace JSON with one track per process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from assets import MODELS

from runtime import Executor
from runtime.cli.app import main
from runtime.data import SyntheticCTR
from runtime.telemetry.outputs import read_metrics
from transpiler import Plan, from_onnx

STEPS = 12


def png_colours(path) -> np.ndarray:
    from matplotlib.image import imread

    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200
    return img[..., :3].reshape(-1, 3)


def near(pixels: np.ndarray, hex_colour: str) -> int:
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(pixels - rgb).max(axis=1) < 0.02).sum())


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """Run the whole session once; tests below look at its pieces."""
    tmp = tmp_path_factory.mktemp("cli")
    model = MODELS / "widedeep_bce_ts.onnx"
    outs = {}

    def run(*argv):
        rc = main([str(a) for a in argv])
        outs[argv[0]] = rc
        return rc

    run("transpile", model, "--out", tmp / "plan")
    run("inspect", tmp / "plan", "--explain", "36")
    run("draw", tmp / "plan", "-o", tmp / "plan.png")
    run(
        "train",
        tmp / "plan",
        "--data",
        "synthetic",
        "--feeds",
        "sparse=a,dense=b,label=c",
        "--batch-size",
        4,
        "--steps",
        STEPS,
        "--trainers",
        "cpu=1,gpu=1",
        "--micro-batches",
        1,
        "--servers",
        1,
        "--mode",
        "sync",
        "--allow-emulation",
        "--metrics",
        tmp / "run.jsonl",
        "--trace",
        tmp / "trace.json",
        "--no-progress",
    )
    run("plot", tmp / "run.jsonl", "-o", tmp / "curves.png")
    return tmp, model, outs


def test_round_trip_commands_succeed(round_trip, capsys):
    tmp, _, outs = round_trip
    assert outs == {"transpile": 0, "inspect": 0, "draw": 0, "train": 0, "plot": 0}
    plan = Plan.load(tmp / "plan")
    assert plan.trainer_types == ["cpu", "gpu"] and plan.loss_name == "36"


def test_draw_makes_a_picture_of_both_trainer_types(round_trip):
    tmp, _, _ = round_trip
    pixels = png_colours(tmp / "plan.png")
    # node colours of draw.py's palette: trainer cpu, trainer gpu; red crossing edges
    assert near(pixels, "#4c72b0") > 500 and near(pixels, "#55a868") > 500
    assert near(pixels, "#ff0000") > 50


def test_train_learns_what_the_executor_computes(round_trip):
    """Step 0's loss on the runtime equals the single-process Executor's on the same batch (the
    CLI's synthetic data is SyntheticCTR(seed=0) with the model's names), and the run trained."""
    tmp, model, _ = round_trip
    recs = read_metrics(tmp / "run.jsonl")
    assert [r["kind"] for r in recs] == ["start"] + ["step"] * STEPS + ["tables", "end"]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(STEPS)) and steps[-1]["examples"] == 4 * STEPS
    assert recs[0]["trainers"] == {"cpu": 1, "gpu": 1} and recs[-1]["steps"] == STEPS
    b = SyntheticCTR(vocab=1000, seed=0, sparse_name="a", dense_name="b", label_name="c").batch(0, 4)
    program = from_onnx(model)
    (loss0,) = Executor().run(program, feed=b, fetch_list=["36"])
    assert steps[0]["loss"] == pytest.approx(float(loss0), rel=1e-5)
    assert len({round(r["loss"], 6) for r in steps}) > 1
    assert all(r["examples_per_s"] is None or r["examples_per_s"] > 0 for r in steps)


def test_trace_is_chrome_trace_json_with_one_track_per_process(round_trip):
    tmp, _, _ = round_trip
    trace = json.loads((tmp / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["ps shard 0", "trainer cpu:0", "trainer gpu:0"]
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["pid"] in names and e["ts"] >= 0 and e["dur"] >= 0
    by_track = {names[p]: {e["name"] for e in spans if e["pid"] == p} for p in names}
    ps = by_track["ps shard 0"]  # requests of several tables go as one push_pull
    assert ps & {"pull", "push_pull"} and ps & {"push", "push_pull"}, ps
    for trainer in ("trainer cpu:0", "trainer gpu:0"):
        assert by_track[trainer] >= {"segment 0", "segment 1", "send", "recv"}, by_track[trainer]
    # the reader pulls and pushes its rows; the gpu trainer holds its MLP's tables and applies their
    # steps itself (runtime/ps/held_tables.py), writing them back at the end
    assert {"pull sparse", "push"} <= by_track["trainer cpu:0"], by_track["trainer cpu:0"]
    assert {"apply", "write back"} <= by_track["trainer gpu:0"], by_track["trainer gpu:0"]
    segs = [e for e in spans if e["name"].startswith("segment") and names[e["pid"]] == "trainer cpu:0"]
    assert {e["args"]["step"] for e in segs} == set(range(STEPS)) and all("mb" in e["args"] for e in segs)


def test_plot_draws_curves(round_trip):
    tmp, _, _ = round_trip
    pixels = png_colours(tmp / "curves.png")
    assert near(pixels, "#1f77b4") > 200  # matplotlib's first line colour: the curves are there


def test_transpile_reads_saved_paddle_and_hetps_programs(tmp_path):
    paddle = pytest.importorskip("paddle")
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        main_prog, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main_prog, startup):
            x = paddle.static.data("x", [-1, 5], "float32")
            y = paddle.static.data("y", [-1, 1], "float32")
            with paddle.static.device_guard("gpu"):
                loss = paddle.mean(paddle.square(paddle.static.nn.fc(x, 1) - y))
            paddle.optimizer.SGD(0.1).minimize(loss)
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            paddle.static.Executor(paddle.CPUPlace()).run(startup)
            paddle.static.save(main_prog, str(tmp_path / "pd" / "model"))
        weights = {p.name: np.array(scope.find_var(p.name).get_tensor()) for p in main_prog.all_parameters()}
    assert main(["transpile", str(tmp_path / "pd" / "model"), "--out", str(tmp_path / "p1")]) == 0
    plan = Plan.load(tmp_path / "p1")
    assert sorted(plan.params) == sorted(weights)
    for name, w in weights.items():  # training starts from the saved weights
        np.testing.assert_array_equal(plan.params[name], w)
    assert {t.optimizer.type for t in plan.tables} == {"sgd"}
    assert "gpu" in plan.trainer_types  # device_guard survived the save

    model = wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1))
    model.main.save(tmp_path / "wd")
    assert main(["transpile", str(tmp_path / "wd.json"), "--out", str(tmp_path / "p2")]) == 0
    assert len(Plan.load(tmp_path / "p2").tables) == len(model.main.parameters())


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "COMMAND"),
        (["frobnicate"], "invalid choice"),
        (["train"], "give --data (or --stream for online training)"),
        (["transpile", "no/such/model.onnx", "--out", "x"], "no model at"),
        (["draw", "not-a-plan", "-o", "x.png"], "is not a plan directory"),
        (["plot", "missing.jsonl", "-o", "x.png"], "no metrics file"),
    ],
)
def test_bad_arguments_print_usage_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr()
    assert "usage: hetps" in err.out + err.err and message in err.out + err.err


def test_bad_run_options_exit_2(round_trip, capsys):
    tmp, _, _ = round_trip
    plan = str(tmp / "plan")
    feeds = ["--feeds", "sparse=a,dense=b,label=c"]
    assert main(["train", plan, "--data", "synthetic", "--steps", "1", "--trainers", "cpu", *feeds]) == 2
    assert "expected TYPE=N" in capsys.readouterr().err
    assert main(["train", plan, "--data", "synthetic", "--steps", "1"]) == 2  # a/b/c are not CTR names
    assert "--feeds sparse=NAME" in capsys.readouterr().err
    assert main(["train", plan, "--data", "synthetic", *feeds]) == 2
    assert "say when to stop" in capsys.readouterr().err
    assert main(["train", plan, "--data", "nowhere.txt", "--steps", "1", *feeds]) == 2
    assert "expected 'synthetic', a .npz file" in capsys.readouterr().err
    assert main(["train", plan, "--data", "synthetic", "--steps", "1", "--address", "auto", *feeds]) == 2
    assert "add --engine ray" in capsys.readouterr().err


def test_bench_reports_throughput(capsys):
    argv = [
        "bench",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--vocab",
        "200",
        "--dim",
        "4",
        "--hidden",
        "8",
        "--batch-size",
        "32",
        "--trainers",
        "cpu=1,gpu=1",
        "--micro-batches",
        "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 steps in" in out and "examples/s" in out and "gpu:0: busy" in out
    assert "kernel threads" not in out


def test_bench_passes_kernel_threads_to_the_trainers(capsys):
    argv = [
        "bench",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--vocab",
        "200",
        "--dim",
        "4",
        "--hidden",
        "8",
        "--batch-size",
        "32",
        "--trainers",
        "cpu=1,gpu=1",
        "--kernel-threads",
        "gpu=2",
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.strip().startswith("gpu:0:") and ln.endswith("2 kernel threads)") for ln in lines), lines
    assert not any(ln.strip().startswith("cpu:0:") and "kernel threads" in ln for ln in lines), lines
    assert main([*argv[:-1], "gpu=0"]) == 2
    assert "--kernel-threads 'gpu=0': expected TYPE=N" in capsys.readouterr().err


def test_a_failing_command_exits_1_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "step", "step": 0}\nnot json\n{"kind": "end"}\n')
    assert main(["plot", str(bad), "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hetps plot: error: ValueError:") and "bad.jsonl:2 is not JSON" in err


def test_console_script_exit_codes():
    """The `hetps` entry point (setup.py's console script; `python -m runtime.cli` when the package
    is not installed) passes main's exit code on."""
    cmd = [shutil.which("hetps")] if shutil.which("hetps") else [sys.executable, "-m", "runtime.cli"]
    ok = subprocess.run([*cmd, "train", "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--trainers" in ok.stdout
    bad = subprocess.run([*cmd, "inspect"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage: hetps inspect" in bad.stderr


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hetps {version('hetps')}"


def test_inspect_explain_prints_only_the_explanation(round_trip, capsys):
    tmp, _, _ = round_trip
    assert main(["inspect", str(tmp / "plan"), "--explain", "36"]) == 0
    out = capsys.readouterr().out
    assert "gpu" in out and "plan:" not in out and "tables:" not in out


def test_config_errors_exit_2_and_name_the_file(tmp_path, capsys):
    model = str(MODELS / "wide_deep.onnx")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: [sync\n")
    for config, message in ((bad, f"--config {bad}: "), (tmp_path / "missing.yaml", "no such file")):
        argv = ["transpile", model, "--loss", "bce", "--out", str(tmp_path / "p"), "--config", str(config)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "usage: hetps transpile" in err and message in err


def test_training_errors_name_cli_flags_and_fit_one_line(round_trip, capsys, monkeypatch):
    from runtime.cli import app as cli
    from runtime.driver.train import TrainingError
    from runtime.exec import device

    tmp, _, _ = round_trip
    monkeypatch.setattr(device, "cuda_available", lambda: False)
    argv = [
        "train",
        str(tmp / "plan"),
        "--data",
        "synthetic",
        "--feeds",
        "sparse=a,dense=b,label=c",
        "--steps",
        "1",
    ]
    assert main(argv) == 2
    assert "pass --allow-emulation" in capsys.readouterr().err
    e = TrainingError("gpu:0", "\nTraceback (most recent call last):\n  File 'x'\nValueError: boom\n")
    expected = "gpu:0 failed: ValueError: boom (hetps -v ... shows its traceback)"
    assert cli.one_line(e, verbose=False) == expected
    assert "Traceback" in cli.one_line(e, verbose=True)


def test_emulation_is_announced_once_per_run(tmp_path):
    """The driver logs it; trainer processes do not repeat it (they printed it 2-4 times)."""
    plan = tmp_path / "plan"
    cmd = [sys.executable, "-m", "runtime.cli"]
    subprocess.run(
        [*cmd, "transpile", str(MODELS / "wide_deep.onnx"), "--loss", "bce", "--out", str(plan)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    run = subprocess.run(
        [
            *cmd,
            "train",
            str(plan),
            "--data",
            "synthetic",
            "--steps",
            "2",
            "--batch-size",
            "64",
            "--allow-emulation",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("EMULATING") == 1, run.stderr


def test_start_up_time_counts_placement(round_trip, monkeypatch):
    """Placing the processes (on Ray: ray.init and creating the actors) is start-up time; the Ray
    engine printed "+0.0 s start-up" because the clock started after it. Here placement is made to
    take 5 s on the local engine (otherwise instant): the run's start-up and wall time must account
    for all but the tear-down of the time `train` took."""
    import time

    from runtime import train
    from runtime.engines.local import LocalEngine

    tmp, _, _ = round_trip
    monkeypatch.setattr(LocalEngine, "place", lambda self, needs: time.sleep(5), raising=False)
    data = SyntheticCTR(vocab=1000, seed=0, sparse_name="a", dense_name="b", label_name="c")
    t = time.perf_counter()
    hist = train(
        Plan.load(tmp / "plan"),
        data,
        steps=2,
        batch_size=8,
        trainers={"cpu": 1, "gpu": 1},
        micro_batches=1,
        allow_emulation=True,
        progress=False,
    )
    total = time.perf_counter() - t
    assert hist.startup_s >= 5
    assert total - hist.startup_s - hist.wall_s < 5  # tear-down only: it was >= 5 before


def test_train_takes_run_settings_from_a_file_and_flags_override_it(tmp_path):
    """`train --settings run.yaml` (what `hetps tune` writes) runs with the file's trainers, servers,
    micro-batches and batch size; a flag given (--mode) wins over the file's value."""
    import yaml

    model = str(MODELS / "wide_deep.onnx")
    assert main(["transpile", model, "--loss", "bce", "--out", str(tmp_path / "p")]) == 0
    settings = {
        "trainers": {"cpu": 1, "gpu": 1},
        "micro_batches": 2,
        "servers": 2,
        "mode": "async",
        "batch_size": 64,
        "cores": None,
        "unique_fraction": 0.5,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(settings))
    rc = main(
        [
            "train",
            str(tmp_path / "p"),
            "--settings",
            str(tmp_path / "run.yaml"),
            "--mode",
            "sync",
            "--data",
            "synthetic",
            "--steps",
            "2",
            "--allow-emulation",
            "--no-progress",
            "--metrics",
            str(tmp_path / "run.jsonl"),
        ]
    )
    assert rc == 0
    start = read_metrics(tmp_path / "run.jsonl")[0]
    assert start["trainers"] == {"cpu": 1, "gpu": 1} and start["servers"] == 2
    assert start["micro_batches"] == 2 and start["batch_size"] == 64
    assert start["mode"] == "sync"  # the flag, not the file's async


@pytest.mark.parametrize(
    "text,message",
    [
        (None, "no such file"),
        ("trainers: {cpu: 1\n", "not the run.yaml of hetps tune"),  # not YAML
        ("- 1\n", "expected a mapping with 'trainers'"),
        ("trainers: {cpu: 1}\nthreads: 4\n", "unknown setting(s) ['threads']"),
        ("trainers: {cpu: 0}\n", "must be a positive int"),
        ("trainers: {cpu: 1}\nmode: eventually\n", "expected 'sync' or 'async'"),
    ],
)
def test_a_bad_settings_file_is_a_usage_error_naming_it(tmp_path, capsys, text, message):
    path = tmp_path / "run.yaml"
    if text is not None:
        path.write_text(text)
    plan = tmp_path / "no-plan-needed"  # the file is read before the plan
    assert main(["train", str(plan), "--settings", str(path), "--data", "synthetic", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--settings {path}" in err and message in err and "usage: hetps train" in err
