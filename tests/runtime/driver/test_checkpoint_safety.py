"""A resume skips an unreadable newer checkpoint visibly (a warning naming it and why), and removes
the staging directory a driver killed mid-save left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.driver.checkpoints import latest, step_dir
from runtime.ps import Shard, save_shards
from transpiler.tables import TableSpec

REPO = Path(__file__).resolve().parents[3]
SPECS = [
    TableSpec(
        name="w",
        kind="dense",
        shape=[4],
        dtype="float32",
        initializer={"type": "constant", "value": 1.0},
        optimizer={"type": "sgd", "lr": 0.1},
    )
]


def _save(root: Path, step: int) -> Path:
    shard = Shard(SPECS)
    shard.push("w", np.full(4, step, np.float32))
    save_shards([shard], step_dir(root, step))
    return step_dir(root, step)


def test_a_corrupt_newest_manifest_is_skipped_with_a_warning_naming_it(tmp_path):
    _save(tmp_path, 3)
    newest = _save(tmp_path, 6)
    (newest / "manifest.json").write_text('{"format": "hetps-ps-checkpoint/1", "tab')
    with pytest.warns(
        RuntimeWarning, match=r"skipping checkpoint '.*step-00000006'.*manifest.json is not valid JSON"
    ):
        assert latest(tmp_path).name == "step-00000003"


KILLED_SAVE = """
import os, signal, sys
sys.path[:0] = [{repo!r}]
from pathlib import Path
from runtime.ps import checkpoint
stage = checkpoint.begin(Path({path!r}))
(stage / "000-w.shard0.npz").write_bytes(b"PK partial")  # a save killed while writing
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_stage_a_killed_save_left_is_removed_at_resume_and_the_last_checkpoint_loads(tmp_path):
    good = _save(tmp_path, 3)
    code = KILLED_SAVE.format(repo=str(REPO), path=str(step_dir(tmp_path, 6)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (stage,) = [p for p in tmp_path.iterdir() if p.name.startswith(".step-00000006.new-")]
    assert os.listdir(stage) == ["000-w.shard0.npz"]
    assert latest(tmp_path) == good and not stage.exists()
    shard = Shard(SPECS)
    shard.load(good)
    np.testing.assert_allclose(shard.pull("w", None), np.full(4, 1.0 - 0.1 * 3))
