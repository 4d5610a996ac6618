"""The on-disk engine of a tiered sparse table (`runtime.ps.tiered`): RocksDB through `rocksdict`.

A `RowStore` maps ids to rows in one RocksDB directory. Key: the id as 8 big-endian bytes (key
order = id order); value: one record of the table's `record` dtype (Param and the per-row optimizer
state, raw bytes). Every call is batched: `get` is one multi-get for a request's ids, decoded by one
`np.frombuffer` over the joined values; `put` is one WriteBatch over one contiguous buffer. The WAL
is off (the engine is a spill area; durability comes from saved directories). RocksDB's own memory
is bounded by an `EngineMemory`: two memtables of `write_buffer` bytes and a block cache of
`block_cache` bytes that also holds the SST files' index and bloom filter blocks (partitioned, so a
lookup loads only the partitions it needs; L0's and the top-level ones pinned; no bloom filter on
the last level, where most rows live: a lookup that reaches it finds its row); the OS page cache
holds the SST files. (Not mmap reads: lookups were ~20% faster so, but the mapped file pages count
in the process's RSS: its peak reached 13.7 GB at 10^8 rows, with a RssAnon growth of 80 MiB.)

A saved directory (`save_dir`): `rows/`, a RocksDB checkpoint (hard links to the immutable SST
files), and `meta.json` (format, layout, row count, scalar state, and each data file of `rows/` (SST
files, MANIFEST, CURRENT) with its size and sha256), written into a staging directory renamed
into place. Reading one back first checks those files against meta.json (`read_meta`): a truncated
or corrupted file is refused by name. (An SST file's hash is computed once per process: SST files
never change once written.)
`batches` reads one back as `load_state` arrays, BATCH_ROWS rows at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import repeat
from operator import is_not
from pathlib import Path

import numpy as np
import rocksdict

from runtime.ps.entry import ENTRY_LAST
from runtime.ps.lifecycle import LIFE
from runtime.ps.table import PSError

KEY = np.dtype(">u8")
META, ROWS, EXTRAS = "meta.json", "rows", "extras.npz"
FORMAT = "hetps-tiered/1"
BATCH_ROWS = 1 << 16  # rows per WriteBatch when loading, and per batch when reading a store back
WRITE_BUFFERS = 2  # RocksDB memtables (the one being written, the one being flushed)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(value: int | str, what: str = "memory_budget") -> int:
    """Bytes of `value`: an int, or a string such as "4GiB", "512 MiB", "1.5GB", "100000" (KiB/MiB/
    GiB/TiB: powers of 1024; KB/MB/GB/TB: powers of 1000). ValueError naming `what` otherwise."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", str(value).lower())
        if not isinstance(value, str) or m is None or (m[3] and not m[2]):
            raise ValueError(
                f"{what} {value!r} is not a byte count: give an int or a string like '4GiB', '512MiB'"
            )
        n = int(float(m[1]) * (1024 ** ("kmgt".index(m[2]) + 1) if m[3] else _UNITS[m[2]]))
    if n <= 0:
        raise ValueError(f"{what} {value!r} must be a positive number of bytes")
    return n


def record_dtype(dtype: np.dtype, dim: int, fields: list[str]) -> np.dtype:
    """One row's record: a [dim] array of `dtype` per field (Param, then the optimizer state), one
    float32 per lifecycle field (Show, Click, Unseen: runtime/ps/lifecycle.py), one int64 for the
    push clock of the row's last touch (EntryLast: runtime/ps/entry.py)."""
    return np.dtype(
        [
            (f, np.float32) if f in LIFE else (f, np.int64) if f == ENTRY_LAST else (f, dtype, (dim,))
            for f in fields
        ]
    )


@dataclass(frozen=True)
class EngineMemory:
    """RocksDB's memory: a block cache of `block_cache` bytes (data, index and filter blocks) and
    WRITE_BUFFERS memtables of `write_buffer` bytes each."""

    block_cache: int = 8 << 20
    write_buffer: int = 16 << 20

    @property
    def nbytes(self) -> int:
        """The most RocksDB holds in its caches and memtables."""
        return self.block_cache + WRITE_BUFFERS * self.write_buffer

    @classmethod
    def of_budget(cls, budget: int) -> EngineMemory:
        """The engine's share of a table's memory budget: 1/32 block cache (at least 1 MiB), 1/32 per
        memtable (256 KiB to 64 MiB)."""
        return cls(max(1 << 20, budget // 32), min(64 << 20, max(256 << 10, budget // 32)))


def _options(mem: EngineMemory) -> rocksdict.Options:
    """No compression (float rows do not compress), memtables and a block cache of `mem` (index and
    filter blocks in it, partitioned; see the module docstring)."""
    opt = rocksdict.Options(raw_mode=True)
    opt.create_if_missing(True)
    opt.set_compression_type(rocksdict.DBCompressionType.none())
    opt.set_write_buffer_size(mem.write_buffer)
    opt.set_max_write_buffer_number(WRITE_BUFFERS)
    opt.set_optimize_filters_for_hits(True)
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_index_type(rocksdict.BlockBasedIndexType.two_level_index_search())
    table.set_partition_filters(True)
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    table.set_pin_top_level_index_and_filter(True)
    table.set_block_cache(rocksdict.Cache(mem.block_cache))
    opt.set_block_based_table_factory(table)
    return opt


class RowStore:
    """id -> record in the RocksDB directory `path` (see the module docstring); `what` names the
    table in errors; `memory`: RocksDB's caches and memtables. Counts its engine calls (`multi_gets`,
    `write_batches`)."""

    def __init__(
        self,
        path: Path,
        record: np.dtype,
        what: str,
        read_only: bool = False,
        memory: EngineMemory = EngineMemory(),
    ) -> None:
        self.path, self.record, self.what = Path(path), record, what
        self.multi_gets = self.write_batches = 0
        try:
            access = rocksdict.AccessType.read_only() if read_only else rocksdict.AccessType.read_write()
            opt = _options(memory)  # (also as the default column family's: else an existing store's
            # OPTIONS file gives its options, and a block cache of RocksDB's default 8 MiB)
            self.db = rocksdict.Rdict(
                str(self.path), opt, column_families={"default": opt}, access_type=access
            )
        except Exception as e:  # rocksdict raises plain Exceptions for I/O errors and corruption
            raise PSError(
                f"{what}: store {str(self.path)!r} cannot be opened (corrupt or unreadable?): {e}"
            ) from None
        wopt = rocksdict.WriteOptions()
        wopt.disable_wal = True
        self.db.set_write_options(wopt)
        ropt = rocksdict.ReadOptions()
        ropt.fill_cache(False)  # (reads miss the RAM tier at random: caching their blocks only churns)
        self.db.set_read_options(ropt)

    def _error(self, doing: str, e: BaseException) -> PSError:
        if "No space left" in str(e):
            return PSError(
                f"{self.what}: {doing} store {str(self.path)!r} failed: the disk holding it is full "
                f"({e}); free space there or put the store on a larger disk (store_dir / TMPDIR). The "
                "table's rows since its last checkpoint are lost; that checkpoint stays loadable"
            )
        return PSError(f"{self.what}: {doing} store {str(self.path)!r} failed (corrupt?): {e}")

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, the found rows' records in order) of the distinct `ids`: one multi-get."""
        try:
            values = self.db.get(_keys(ids))
        except Exception as e:
            raise self._error("reading", e) from None
        self.multi_gets += 1
        found = np.fromiter(map(is_not, values, repeat(None)), bool, len(values))  # (C loops: no
        buf = b"".join(filter(None, values))  # Python frame per id; a record is never b"")
        if len(buf) != int(found.sum()) * self.record.itemsize:
            raise PSError(
                f"{self.what}: store {str(self.path)!r} holds values of the wrong size (expected "
                f"{self.record.itemsize} bytes per row of {self.record}): corrupt, or another layout"
            )
        return found, np.frombuffer(buf, self.record)

    def put(self, ids: np.ndarray, rec: np.ndarray) -> None:
        """Write records `rec` of `ids`: one WriteBatch over one contiguous buffer."""
        if not ids.size:
            return
        values = np.ascontiguousarray(rec).view(f"V{self.record.itemsize}").tolist()
        batch = rocksdict.WriteBatch(raw_mode=True)
        deque(map(batch.put, _keys(ids), values), maxlen=0)  # (the loop in C: no Python per row)
        try:
            self.db.write(batch)
        except Exception as e:
            raise self._error("writing", e) from None
        self.write_batches += 1

    def delete(self, ids: np.ndarray) -> None:
        """Delete the rows of `ids`: one WriteBatch."""
        if not ids.size:
            return
        batch = rocksdict.WriteBatch(raw_mode=True)
        deque(map(batch.delete, _keys(ids)), maxlen=0)
        try:
            self.db.write(batch)
        except Exception as e:
            raise self._error("writing", e) from None
        self.write_batches += 1

    def any_in(self, lo: int, hi: int) -> bool:
        """Whether any row has an id in [lo, hi]: one seek (no multi-get of the ids between)."""
        try:
            it = self.db.iter()
            it.seek(_keys(np.array([lo]))[0])
            return bool(it.valid()) and int.from_bytes(it.key(), "big") <= hi
        except Exception as e:
            raise self._error("reading", e) from None

    def items(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of every stored row, BATCH_ROWS at a time, in id order."""
        keys, values = [], []
        try:
            for k, v in self.db.items():
                keys.append(k)
                values.append(v)
                if len(keys) == BATCH_ROWS:
                    yield self._decode(keys, values)
                    keys, values = [], []
        except PSError:
            raise
        except Exception as e:
            raise self._error("reading", e) from None
        if keys:
            yield self._decode(keys, values)

    def _decode(self, keys: list[bytes], values: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        kb, vb = b"".join(keys), b"".join(values)
        if len(kb) != 8 * len(keys) or len(vb) != self.record.itemsize * len(values):
            raise PSError(
                f"{self.what}: store {str(self.path)!r} holds keys or values of the wrong size "
                f"(8-byte ids, {self.record.itemsize}-byte rows expected): corrupt, or another layout"
            )
        return np.frombuffer(kb, KEY).astype(np.int64), np.frombuffer(vb, self.record)

    def flush(self) -> None:
        """Write the memtable to SST files."""
        try:
            self.db.flush()
        except Exception as e:
            raise self._error("flushing", e) from None

    def checkpoint(self, path: Path) -> None:
        """A RocksDB checkpoint of the store at `path` (new): hard links to its SST files."""
        try:
            self.flush()
            rocksdict.Checkpoint(self.db).create_checkpoint(str(path))
        except Exception as e:  # rocksdict raises plain Exceptions for I/O errors
            raise PSError(f"{self._error('checkpointing', e)} (checkpoint directory {str(path)!r})") from None

    def disk_bytes(self) -> int:
        """Bytes of the store's files (SST files, logs, manifest)."""
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    def engine_bytes(self) -> int:
        """Bytes RocksDB holds now in its block cache (pinned blocks included) and memtables."""
        return self.db.property_int_value("rocksdb.block-cache-usage") + self.db.property_int_value(
            "rocksdb.cur-size-all-mem-tables"
        )

    def close(self) -> None:
        self.db.close()


def _keys(ids: np.ndarray) -> list[bytes]:
    """The engine keys of `ids`: 8 big-endian bytes each (one numpy conversion, no slicing loop)."""
    return np.ascontiguousarray(ids, KEY).view("V8").tolist()


def _link_or_copy(src: str, dst: str) -> None:
    """SST files are immutable: hard-link them; copy the small mutable ones (manifest, options)."""
    if src.endswith(".sst"):
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def open_copy(saved: Path, path: Path, record: np.dtype, what: str, memory: EngineMemory) -> RowStore:
    """A store at `path` (new) holding the rows of saved directory `saved` (SST files linked)."""
    shutil.copytree(Path(saved) / ROWS, path, copy_function=_link_or_copy)
    try:
        return RowStore(path, record, what, memory=memory)
    except PSError as e:
        shutil.rmtree(path, ignore_errors=True)
        raise PSError(f"{what}: saved directory {str(saved)!r} is corrupt: {e}") from None


def save_dir(
    path: str | os.PathLike, store: RowStore, meta: dict, extras: dict[str, np.ndarray] | None = None
) -> None:
    """Write `store` (a checkpoint), `meta` and the arrays `extras` (a table's state that is not per
    row: `EXTRAS`, its size and sha256 in meta.json) as the saved directory `path`, atomically:
    into a staging directory beside it, renamed into place (a previous save is replaced only then)."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    stage = path.parent / f".{path.name}.new-{uuid.uuid4().hex}"
    stage.mkdir()
    try:
        store.checkpoint(stage / ROWS)
        files = {f.name: _file_sum(f) for f in sorted((stage / ROWS).iterdir()) if _SUMMED.fullmatch(f.name)}
        if extras:
            np.savez(stage / EXTRAS, **extras)
            meta = {**meta, "extras": _file_sum(stage / EXTRAS)}
        (stage / META).write_text(json.dumps({"format": FORMAT, **meta, "files": files}, indent=1))
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
        if path.exists():
            os.rename(path, old)
        os.rename(stage, path)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


_SUMMED = re.compile(r"\d+\.sst|MANIFEST-\d+|CURRENT")  # the engine's data (not its logs and options)
_SUMS: dict[tuple, list] = {}  # (inode, size, mtime) of an immutable SST file -> [size, sha256]


def _file_sum(f: Path) -> list:
    """[size, sha256] of file `f` (cached for SST files, which RocksDB never changes)."""
    st = f.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if f.suffix == ".sst" and key in _SUMS:
        return _SUMS[key]
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    out = [st.st_size, h.hexdigest()]
    if f.suffix == ".sst":
        _SUMS[key] = out
    return out


def _check_files(path: Path, meta: dict) -> None:
    """PSError naming the file unless every file of `rows/` listed in `meta` has its size and hash."""
    listed = {f"{ROWS}/{name}": want for name, want in (meta.get("files") or {}).items()}
    if meta.get("extras"):
        listed[EXTRAS] = meta["extras"]
    for name, want in listed.items():
        f = path / name
        if not f.is_file():
            raise PSError(f"saved tiered table {str(path)!r}: file {name} is missing")
        got = _file_sum(f)
        if got != list(want):
            raise PSError(
                f"saved tiered table {str(path)!r}: file {name} has {got[0]} bytes (saved: "
                f"{want[0]}) or another sha256: it is truncated or corrupt"
            )


def read_meta(path: str | os.PathLike) -> dict:
    """The `meta.json` of a saved directory, after checking its files (`_check_files`); PSError
    naming the path when missing or corrupt."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise PSError(f"saved tiered table {str(path)!r}: {META} is missing or corrupt: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not (path / ROWS).is_dir():
        raise PSError(
            f"saved tiered table {str(path)!r} is not a {FORMAT} directory (format or rows/ missing)"
        )
    _check_files(path, meta)
    return meta


def batches(path: str | os.PathLike, check: Callable[[dict], None] | None = None) -> Iterator[dict]:
    """The rows of saved directory `path` as `load_state` arrays ("ids", "Param", the state slots,
    the scalar state), BATCH_ROWS rows at a time; `check(meta)` first, when given."""
    path = Path(path)
    meta = read_meta(path)
    if check is not None:
        check(meta)
    dtype = np.dtype(meta["dtype"])
    store = RowStore(path / ROWS, record_dtype(dtype, meta["dim"], meta["fields"]), str(path), read_only=True)
    scalars = {s: np.asarray(v, dtype) for s, v in meta["scalars"].items()}
    extras = read_extras(path, meta)
    try:
        empty = True
        for ids, rec in store.items():
            empty = False
            yield {"ids": ids, **{f: rec[f] for f in meta["fields"]}, **scalars, **extras}
        if empty and extras:  # (no row, but the state that is not per row)
            rec = np.zeros(0, store.record)
            yield {"ids": np.zeros(0, np.int64), **{f: rec[f] for f in meta["fields"]}, **scalars, **extras}
    finally:
        store.close()


def read_extras(path: str | os.PathLike, meta: dict) -> dict[str, np.ndarray]:
    """The `extras` arrays of saved directory `path` ({} when it has none; checked by `read_meta`)."""
    if not meta.get("extras"):
        return {}
    with np.load(Path(path) / EXTRAS) as z:
        return {k: z[k] for k in z.files}
