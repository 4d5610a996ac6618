"""Checkpoints: a 2-shard save loads into 3 shards with identical pulls and optimizer state; a save
killed mid-way (a real SIGKILL) or failing on a full disk leaves the previous checkpoint intact; a
corrupted file or an array of the wrong shape is refused, never loaded as valid."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.ps import CheckpointError, PSError, Servers, Shard, save_shards
from runtime.ps.checkpoint import check_target
from transpiler.tables import TableSpec

REPO = Path(__file__).resolve().parents[3]
SPECS = [
    TableSpec(
        name="emb",
        kind="sparse",
        shape=[-1, 4],
        dtype="float32",
        initializer={"type": "normal", "std": 0.1, "seed": 3},
        optimizer={"type": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": 1},
    ),
    TableSpec(
        name="wide",
        kind="sparse",
        shape=[1000, 1],
        dtype="float32",
        initializer={"type": "uniform", "seed": 4},
        optimizer={"type": "adagrad", "lr": 0.1},
    ),
    TableSpec(
        name="fc_w",
        kind="dense",
        shape=[8, 3],
        dtype="float32",
        initializer={"type": "xavier", "seed": 5},
        optimizer={"type": "adagrad", "lr": 0.1},
    ),
    TableSpec(
        name="fc_b",
        kind="dense",
        shape=[3],
        dtype="float32",
        initializer={"type": "constant", "value": 0.0},
        optimizer={"type": "sgd", "lr": 0.1},
    ),
]


def _train(push, steps: int = 5, seed: int = 0) -> np.ndarray:
    """Push some gradients through `push(table, grad, ids)`; the ids it touched."""
    rng = np.random.default_rng(seed)
    seen = []
    for _ in range(steps):
        ids = rng.integers(0, 10**12, size=30)  # unbounded vocab: any int64 id
        push("emb", rng.normal(size=(30, 4)).astype(np.float32), ids)
        push("wide", rng.normal(size=(30, 1)).astype(np.float32), ids % 1000)
        push("fc_w", rng.normal(size=(8, 3)).astype(np.float32), None)
        push("fc_b", rng.normal(size=3).astype(np.float32), None)
        seen.append(ids)
    return np.concatenate(seen)


def _pulls(pull, ids: np.ndarray) -> dict:
    fresh = np.arange(5, 25)  # never touched: created from the initializer on both sides
    return {
        "emb": pull("emb", np.concatenate([ids, fresh])),
        "wide": pull("wide", ids % 1000),
        "fc_w": pull("fc_w", None),
        "fc_b": pull("fc_b", None),
    }


def _same(a: dict, b: dict) -> None:
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_two_shard_checkpoint_loads_into_three_shards(tmp_path):
    with (
        Servers(SPECS, num_shards=2, checkpoint_root=tmp_path) as two,
        Servers(SPECS, num_shards=3, checkpoint_root=tmp_path) as three,
    ):
        c2, c3 = two.client(), three.client()
        push2 = lambda t, g, i: c2.push(t, g, i)
        pull2 = lambda t, i: c2.pull(t, i)
        c2.assign("fc_b", np.array([1, 2, 3], np.float32))  # e.g. imported weights
        ids = _train(push2)
        c2.save(tmp_path / "ckpt")
        c3.load(tmp_path / "ckpt")
        _same(_pulls(pull2, ids), _pulls(lambda t, i: c3.pull(t, i), ids))
        # optimizer state (Adam moments, beta powers, Adagrad accumulators) came along too
        _train(push2, steps=2, seed=1)
        _train(lambda t, g, i: c3.push(t, g, i), steps=2, seed=1)
        _same(_pulls(pull2, ids), _pulls(lambda t, i: c3.pull(t, i), ids))
        # and into one in-process shard
        one = Shard(SPECS)
        c2.save(tmp_path / "again")
        one.load(tmp_path / "again")
        _same(_pulls(pull2, ids), _pulls(one.pull, ids))
        files = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["files"]
        assert len(files) == 2 * 2 + 2  # two sparse tables on 2 shards + two dense tables
        c2.close()
        c3.close()


def _saved_shards(path: Path) -> list[Shard]:
    shards = [Shard(SPECS, shard=k, num_shards=2) for k in range(2)]

    def push(table, grad, ids):
        for s in shards:
            if table in s.tables:
                if ids is None:
                    s.push(table, grad)
                else:
                    from runtime.ps import shard_of

                    mine = shard_of(ids, 2) == s.shard
                    s.push(table, grad[mine], ids[mine])

    _train(push)
    save_shards(shards, path)
    return shards


KILLER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.runtime.ps.test_ps_checkpoint import _saved_shards
real_replace, count = os.replace, []
def replace_then_die(src, dst):
    real_replace(src, dst)
    count.append(dst)
    if len(count) == 2:              # two data files written, manifest not yet
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace_then_die
_saved_shards(Path({path!r}))
"""


def test_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "ckpt"
    _saved_shards(path)  # a complete checkpoint first
    expected = _pulls(_loaded(path).pull, np.arange(5))
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER.format(repo=str(REPO), path=str(path))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # not a byte changed
    _same(_pulls(_loaded(path).pull, np.arange(5)), expected)
    stage = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.new-")]
    assert len(stage) == 1 and "manifest.json" not in os.listdir(stage[0])  # the unfinished save
    with pytest.raises(CheckpointError, match="incomplete: it has no manifest.json"):
        Shard(SPECS).load(stage[0])


def _loaded(path: Path) -> Shard:
    shard = Shard(SPECS)
    shard.load(path)
    return shard


def test_corrupted_file_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    _saved_shards(path)
    victim = next(p for p in path.iterdir() if p.suffix == ".npz")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"file '{victim.name}' .* does not match"):
        Shard(SPECS).load(path)


# -- atomic saves: a failed save keeps the previous checkpoint (issue 11, item 6) ---------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a file system that fills up (needs root, as in CI; skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_save_that_fills_the_disk_keeps_the_previous_checkpoint(small_disk):
    with Servers(SPECS, num_shards=2, checkpoint_root=small_disk) as servers, servers.client() as c:
        ids = _train(lambda t, g, i: c.push(t, g, i), steps=2)
        c.save(small_disk / "ckpt")  # small: fits
        saved = _pulls(lambda t, i: c.pull(t, i), ids)
        before = _tree(small_disk)
        many = np.arange(200_000, dtype=np.int64) * 7919  # 200k Adam rows: ~10 MB, does not fit
        for part in np.array_split(many, 4):
            c.push("emb", np.ones((part.size, 4), np.float32), part)
        with pytest.raises(PSError, match="No space left on device"):
            c.save(small_disk / "ckpt")
        assert _tree(small_disk) == before  # the old one untouched, the new one removed
        assert [p.name for p in small_disk.iterdir()] == ["ckpt"]
        c.load(small_disk / "ckpt")  # and it still loads, with the saved values
        _same(_pulls(lambda t, i: c.pull(t, i), ids), saved)


def test_an_array_whose_shape_differs_from_the_spec_is_refused_on_load(tmp_path):
    path = tmp_path / "ckpt"
    _saved_shards(path)
    manifest = json.loads((path / "manifest.json").read_text())
    entry = next(e for e in manifest["files"] if e["table"] == "fc_b")
    with np.load(path / entry["file"]) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["Param"] = np.array([42.0], np.float32)  # [1] where the spec says [3]: would broadcast
    np.savez(path / entry["file"], **arrays)
    entry["bytes"] = (path / entry["file"]).stat().st_size
    entry["sha256"] = hashlib.sha256((path / entry["file"]).read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))  # a consistent checksum, a wrong shape
    wrong = r"'fc_b' holds arrays .*'Param': \[1\].*needs .*'Param': \[3\]"
    with pytest.raises(CheckpointError, match=wrong):
        Shard(SPECS).load(path)


def test_a_target_that_cannot_hold_a_checkpoint_is_refused_before_saving(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot save a checkpoint at"):
        check_target(tmp_path / "a_file" / "ckpt")
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holding other files \(\['notes.txt'\]\)"):
        save_shards([Shard(SPECS)], home)
    assert [p.name for p in home.iterdir()] == ["notes.txt"] and len(list(tmp_path.iterdir())) == 2


def test_a_save_through_a_symlink_replaces_the_checkpoint_it_points_to(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    _saved_shards(tmp_path / "link")
    _saved_shards(tmp_path / "link")  # a second save swaps the directory behind the link
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    Shard(SPECS).load(tmp_path / "link")


def test_a_frozen_table_comes_back_from_a_checkpoint(tmp_path):
    """A table without an optimizer (frozen: e.g. imported, not trained) is saved and loaded like
    the others (loading used to fail reading the optimizer type of a frozen table)."""
    frozen = TableSpec(name="frozen", kind="dense", shape=[2, 3], initializer=None, optimizer=None)
    specs = [*SPECS, frozen]
    shard = Shard(specs)
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    shard.assign("frozen", value)
    save_shards([shard], tmp_path / "ckpt")
    again = Shard(specs)
    again.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(again.pull("frozen"), value)
