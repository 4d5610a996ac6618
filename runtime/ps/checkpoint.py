"""Checkpoints that do not depend on the shard count, written so that a crash never fakes a valid one.

Layout of a checkpoint directory:

    manifest.json                        written last; lists every file with its size and sha256
    NNN-<table>.shard<k>.npz             one file per (table, shard that held it)
    NNN-<table>.shard<k>.tiered/         a disk-backed table's directory instead (runtime/ps/tiered.py)
    NNN-<table>.shard<k>.delta<j>.npz    a sparse table's rows changed since the previous save
                                         (runtime/ps/delta.py: a chain of a full save and deltas)

A sparse file holds `ids`, `Param`, the per-row optimizer state and the scalar state; a dense file
the whole array and its state. Loading into any number of shards reads every file of a table and
keeps the ids that hash to the loading shard (`sharding.shard_of`), so 2 shards load into 3.

Atomicity: a save never touches the previous checkpoint until the new one is complete. `begin`
makes a new hidden directory beside the target (`.<name>.new-<random>`); every file, then the
manifest, is written there and fsynced; `finish` swaps it with the target in one rename (Linux
`renameat2(RENAME_EXCHANGE)`; elsewhere two renames, the old one moved aside first), fsyncs the
parent and removes the old one. A save that fails (full disk, read-only directory) or is killed
leaves the previous checkpoint as it was, and at most a `.new-` directory, which `abort` (called on
failure) removes. A directory that holds anything but checkpoint files is never replaced. Reading
checks each file's size, sha256 and array shapes against the manifest and the table specs, and
refuses a manifest entry whose file resolves outside the checkpoint directory (`..`, an absolute
path, a symbolic link pointing out).

Staging directories of killed saves: a stage is named `.<name>.new-<random>-<pid>-<host>` after the
process that began the save. `begin` first removes (`remove_stale_stages`) every stage beside the
target whose creator ran on this host and is no longer alive; a stage of a live process (a save in
progress, whichever run it belongs to) or of another host is never touched.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from runtime.ps.table import PSError
from transpiler.tables import TableSpec, tables_to_dicts

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


_CHECKPOINT_FILE = re.compile(
    r"(manifest\.json|\d{3}-.+\.shard\d+(\.delta\d+)?\.(npz|tiered)|\..+\.tmp-[0-9a-f]{32})"
)  # (.tiered: a tiered table's directory, runtime/ps/tiered.py; .deltaJ: runtime/ps/delta.py)


def check_target(path: str | os.PathLike) -> Path:
    """`path` as a Path, after checking a checkpoint can be saved there (before any work is done):
    its parent can be made and written, and `path` is absent, empty or a checkpoint. CheckpointError
    saying what is wrong otherwise."""
    path = Path(path).absolute()
    if path.is_symlink():  # replace what it points to, not the link
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} exists and is not a directory")
    if path.is_dir():
        foreign = sorted(p.name for p in path.iterdir() if not _CHECKPOINT_FILE.fullmatch(p.name))
        if foreign:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is a directory holding other files "
                f"({foreign[:3]}); a save replaces the whole directory, so give it a "
                "new or checkpoint-only directory"
            )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(_new_stage(path))
    except OSError as e:
        raise CheckpointError(
            f"cannot save a checkpoint at {str(path)!r}: {e.strerror or e} in "
            f"{str(path.parent)!r} (a save writes a new directory there)"
        ) from None
    return path


_STAGE = re.compile(r"\..+\.new-[0-9a-f]{32}-(\d+)-(.+)")


def host() -> str:
    """This host's name as it appears in stage and engine directory names."""
    return _host()


def alive(pid: int) -> bool:
    """True while process `pid` of this host runs."""
    return _alive(pid)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"


def _new_stage(path: Path) -> Path:
    """A new, empty hidden directory beside `path` (the staging area of a save), named after the
    process making it (see the module docstring)."""
    stage = path.parent / f".{path.name}.new-{uuid.uuid4().hex}-{os.getpid()}-{_host()}"
    stage.mkdir()
    return stage


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_stages(parent: str | os.PathLike) -> list[Path]:
    """Remove the staging directories in `parent` left by saves whose process is gone: those made on
    this host by a pid that no longer runs. A stage of a live process, of another host, or not named
    by `begin` is kept. The removed paths."""
    parent, host, gone = Path(parent), _host(), []
    if not parent.is_dir():
        return gone
    for p in parent.iterdir():
        m = _STAGE.fullmatch(p.name)
        if m and m.group(2) == host and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p)
    return gone


def begin(path: str | os.PathLike) -> Path:
    """The staging directory for a new checkpoint at `path`, after removing stale stages beside it
    (see the module docstring)."""
    path = check_target(path)
    remove_stale_stages(path.parent)
    return _new_stage(path)


def abort(stage: str | os.PathLike) -> None:
    """Remove a staging directory of a save that failed (the previous checkpoint stays)."""
    shutil.rmtree(stage, ignore_errors=True)


def write_arrays(path: str | os.PathLike, name: str, table: str, arrays: dict[str, np.ndarray]) -> dict:
    """Write one table file atomically; its manifest entry."""
    target = Path(path) / name
    _atomic_write(target, lambda f: np.savez(f, **arrays))
    return {"table": table, "file": name, "bytes": target.stat().st_size, "sha256": _sha256(target)}


def finish(
    stage: str | os.PathLike, path: str | os.PathLike, specs: list[TableSpec], files: list[dict], **meta: Any
) -> None:
    """Write the manifest into `stage`, then make `stage` the checkpoint at `path` (atomically)."""
    stage, path = Path(stage), check_target(path)
    doc = {"format": FORMAT, "tables": tables_to_dicts(specs), "files": files, **meta}
    _atomic_write(stage / MANIFEST, lambda f: f.write(json.dumps(doc, indent=1).encode()))
    _fsync_dir(stage)
    if not path.exists():
        os.rename(stage, path)
        old = None
    elif _exchange(stage, path):
        old = stage  # now holds the previous checkpoint
    else:
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
        os.rename(path, old)
        os.rename(stage, path)
    _fsync_dir(path.parent)
    if old is not None:  # the new checkpoint is in place: removing the old one may fail harmlessly
        shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"{os.strerror(err)}: swapping {str(a)!r} with {str(b)!r}")


def read_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r}: no such directory")
    try:
        doc = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST} (the "
            "save did not finish, e.g. it was killed mid-save)"
        ) from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else doc
        raise CheckpointError(f"checkpoint {str(path)!r}: format {got!r}, expected {FORMAT!r}")
    if not isinstance(doc.get("tables"), list) or not isinstance(doc.get("files"), list):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} has no 'tables' or 'files' list")
    for i, entry in enumerate(doc["files"]):
        _check_entry(path, i, entry)
    return doc


_ENTRY = {"table": str, "file": str, "bytes": int, "sha256": str}
# A tiered table's entry names its directory (runtime/ps/tiered.py): RocksDB's own checksums and the
# directory's meta.json guard its content, so it carries no size or hash of its own.
_DIRECTORY_ENTRY = {"table": str, "file": str, "store": str}


def _check_entry(path: Path, i: int | None, entry: Any) -> None:
    """CheckpointError unless manifest entry `entry` (number `i`) has every field of `_ENTRY` (a
    directory entry: of `_DIRECTORY_ENTRY`) in its type and names a file inside checkpoint `path`."""
    where = f"checkpoint {str(path)!r}: {MANIFEST} entry" + ("" if i is None else f" {i}")
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where} is {entry!r}, not an object with fields {sorted(_ENTRY)}")
    fields = _DIRECTORY_ENTRY if "store" in entry else _ENTRY
    for key, kind in fields.items():
        if not isinstance(entry.get(key), kind) or isinstance(entry.get(key), bool):
            got = "missing" if key not in entry else f"{entry[key]!r}"
            raise CheckpointError(
                f"{where} (file {entry.get('file')!r}): field {key!r} is {got}, expected type {kind.__name__}"
            )
    _inside(path, entry["file"], f"{where} (table {entry['table']!r})")


def _inside(path: Path, name: str, where: str) -> Path:
    """path/name, refused (CheckpointError) unless it resolves, links followed, to a file inside
    directory `path`."""
    root = Path(os.path.realpath(path))
    target = Path(os.path.realpath(Path(path) / name))
    if target == root or not target.is_relative_to(root):
        raise CheckpointError(
            f"{where}: file {name!r} resolves to {str(target)!r}, outside the checkpoint directory; "
            "a checkpoint reads only its own files"
        )
    return target


def read_arrays(path: str | os.PathLike, entry: dict) -> dict[str, np.ndarray]:
    """The arrays of one manifest entry, after checking it names a file inside `path` with the
    entry's size and sha256."""
    path = Path(path)
    _check_entry(path, None, entry)
    target = path / entry["file"]
    where = f"checkpoint {str(path)!r}: file {entry['file']!r} of table {entry['table']!r}"
    if not target.is_file():
        raise CheckpointError(f"{where} is missing")
    if target.stat().st_size != entry["bytes"] or _sha256(target) != entry["sha256"]:
        raise CheckpointError(
            f"{where} does not match its manifest entry (size {target.stat().st_size} bytes, manifest "
            f"{entry['bytes']}; or its sha256 differs): it is corrupt or was changed after the save"
        )
    try:
        with np.load(target, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"{where} is not a readable .npz archive ({type(e).__name__}: {e}); it is truncated or corrupt"
        ) from None
