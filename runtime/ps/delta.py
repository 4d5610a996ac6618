"""Delta checkpoints of sparse tables: a chain of one full save, then saves of only the rows changed
since the previous save (a sparse `TableSpec` with `delta_every: K`, `TranspileConfig.
checkpoint_delta_every`: every K-th save of the table is full again).

A checkpoint directory stays self-contained: a delta save hard-links the files of the chain so far
(the full file or tiered directory and the earlier deltas) from the previous checkpoint into the new
one, and adds `NNN-<table>.shard<k>.delta<j>.npz`: the rows changed since the previous save
(`SparseTable.changed_since`, runtime/ps/changes.py) with their optimizer and admission / eviction
state, the ids removed since (`Deleted`), the pass ends of the feature lifecycle since (`Shrinks`:
a shrink changes every row, so it is replayed on load, not written row by row), the scalar state
and the applied steps. Deleting an older checkpoint (a run's `keep`) never breaks a newer one, and
the new bytes on disk are those of the delta alone, proportional to the rows touched. Restore =
base + deltas in order (each: its `Shrinks` replayed on the rows so far, then its rows written and
its `Deleted` removed), exact: the loaded table equals the one saved (`Shard.load` applies them;
any shard count).

A shard links from its previous save only when that checkpoint still lists the chain's files as
this shard wrote them (its manifest is read and compared); otherwise (a save that failed or was
removed) the save is full and starts a new chain. A load of a checkpoint saved by as many shards
continues its chain (`Shard.load`: the next save is a delta of the rows changed since the load, so
online training, whose servers restart each pass, writes deltas between its full saves); a load
with another shard count starts a new one.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.ps import checkpoint
from runtime.ps.sharding import shard_of
from runtime.ps.table import SparseTable
from runtime.ps.types import Table

MARK = "@checkpoint"  # the change mark the chain uses (a publisher uses its own)
_STAGE = re.compile(r"\.(.+)\.new-[0-9a-f]{32}-\d+-.+")


@dataclass
class Chain:
    """A table's chain on one shard: the checkpoint its last save went to, that save's manifest
    entries of the table from this shard (base first), and the deltas since the full save."""

    path: Path
    entries: list[dict]
    deltas: int


def target_of(stage: Path) -> Path:
    """The checkpoint directory a staging directory of `checkpoint.begin` becomes."""
    m = _STAGE.fullmatch(Path(stage).name)
    return Path(stage).parent / m.group(1) if m else Path(stage)


def delta_name(index: int, table: str, shard: int, seq: int) -> str:
    return checkpoint.file_name(index, table, shard).removesuffix(".npz") + f".delta{seq}.npz"


def uses_deltas(t: Table) -> bool:
    return isinstance(t, SparseTable) and (t.spec.delta_every or 1) > 1


def intact(chain: Chain) -> bool:
    """True when checkpoint `chain.path` still lists the chain's files as they were written."""
    try:
        doc = checkpoint.read_manifest(chain.path)
    except checkpoint.CheckpointError:
        return False
    listed = doc["files"]
    return all(e in listed and (chain.path / e["file"]).exists() for e in chain.entries)


def _link(src: Path, dst: Path) -> None:
    """Hard-link a checkpoint file or directory tree (their files are never changed in place)."""

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if src.is_dir():
        shutil.copytree(src, dst, copy_function=link)
    else:
        link(str(src), str(dst))


def save_delta(
    t: SparseTable, chain: Chain, stage: Path, index: int, shard: int, num_shards: int, version: int
) -> Chain:
    """Link `chain`'s files into `stage` and write the delta of `t` since the chain's last save;
    the chain now ending in `stage`'s checkpoint."""
    for e in chain.entries:
        _link(chain.path / e["file"], stage / e["file"])
    rows = t.changed_since(MARK)
    seq = chain.deltas + 1
    arrays = {
        **t.rows_of(rows.ids),
        "Deleted": rows.removed,
        "Shrinks": np.array([rows.shrinks]),
        "version": np.array([version]),
    }
    entry = checkpoint.write_arrays(stage, delta_name(index, t.name, shard, seq), t.name, arrays)
    entry.update(delta=seq, shard=shard, num_shards=num_shards)
    t.mark(MARK, replay_shrinks=True)
    return Chain(target_of(stage), [*chain.entries, entry], seq)


def ordered(entries: list[dict]) -> list[dict]:
    """A table's manifest entries in the order they apply: full files, then deltas by number."""
    return sorted(entries, key=lambda e: e.get("delta", 0))


def load_delta(t: SparseTable, path: Path, entry: dict, mine) -> int:
    """Apply delta file `entry` of checkpoint `path` (this shard's rows: `mine(ids)`) to `t`; its
    version."""
    arrays = checkpoint.read_arrays(path, entry)
    where = f"checkpoint {str(path)!r}: delta file {entry['file']!r} of table {t.name!r}"
    need = {"ids", "Param", "Deleted", "version", *t.state_slots, *t.scalars}
    n = arrays["ids"].shape[0] if "ids" in arrays else -1
    bad = sorted(need - set(arrays)) or [
        k for k in ("Param", *t.state_slots) if arrays[k].shape != (n, t.dim)
    ]
    if bad:
        raise checkpoint.CheckpointError(f"{where}: arrays {bad} are missing or of the wrong shape")
    version = int(arrays.pop("version")[0])
    deleted = arrays.pop("Deleted")
    origin = lambda ids: shard_of(ids, int(entry["num_shards"])) == int(entry["shard"])  # noqa: E731
    for _ in range(int(arrays.pop("Shrinks", np.zeros(1))[0])):  # pass ends since the save before,
        t.shrink(origin)  # on the rows of the shard that wrote this delta
    rows = t.select_rows(arrays, mine)
    rows["Deleted"] = deleted[mine(deleted)]
    t.apply_delta(rows, origin)
    return version
