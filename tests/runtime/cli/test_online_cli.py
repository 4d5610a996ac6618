"""`hetps train PLAN_DIR --stream ... --schema ...`: the online loop from the shell."""

from __future__ import annotations

import json

import pytest
import test_online
from test_online import BATCH, SCHEMA, write_pass

from runtime.cli.app import main
from runtime.driver.publish import read_latest

plan = test_online.plan  # the module's fixture


@pytest.fixture
def setup(tmp_path, plan):
    plan.save(tmp_path / "plan")
    (tmp_path / "schema.yaml").write_text(json.dumps(SCHEMA))  # JSON is YAML
    return tmp_path


def test_stream_flags_that_do_not_fit_are_usage_errors(setup, capsys):
    t = setup
    base = ["train", str(t / "plan"), "--stream", str(t / "logs"), "--trainers", "cpu=1"]
    assert main(base) == 2
    assert "--schema" in capsys.readouterr().err
    assert main([*base, "--schema", str(t / "schema.yaml")]) == 2
    assert "--checkpoint DIR" in capsys.readouterr().err
    schema = ["--schema", str(t / "schema.yaml")]
    assert main([*base, *schema, "--checkpoint", str(t / "ck"), "--steps", "3"]) == 2
    assert main(["train", str(t / "plan"), "--trainers", "cpu=1", "--steps", "1"]) == 2
    assert "--data (or --stream" in capsys.readouterr().err


@pytest.mark.slow
def test_hetps_train_stream_trains_and_publishes_each_pass(setup, capsys):
    t = setup
    for h in range(2):
        write_pass(t / "logs", h, 64)
    argv = ["train", str(t / "plan"), "--stream", str(t / "logs"), "--schema", str(t / "schema.yaml")]
    argv += ["--batch-size", str(BATCH), "--trainers", "cpu=1", "--checkpoint", str(t / "ck")]
    argv += ["--publish", str(t / "pub"), "--metrics", str(t / "m.jsonl")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pass 20240101/01: 64 examples, online AUC" in out and "2 passes, 128 examples trained" in out
    assert read_latest(t / "pub")["chain"] == ["v00000001-full", "v00000002-delta"]
    write_pass(t / "logs", 2, 64)
    assert main([*argv, "--resume", str(t / "ck")]) == 0
    assert "1 passes, 64 examples trained" in capsys.readouterr().out


@pytest.mark.slow
def test_hetps_train_stream_reads_pass_directories_by_a_file_uri(setup, capsys):
    t = setup
    write_pass(t / "logs", 0, 40)
    argv = ["train", str(t / "plan"), "--stream", (t / "logs").as_uri(), "--schema", str(t / "schema.yaml")]
    argv += ["--batch-size", str(BATCH), "--trainers", "cpu=1", "--checkpoint", str(t / "ck")]
    assert main(argv) == 0
    assert "pass 20240101/00: 40 examples" in capsys.readouterr().out
    assert main([*argv[:3], "nosuchscheme://logs", *argv[4:]]) == 2
    assert "nosuchscheme://logs: neither pyarrow.fs" in capsys.readouterr().err
