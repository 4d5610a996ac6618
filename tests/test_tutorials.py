"""Tutorials 03-08 run with small settings and must reach their own outcome (01 and 02 have their
own tests). Each tutorial's `main(argv)` is run in this process (05 then uses the session's Ray
instead of starting one) and returns what it measured.

Outcomes are judged on data the model had not trained on when it was scored: tutorials 03 and 05
report the AUC of each batch's predictions made *before* the step trained on it (progressive
validation), tutorial 04 scores a held-out set with the trained weights it gets back.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import pytest

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def tutorial(name: str):
    spec = importlib.util.spec_from_file_location(f"tutorial_{name[:2]}", TUTORIALS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_03_paddle_program_trains_heterogeneously(capsys):
    pytest.importorskip("paddle")
    out = tutorial("03_paddle_program.py").main(["--steps", "40"])
    printed = capsys.readouterr().out
    # device_guard placed the MLP on gpu; the embedding lookup went to cpu by its category
    assert "'matmul' -> gpu: explicit op_device='gpu'" in printed
    assert "'embedding' -> cpu: category 'sparse'" in printed
    assert out["loss_last"] < out["loss_first"] - 0.03
    assert out["auc"] > 0.70


def test_04_onnx_model_trains_and_exports_its_split(tmp_path):
    out = tutorial("04_onnx_model.py").main(["--steps", "60", "--eval-size", "4096", "--out", str(tmp_path)])
    assert out["loss_last"] < out["loss_first"] - 0.05
    assert out["auc_after"] > 0.62 and out["auc_after"] > out["auc_before"] + 0.1
    assert sorted(Path(f).name for f in out["onnx"]) == ["cpu.onnx", "gpu.onnx"]
    ops = {}
    for f in out["onnx"]:
        model = onnx.load(f)
        onnx.checker.check_model(model)
        ops[Path(f).stem] = {(n.domain or "ai.onnx", n.op_type) for n in model.graph.node}
    for side in ("cpu", "gpu"):  # the boundary is in both exported graphs
        assert {("ai.hetps", "send"), ("ai.hetps", "recv")} <= ops[side]
    # the lookups stayed on cpu (as standard Gathers from pulled rows), the MLP went to gpu
    assert {("ai.onnx", "Gather"), ("ai.hetps", "pull_sparse")} <= ops["cpu"]
    assert {("ai.onnx", "MatMul"), ("ai.onnx", "Relu"), ("ai.hetps", "pull_dense")} <= ops["gpu"]
    assert ("ai.onnx", "MatMul") not in ops["cpu"] and ("ai.onnx", "Gather") not in ops["gpu"]


def test_05_ray_cluster_trains_on_ray_actors(ray_local, tmp_path, capsys):
    out = tutorial("05_ray_cluster.py").main(
        ["--steps", "30", "--batch", "128", "--trace", str(tmp_path / "trace.json")]
    )
    printed = capsys.readouterr().out
    for name in ("ps:0", "cpu:0", "cpu:1", "gpu:0"):
        assert f"{name} ran at tcp://" in printed
    assert out["loss_last"] < out["loss_first"] - 0.05
    assert out["auc"] > 0.72
    assert (tmp_path / "trace.json").stat().st_size > 1000


def test_06_csv_click_log_trains_through_the_cli_and_scores_held_out_rows(tmp_path, capsys):
    out = tutorial("06_csv_click_log.py").main(["--rows", "6000", "--epochs", "2", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "$ hetps train --data" in printed and "--schema" in printed and "--model wide_deep" in printed
    assert f"on 1200 rows of {tmp_path / 'test.csv'}" in printed  # the held-out 20%, read by the schema
    assert out["auc"] > 0.75  # held-out rows never trained on; chance is 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["schema.yaml", "test.csv", "train.csv"]


def test_07_lifecycle_is_interrupted_resumes_and_serves_its_export(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    # 120 steps: 110 after the first checkpoint (about 1.7 s here) for Ctrl-C to reach the first run
    out = tutorial("07_lifecycle.py").main(
        ["--steps", "120", "--every", "10", "--held-out", "4", "--out", str(tmp_path)]
    )
    printed = capsys.readouterr().out
    assert "$ hetps train" in printed and "--checkpoint-every 10" in printed
    assert "hetps exited with 130" in printed  # Ctrl-C ended the first run
    assert out["stopped_at"] == out["first_step"] and out["first_step"] % 10 == 0 and out["first_step"] < 120
    assert out["first_step"] + out["steps"] == 120  # steps count the whole run
    assert [e["step"] for e in out["eval"]][-1] == 120
    assert out["served_auc"] == pytest.approx(out["auc"], abs=1e-4) and out["auc"] > 0.7
    assert out["max_diff"] < 1e-5


def test_multi_task_trains_esmm_with_an_auc_per_task(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    out = tutorial("10_multi_task.py").main(["--steps", "60", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "tasks ['ctr', 'ctcvr']" in printed and "AUC per task over the last" in printed
    assert out["loss_last"] < out["loss_first"] - 0.05
    # held-out impressions never trained on, scored from the checkpoint: both tasks learned
    assert out["held_out_auc"]["ctr"] > 0.65 and out["held_out_auc"]["ctcvr"] > 0.65
    assert out["predict_shape"] == (4096, 2) and out["servable_outputs"] == ["ctr", "ctcvr"]
    assert out["onnx_auc"]["ctr"] > 0.6 and out["onnx_auc"]["ctcvr"] > 0.6


def _check_08(out: dict, printed: str) -> None:
    passes = out["passes"]
    assert [p["action"] for p in passes] == ["published", "published", "rolled back"]  # hour 2 poisoned
    assert "below the mean" in passes[2]["verdict"]
    assert passes[1]["online_auc"] > 0.7  # scored before training on it: data the model had not seen
    assert [p["published"]["kind"] for p in passes[:2]] == ["full", "delta"]
    assert all(p["lag_ready_trained_s"] > 0 and p["lag_event_trained_s"] > 0 for p in passes)
    assert out["served_diff"] < 1e-5 and out["next_auc"] > 0.7
    assert "online AUC" in printed and "published" in printed


def test_08_online_training_holds_the_poisoned_hour_and_serves_what_it_trained(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    out = tutorial("08_online_training.py").main(
        ["--hours", "3", "--rows", "1500", "--poison", "2", "--out", str(tmp_path)]
    )
    _check_08(out, capsys.readouterr().out)


@pytest.mark.slow
def test_08_online_training_from_nats_jetstream(tmp_path, capsys):
    pytest.importorskip("nats")
    out = tutorial("08_online_training.py").main(
        [
            "--hours",
            "3",
            "--rows",
            "1500",
            "--poison",
            "2",
            "--broker",
            "--pass-seconds",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    _check_08(out, capsys.readouterr().out)


def test_09_pytorch_model_trains_through_from_torch():
    pytest.importorskip("torch")  # the optional extra: pip install 'hetps[torch]'
    out = tutorial("09_pytorch_model.py").main(["--steps", "40"])
    assert out["auc_after"] > out["auc_before"] + 0.08
    assert out["torch_gap"] < 1e-5  # torch's own forward pass with the weights hetps trained
