"""`train(checkpoint=...)`: the directory is checked before any process starts, and a final save that
fails raises CheckpointSaveError carrying the run's History (issue 11, item 6)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from procs import alive

from runtime.data import SyntheticCTR
from runtime.driver.checkpoints import latest
from runtime.driver.train import CheckpointSaveError, train
from runtime.engines import LocalEngine
from runtime.ps import CheckpointError, Shard
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep


def test_an_unusable_checkpoint_directory_is_refused_before_any_process_starts(tmp_path):
    (tmp_path / "a_file").write_text("x")
    eng = LocalEngine()
    t = time.monotonic()
    with pytest.raises(CheckpointError, match="cannot save a checkpoint at"):
        train(
            wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1)).main,
            SyntheticCTR(vocab=100),
            steps=2,
            batch_size=32,
            engine=eng,
            allow_emulation=True,
            checkpoint=str(tmp_path / "a_file" / "ckpt"),
        )
    assert time.monotonic() - t < 5 and eng.pids() == {}


def test_a_failed_final_save_keeps_the_history_and_the_previous_checkpoint(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        model = wide_deep(vocab=1000, dim=8, optimizer=nn.SGD(lr=0.1))
        kw = dict(steps=3, batch_size=64, trainers={"cpu": 1, "gpu": 1}, allow_emulation=True)
        train(model.main, SyntheticCTR(vocab=1000), checkpoint=str(mnt / "ckpt"), **kw)
        Shard(transpile(model.main).tables).load(latest(mnt / "ckpt"))  # the first run's checkpoint
        before = {str(p): p.read_bytes() for p in (mnt / "ckpt").rglob("*") if p.is_file()}
        (mnt / "filler").write_bytes(b"\0" * (os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize - 4096))
        eng = LocalEngine()
        failed = r"training finished \(3 steps\).*No space left"
        with pytest.raises(CheckpointSaveError, match=failed) as err:
            train(model.main, SyntheticCTR(vocab=1000), checkpoint=str(mnt / "ckpt"), engine=eng, **kw)
        assert err.value.history.steps == 3 and len(err.value.history.loss) == 3
        assert {str(p): p.read_bytes() for p in (mnt / "ckpt").rglob("*") if p.is_file()} == before
        assert sorted(p.name for p in mnt.iterdir()) == ["ckpt", "filler"]  # no half-written save
        assert not alive(eng.pids().values())
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
