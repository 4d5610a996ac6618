"""Checkpoints that do not depend on the shard count, written so that a crash never fakes a valid one.

Layout of a checkpoint directory:

    manifest.json                        written last; lists every file with its size and sha256
    NNN-<table>.shard<k>.npz             one file per (table, shard that held it)

A sparse file holds `ids`, `Param`, the per-row optimizer state and the scalar state; a dense file
the whole array and its state. Loading into any number of shards reads every file of a table and
keeps the ids that hash to the loading shard (`sharding.shard_of`), so 2 shards load into 3.

Atomicity: `begin` removes an old manifest (and fsyncs the directory) before any data file is
replaced; each file is written to a temporary name, fsynced and renamed; the manifest is written the
same way, last. So a save killed at any point leaves no manifest, which `read_manifest` reports as
an incomplete checkpoint; `read_arrays` checks each file's sha256, so torn or mixed files are
refused too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .table import PSError

MANIFEST = "manifest.json"
FORMAT = "hetps-ps-checkpoint/1"


class CheckpointError(PSError):
    """A checkpoint that is missing, incomplete (e.g. its save was killed) or corrupt."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def file_name(table_index: int, table: str, shard: int) -> str:
    return f"{table_index:03d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', table)}.shard{shard}.npz"


def begin(path: str | os.PathLike) -> Path:
    """Make the directory and invalidate any checkpoint in it before its files get replaced."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MANIFEST).unlink(missing_ok=True)
    _fsync_dir(path)
    return path


def write_arrays(path: str | os.PathLike, name: str, table: str, arrays: dict[str, np.ndarray]) -> dict:
    """Write one table file atomically; its manifest entry."""
    target = Path(path) / name
    _atomic_write(target, lambda f: np.savez(f, **arrays))
    return {"table": table, "file": name, "bytes": target.stat().st_size, "sha256": _sha256(target)}


def finish(path: str | os.PathLike, specs: list[dict], files: list[dict], **meta: Any) -> None:
    """Write the manifest (atomically, last): from now on the checkpoint loads."""
    doc = {"format": FORMAT, "tables": specs, "files": files, **meta}
    _atomic_write(Path(path) / MANIFEST, lambda f: f.write(json.dumps(doc, indent=1).encode()))


def read_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r}: no such directory")
    try:
        doc = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST} (the "
                              "save did not finish, e.g. it was killed mid-save)") from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is not valid JSON: {e}") from None
    if doc.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r}: format {doc.get('format')!r}, expected {FORMAT!r}")
    return doc


def read_arrays(path: str | os.PathLike, entry: dict) -> dict[str, np.ndarray]:
    """The arrays of one manifest entry, after checking its size and sha256."""
    target = Path(path) / entry["file"]
    if not target.is_file() or target.stat().st_size != entry["bytes"] or _sha256(target) != entry["sha256"]:
        raise CheckpointError(f"checkpoint {str(path)!r}: file {entry['file']!r} of table "
                              f"{entry['table']!r} is missing or does not match its manifest entry")
    with np.load(target, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
