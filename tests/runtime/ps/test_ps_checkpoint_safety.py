"""A checkpoint reads only its own files, says which file is wrong and how, and the staging
directories of killed saves are removed by the next save (never one a live process writes)."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from test_ps_checkpoint import KILLER, REPO, SPECS, _loaded, _pulls, _same, _saved_shards

from runtime.ps import CheckpointError, Shard
from runtime.ps.checkpoint import MANIFEST, remove_stale_stages


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _fix_up(entry: dict, target: Path) -> None:
    """Give a manifest entry the size and sha256 of `target`, as a crafted manifest would."""
    entry["bytes"] = target.stat().st_size
    entry["sha256"] = hashlib.sha256(target.read_bytes()).hexdigest()


def _point_fc_b_at(ckpt: Path, name: str, target: Path) -> None:
    """Rewrite checkpoint `ckpt`'s fc_b entry to name file `name` (resolving to `target`: a file
    holding fc_b = [7, 7, 7]), with its size and sha256 fixed up."""
    doc = _manifest(ckpt)
    entry = next(e for e in doc["files"] if e["table"] == "fc_b")
    with np.load(ckpt / entry["file"]) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["Param"] = np.full(3, 7, np.float32)
    with open(target, "wb") as f:
        np.savez(f, **arrays)
    entry["file"] = name
    _fix_up(entry, target)
    (ckpt / MANIFEST).write_text(json.dumps(doc))


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, how):
    ckpt = tmp_path / "ckpt"
    _saved_shards(ckpt)
    outside = tmp_path / "x.npz"
    if how == "symlink":
        (ckpt / "003-fc_b.shard9.npz").symlink_to(outside)
        name = "003-fc_b.shard9.npz"
    else:
        name = "../x.npz" if how == "relative" else str(outside)
    _point_fc_b_at(ckpt, name, outside)
    shard = Shard(SPECS)
    before = shard.pull("fc_b", None).copy()
    with pytest.raises(
        CheckpointError, match=rf"\(table 'fc_b'\): file '{re.escape(name)}' resolves to .*outside"
    ):
        shard.load(ckpt)
    np.testing.assert_array_equal(shard.pull("fc_b", None), before)  # the table untouched


def test_a_manifest_entry_without_bytes_names_the_entry_and_the_field(tmp_path):
    ckpt = tmp_path / "ckpt"
    _saved_shards(ckpt)
    doc = _manifest(ckpt)
    name = doc["files"][0]["file"]
    del doc["files"][0]["bytes"]
    (ckpt / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"entry 0 \(file '{name}'\): field 'bytes' is missing"):
        Shard(SPECS).load(ckpt)


def test_a_truncated_npz_with_a_fixed_up_manifest_names_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    _saved_shards(ckpt)
    doc = _manifest(ckpt)
    entry = next(e for e in doc["files"] if e["table"] == "fc_w")
    victim = ckpt / entry["file"]
    victim.write_bytes(victim.read_bytes()[:100])
    _fix_up(entry, victim)
    (ckpt / MANIFEST).write_text(json.dumps(doc))
    assert not zipfile.is_zipfile(victim)
    with pytest.raises(
        CheckpointError, match=rf"file '{victim.name}' of table 'fc_w' is not a readable \.npz"
    ):
        Shard(SPECS).load(ckpt)


def test_the_stage_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    path = tmp_path / "ckpt"
    _saved_shards(path)
    expected = _pulls(_loaded(path).pull, np.arange(5))
    killer = KILLER.format(repo=str(REPO), here=str(Path(__file__).resolve().parent), path=str(path))
    proc = subprocess.run([sys.executable, "-c", killer], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (stage,) = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.new-")]
    assert os.listdir(stage)  # partial files of the killed save
    mine = tmp_path / f".other.new-{'0' * 32}-{os.getppid()}-{stage.name.split('-', 3)[-1]}"
    mine.mkdir()  # a stage of a live process (our parent): kept
    _same(_pulls(_loaded(path).pull, np.arange(5)), expected)  # the last good checkpoint loads
    _saved_shards(tmp_path / "next")  # the next save, beside it
    assert not stage.exists() and mine.is_dir()
    _same(_pulls(_loaded(path).pull, np.arange(5)), expected)
    assert remove_stale_stages(tmp_path) == []
