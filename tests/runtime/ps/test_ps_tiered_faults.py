"""Faults of tiered (disk) tables: a budget below one request's rows, a full disk while spilling
(a real 2 MiB tmpfs, where the test runs as root), truncated or corrupted saved files, engine
directories of killed processes. Each is a PSError naming table, shard and path; the last good
checkpoint stays loadable and equal to the rows saved."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from runtime.ps import PSError
from runtime.ps.shard import Shard, save_shards
from runtime.ps.tiered import TieredSparseTable, remove_stale_engines
from runtime.ps.tiered_store import EngineMemory
from transpiler.tables import TableSpec

ENGINE_FLOOR = EngineMemory.of_budget(1).nbytes  # RocksDB's share of a budget under 8 MiB (tiered_store)

REPO = Path(__file__).resolve().parents[3]
SPEC = TableSpec(
    "emb",
    "sparse",
    [-1, 16],
    initializer={"type": "uniform", "low": -1.0, "high": 1.0, "seed": 1},
    optimizer={"type": "adagrad", "lr": 0.1},
    storage="disk",
    memory_budget=ENGINE_FLOOR + 100_000,
)


@pytest.fixture
def tiny_disk():
    """A 2 MiB tmpfs (root only; skipped elsewhere), unmounted after the test."""
    mnt = Path(f"/tmp/hetps-tiny-{uuid.uuid4().hex[:8]}")
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode
    ):
        mnt.rmdir()
        pytest.skip("needs root to mount a small tmpfs")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)
    mnt.rmdir()


def test_a_request_over_the_budget_names_shard_table_and_budget():
    s = Shard([SPEC], shard=1, num_shards=2)
    with pytest.raises(
        PSError, match=r"tiered table 'emb' on shard 1 of 2: one request touches \d+ distinct rows"
    ):
        s.pull("emb", np.arange(0, 4000, 1))


def test_a_full_disk_while_spilling_names_the_store_and_the_last_checkpoint_loads(tmp_path, tiny_disk):
    t = TieredSparseTable(SPEC, store_dir=tiny_disk, shard="0 of 1")
    rng = np.random.default_rng(0)
    for lo in range(0, 2000, 200):
        t.push(rng.normal(size=(200, 16)).astype(np.float32), np.arange(lo, lo + 200))
    good = tmp_path / "good"
    t.save(good)
    want = t.peek(np.arange(2000))
    with pytest.raises(
        PSError, match=rf"on shard 0 of 1: writing store '{tiny_disk}/hetps-emb.*the disk holding it is full"
    ):
        for lo in range(2000, 10**6, 200):  # grows past the 2 MiB disk
            t.push(rng.normal(size=(200, 16)).astype(np.float32), np.arange(lo, lo + 200))
    t.close()
    assert not list(tiny_disk.iterdir())  # the engine's files are gone even so
    fresh = TieredSparseTable(SPEC, store_dir=tmp_path)
    fresh.load(good)
    np.testing.assert_array_equal(fresh.peek(np.arange(2000)), want)
    fresh.close()


def test_a_checkpoint_save_onto_a_full_disk_keeps_the_previous_one(tmp_path, tiny_disk):
    s = Shard([replace(SPEC, memory_budget=ENGINE_FLOOR + 4 * 10**6)])
    s.push("emb", np.ones((100, 16), np.float32), np.arange(100))
    save_shards([s], tiny_disk / "ckpt")
    want = s.tables["emb"].peek(np.arange(100))
    s.push("emb", np.ones((12000, 16), np.float32), np.arange(12000))  # ~1.5 MiB of rows + state
    (tiny_disk / "filler").write_bytes(b"\0" * (1 << 20))
    with pytest.raises(PSError, match="on shard 0 of 1: checkpointing store .* the disk holding it is full"):
        save_shards([s], tiny_disk / "ckpt")
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["ckpt", "filler"]  # no staging left
    s.close()
    back = Shard([SPEC])
    back.load(tiny_disk / "ckpt")
    np.testing.assert_array_equal(back.tables["emb"].peek(np.arange(100)), want)
    assert len(back.tables["emb"]) == 100
    back.close()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_saved_file_is_refused_naming_it(tmp_path, damage):
    s = Shard([SPEC])
    for lo in range(0, 3000, 300):
        s.push("emb", np.ones((300, 16), np.float32), np.arange(lo, lo + 300))
    save_shards([s], tmp_path / "a")
    save_shards([s], tmp_path / "b")
    s.close()  # (the saved SST files are hard links of the engine's: damage them only once it is gone)
    sst = max((tmp_path / "b").rglob("*.sst"), key=lambda f: f.stat().st_size)
    data = bytearray(sst.read_bytes())
    os.unlink(sst)  # a file of its own, so checkpoint a keeps its copy
    if damage == "truncate":
        del data[len(data) // 2 :]
    else:
        data[len(data) // 3] ^= 0xFF
    sst.write_bytes(bytes(data))
    with pytest.raises(
        PSError, match=rf"{tmp_path}/b/000-emb.shard0.tiered'?: file rows/{sst.name} .*truncated or corrupt"
    ):
        Shard([SPEC]).load(tmp_path / "b")
    ok = Shard([SPEC])
    ok.load(tmp_path / "a")
    assert len(ok.tables["emb"]) == 3000
    ok.close()


def test_engine_directories_of_killed_processes_are_removed_by_the_next_table(tmp_path):
    code = (
        "import os, signal, numpy as np\n"
        "from runtime.ps.tiered import TieredSparseTable\n"
        "from transpiler.tables import TableSpec\n"
        f"t = TieredSparseTable(TableSpec.from_dict({SPEC.to_dict()!r}), store_dir={str(tmp_path)!r})\n"
        "t.push(np.ones((10, 16), np.float32), np.arange(10)); t.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], env=env, timeout=120)
    assert r.returncode == -signal.SIGKILL
    (left,) = list(tmp_path.glob("hetps-emb*"))  # what a killed server leaves
    mine = TieredSparseTable(SPEC, store_dir=tmp_path)  # the janitor runs when a table is made
    assert not left.exists() and mine.path.exists()
    assert remove_stale_engines(tmp_path) == [] and mine.path.exists()  # a live process's stays
    mine.close()
    assert not list(tmp_path.glob("hetps-emb*"))
