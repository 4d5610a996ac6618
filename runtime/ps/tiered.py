"""Tiered sparse tables: rows on disk in RocksDB (through `rocksdict`), under a RAM tier of hot rows
bounded by a memory budget (a sparse `TableSpec` with `storage="disk"`, `memory_budget` bytes).

`TieredSparseTable` is a `SparseTable` whose RAM arrays hold only the hot rows; it keeps the RAM
table's methods and signatures (pull, peek, push, add, assign, state_dict, load_state,
memory_bytes, len) and its arithmetic: every update runs the same optimizer kernels on the same RAM
arrays, rows are created from the same per-id initializer, so a pull/push sequence gives exactly the
RAM table's values whatever the budget.

- The engine: one RocksDB directory per table (a fresh `tempfile` directory, under `store_dir` when
  given), removed by `close` (and at interpreter exit). Key: the id as 8 big-endian bytes; value:
  the row's Param and per-row optimizer state packed as one record (`record` dtype), raw bytes.
  The WAL is off: the engine is a spill area, durability comes from `save`.
- A request (pull, push, add, assign) looks its ids up in RAM; the misses go to the engine in one
  multi-get (`Rdict.get(list)`), decoded with one `np.frombuffer` over the joined values; rows found
  there are promoted into RAM, the others created from the initializer.
- Eviction is LRU: each request stamps its rows with a request counter; when more than `max_rows`
  rows are resident after a request, the least recently stamped are written back in one
  `WriteBatch` until 90% of `max_rows` remain (so eviction is amortised over ~10% of the budget),
  and the RAM arrays are compacted. `max_rows` = budget // bytes per resident row (record + LRU
  stamp + id index entry); the id index of a table with a known vocab <= 2^24 (`DirectIndex`, one
  int32 per possible id, pages touched only when used) and RocksDB's own caches are outside it.
- A request whose distinct rows do not fit the budget is refused (PSError naming table and budget).
- Admission / eviction by age (`entry`, `evict_after`) are refused for now: their per-row clocks
  would have to follow rows to disk.

`save(dir)` writes the RAM tier back, flushes and takes a RocksDB checkpoint (hard links to the
immutable SST files, no row passes through Python) plus `meta.json` (layout, row count, scalar
state), into a staging directory renamed into place. `load(dir)` links a saved directory's SST
files into a fresh engine. `batches(dir)` reads a saved directory as `load_state` arrays, a
bounded number of rows at a time (a checkpoint loaded into another shard count or a RAM table).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import rocksdict

from runtime.ps import checkpoint
from runtime.ps.index import DirectIndex, make_index, unique_ids
from runtime.ps.sharding import shard_of
from runtime.ps.table import PSError, SparseTable
from transpiler.tables import TableSpec

KEY = np.dtype(">u8")  # ids as 8 big-endian bytes: the engine's key order is the id order
EVICT_TO = 0.9  # an eviction leaves this share of max_rows resident
META, ROWS = "meta.json", "rows"
FORMAT = "hetps-tiered/1"
STORE = "tiered"  # a checkpoint manifest entry's "store" for a tiered table's directory
BATCH_ROWS = 1 << 16  # rows per batch when a saved store is read back through Python
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(value: int | str, what: str = "memory_budget") -> int:
    """Bytes of `value`: an int, or a string such as "4GiB", "512 MiB", "1.5GB", "100000" (KiB/MiB/
    GiB/TiB: powers of 1024; KB/MB/GB/TB: powers of 1000). ValueError naming `what` otherwise."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", str(value).lower())
        if not isinstance(value, str) or m is None:
            raise ValueError(
                f"{what} {value!r} is not a byte count: give an int or a string like '4GiB', '512MiB'"
            )
        unit = 1024 ** "kmgt".index(m[2]) * 1024 if m[3] else _UNITS[m[2]]
        n = int(float(m[1]) * (unit if m[2] else 1))
    if n <= 0:
        raise ValueError(f"{what} {value!r} must be a positive number of bytes")
    return n


@dataclass
class TierStats:
    """Counters of a tiered table since it was made: ids looked up by requests (repeats counted) and
    those found in RAM; rows promoted from disk, created, evicted; engine calls (multi-gets, write
    batches)."""

    lookups: int = 0
    ram_hits: int = 0
    disk_hits: int = 0
    created: int = 0
    evicted: int = 0
    multi_gets: int = 0
    write_batches: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of looked-up ids found in RAM (1.0 before any lookup)."""
        return self.ram_hits / self.lookups if self.lookups else 1.0


ENGINE_WRITE_BUFFER = 16 << 20  # RocksDB memtable bytes (two at most)
ENGINE_BLOCK_CACHE = 8 << 20  # RocksDB's cache of SST blocks (the OS page cache holds the rest)


def _options() -> rocksdict.Options:
    """RocksDB options of a table's engine: no compression (float rows do not compress), a bloom
    filter per SST (misses, i.e. new ids, skip the block reads), bounded memtables and block cache."""
    opt = rocksdict.Options(raw_mode=True)
    opt.create_if_missing(True)
    opt.set_compression_type(rocksdict.DBCompressionType.none())
    opt.set_write_buffer_size(ENGINE_WRITE_BUFFER)
    opt.set_max_write_buffer_number(2)
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_cache(rocksdict.Cache(ENGINE_BLOCK_CACHE))
    opt.set_block_based_table_factory(table)
    return opt


def _open(path: Path) -> rocksdict.Rdict:
    try:
        db = rocksdict.Rdict(str(path), _options())
    except Exception as e:  # rocksdict raises plain Exception subclasses for I/O and corruption
        raise PSError(
            f"tiered table store {str(path)!r} cannot be opened (corrupt or unreadable?): {e}"
        ) from None
    wopt = rocksdict.WriteOptions()
    wopt.disable_wal = True
    db.set_write_options(wopt)
    return db


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class TieredSparseTable(SparseTable):
    """A sparse table whose rows live in RocksDB under a RAM tier of at most `max_rows` hot rows (see
    the module docstring). `memory_budget` (bytes or "4GiB") defaults to the spec's; `store_dir`: the
    directory to make the engine's directory in (default: the system's temporary directory)."""

    def __init__(
        self,
        spec: TableSpec,
        check_finite: bool = True,
        *,
        memory_budget: int | str | None = None,
        store_dir: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(spec, check_finite)
        if self.entry is not None:
            raise PSError(
                f"table {self.name!r}: storage 'disk' does not support entry / evict_after yet; "
                "use storage 'memory' for a streaming table"
            )
        budget = memory_budget if memory_budget is not None else self.spec.memory_budget
        if budget is None:
            raise PSError(f"table {self.name!r}: storage 'disk' needs a memory_budget (bytes or '4GiB')")
        try:
            self.budget = parse_bytes(budget)
        except ValueError as e:
            raise PSError(f"table {self.name!r}: {e}") from None
        self.record = np.dtype(
            [("Param", self.dtype, (self.dim,)), *((s, self.dtype, (self.dim,)) for s in self.state_slots)]
        )
        index_bytes = 0 if isinstance(self.index, DirectIndex) else 16
        self.row_bytes = self.record.itemsize + 8 + index_bytes  # + the LRU stamp (int64)
        self.max_rows = self.budget // self.row_bytes
        if self.max_rows < 1:
            raise PSError(
                f"table {self.name!r}: memory_budget {self.budget} bytes holds no row "
                f"({self.row_bytes} bytes each)"
            )
        self.used = np.zeros(0, np.int64)  # per RAM slot: the request that last touched it
        self.tick = 0
        self.cold = 0  # rows on disk and not in RAM
        self.stats = TierStats()
        self.path = Path(
            tempfile.mkdtemp(prefix=f"hetps-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.name)}-", dir=store_dir)
        )
        self.db = _open(self.path / ROWS)
        self._cleanup = weakref.finalize(self, _remove, str(self.path))

    # -- the engine ----------------------------------------------------------------------------
    def _get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, the found rows' records) of the distinct `ids`: one multi-get."""
        kb = ids.astype(KEY).tobytes()
        try:
            values = self.db.get([kb[i : i + 8] for i in range(0, len(kb), 8)])
        except Exception as e:
            raise PSError(
                f"tiered table {self.name!r}: reading store {str(self.path)!r} failed: {e}"
            ) from None
        self.stats.multi_gets += 1
        found = np.fromiter((v is not None for v in values), bool, len(values))
        buf = b"".join(v for v in values if v is not None)
        if len(buf) != int(found.sum()) * self.record.itemsize:
            raise PSError(
                f"tiered table {self.name!r}: store {str(self.path)!r} holds values of the wrong size "
                f"(expected {self.record.itemsize} bytes per row of {self.record}): corrupt, or "
                "written for another table layout"
            )
        return found, np.frombuffer(buf, self.record)

    def _records(self, slots: np.ndarray) -> np.ndarray:
        """RAM rows `slots` with their optimizer state, as engine records."""
        rec = np.empty(slots.size, self.record)
        rec["Param"] = self.rows[slots]
        for s, a in self.row_state.items():
            rec[s] = a[slots]
        return rec

    def _put(self, ids: np.ndarray, rec: np.ndarray) -> None:
        """Write records `rec` of `ids` to the engine: one WriteBatch over one contiguous buffer."""
        if not ids.size:
            return
        kb, vb, size = ids.astype(KEY).tobytes(), np.ascontiguousarray(rec).tobytes(), self.record.itemsize
        batch = rocksdict.WriteBatch(raw_mode=True)
        for i in range(ids.size):
            batch.put(kb[8 * i : 8 * i + 8], vb[size * i : size * (i + 1)])
        try:
            self.db.write(batch)
        except Exception as e:
            raise PSError(
                f"tiered table {self.name!r}: writing store {str(self.path)!r} failed: {e}"
            ) from None
        self.stats.write_batches += 1

    # -- the RAM tier --------------------------------------------------------------------------
    def _check_fits(self, ids: np.ndarray) -> None:
        if ids.size > self.max_rows and unique_ids(ids).size > self.max_rows:
            raise PSError(
                f"table {self.name!r}: one request touches {unique_ids(ids).size} distinct rows, more "
                f"than memory_budget {self.budget} bytes holds ({self.max_rows} rows of "
                f"{self.row_bytes} bytes); raise memory_budget or send smaller requests"
            )

    def slots(self, ids: np.ndarray, init: bool = True) -> np.ndarray:
        """RAM slots of `ids`: rows found on disk are promoted first, the rest created as in
        `SparseTable.slots`; every row of the request is stamped as just used."""
        self._check_fits(ids)
        found = self.index.find(ids)
        self.stats.lookups += ids.size
        self.stats.ram_hits += int(np.count_nonzero(found >= 0))
        miss = unique_ids(ids[found < 0])
        promoted = 0
        if miss.size and self.cold:
            on_disk, rec = self._get(miss)
            promoted = rec.size
            if promoted:
                slots = SparseTable.slots(self, miss[on_disk], init=False)
                self.rows[slots] = rec["Param"]
                for s, a in self.row_state.items():
                    a[slots] = rec[s]
                self.cold -= promoted
        out = SparseTable.slots(self, ids, init)
        self.stats.disk_hits += promoted
        self.stats.created += miss.size - promoted
        self.tick += 1
        if self.used.size < self.rows.shape[0]:
            self.used = np.concatenate([self.used, np.zeros(self.rows.shape[0] - self.used.size, np.int64)])
        self.used[out] = self.tick
        return out

    def row_limit(self) -> int:
        """The RAM arrays grow to at most max_rows rows (more only within a request)."""
        return min(self.vocab, self.max_rows) if self.vocab > 0 else self.max_rows

    def _spill(self) -> None:
        """Evict least recently used rows to disk while more than max_rows are resident."""
        n = len(self.index)
        if n <= self.max_rows:
            return
        k = n - int(self.max_rows * EVICT_TO)
        victims = np.argpartition(self.used[:n], k - 1)[:k]
        ids = self.index.ids_by_slot()
        self._put(ids[victims], self._records(victims))
        keep = np.ones(n, bool)
        keep[victims] = False
        old = np.flatnonzero(keep)
        slots = self._keep(keep, room=self.max_rows - old.size)
        used = np.zeros(self.rows.shape[0], np.int64)
        used[slots] = self.used[old]
        self.used = used
        self.cold += k
        self.stats.evicted += k

    def __len__(self) -> int:
        return len(self.index) + self.cold

    def resident(self) -> int:
        """Rows in the RAM tier."""
        return len(self.index)

    def memory_bytes(self) -> int:
        """Bytes of the RAM tier: rows and optimizer state (allocated capacity), LRU stamps, the id
        index (RocksDB's caches are not counted)."""
        return super().memory_bytes() + self.used.nbytes

    def disk_bytes(self) -> int:
        """Bytes of the engine's directory (SST files, logs, manifest)."""
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    # -- the table interface -------------------------------------------------------------------
    def pull(self, ids: np.ndarray) -> np.ndarray:
        out = super().pull(ids)
        self._spill()
        return out

    def peek(self, ids: np.ndarray) -> np.ndarray:
        """As `SparseTable.peek`: rows from RAM or disk, promoting, creating and stamping nothing."""
        ids = self.check_ids(ids)
        found = self.index.find(ids)
        have = found >= 0
        out = np.zeros((ids.size, self.dim), self.dtype)
        out[have] = self.rows.take(found[have], axis=0)
        rest = np.flatnonzero(~have)
        if rest.size and self.cold:
            uniq, inv = np.unique(ids[rest], return_inverse=True)
            on_disk, rec = self._get(uniq)
            pos = np.full(uniq.size, -1)
            pos[on_disk] = np.arange(rec.size)
            where = pos[inv.ravel()]
            out[rest[where >= 0]] = rec["Param"][where[where >= 0]]
            rest = rest[where < 0]
        if rest.size:
            out[rest] = super().peek(ids[rest])  # none is in RAM: the initializer's rows
        return out

    def push(self, grad: np.ndarray, ids: np.ndarray, *, checked: bool = False) -> None:
        super().push(grad, ids, checked=checked)
        self._spill()

    def add(self, delta: np.ndarray, ids: np.ndarray) -> None:
        super().add(delta, ids)
        self._spill()

    def assign(self, values: np.ndarray, ids: np.ndarray) -> None:
        super().assign(values, ids)
        self._spill()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every row, RAM and disk, as `SparseTable.state_dict` gives it (the whole table in RAM:
        for a table larger than memory use `save`)."""
        self.flush()
        parts = list(_read_batches(self.db, self.record, self.path))
        ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        rec = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, self.record)
        return {"ids": ids, **{f: rec[f] for f in self.record.names}, **self.scalars}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Set rows `arrays["ids"]` (distinct, with their optimizer state) and the scalar state: rows
        resident in RAM are replaced there, the others written straight to disk, BATCH_ROWS per
        WriteBatch."""
        ids = self.check_ids(arrays["ids"])
        for s in self.scalars:
            self.scalars[s][...] = arrays[s]
        found = self.index.find(ids)
        ram = np.flatnonzero(found >= 0)
        self.rows[found[ram]] = arrays["Param"][ram]
        for s, a in self.row_state.items():
            a[found[ram]] = arrays[s][ram]
        rest = np.flatnonzero(found < 0)
        for lo in range(0, rest.size, BATCH_ROWS):
            part = rest[lo : lo + BATCH_ROWS]
            rec = np.empty(part.size, self.record)
            for f in self.record.names:
                rec[f] = arrays[f][part]
            new = part.size - (int(self._get(ids[part])[0].sum()) if self.cold else 0)
            self._put(ids[part], rec)
            self.cold += new

    # -- engine files --------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every RAM row to disk (they stay resident) and flush RocksDB's memtable."""
        n = len(self.index)
        self._put(self.index.ids_by_slot(), self._records(np.arange(n)))  # (`cold`: disk-only rows)
        self.db.flush()

    def meta(self) -> dict:
        return {
            "format": FORMAT,
            "table": self.name,
            "dim": self.dim,
            "dtype": self.dtype.name,
            "fields": list(self.record.names),
            "rows": len(self),
            "scalars": {s: a.tolist() for s, a in self.scalars.items()},
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the table to directory `path` atomically (a staging directory renamed into place):
        a RocksDB checkpoint of the engine (`rows/`, hard links) and `meta.json`."""
        path = Path(path).absolute()
        stage = path.parent / f".{path.name}.new-{uuid.uuid4().hex}"
        path.parent.mkdir(parents=True, exist_ok=True)
        stage.mkdir()
        try:
            self.flush()
            rocksdict.Checkpoint(self.db).create_checkpoint(str(stage / ROWS))
            (stage / META).write_text(json.dumps(self.meta(), indent=1))
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
            if path.exists():
                os.rename(path, old)
            os.rename(stage, path)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise

    def load(self, path: str | os.PathLike) -> None:
        """Replace every row and the scalar state by those saved in directory `path` (`save`)."""
        path = Path(path)
        meta = read_meta(path)
        want = {"dim": self.dim, "dtype": self.dtype.name, "fields": list(self.record.names)}
        if {k: meta.get(k) for k in want} != want:
            raise PSError(
                f"tiered table {self.name!r}: saved store {str(path)!r} has layout "
                f"{ {k: meta.get(k) for k in want} }, this table {want}"
            )
        fresh = self.path / f"{ROWS}.{uuid.uuid4().hex}"
        shutil.copytree(path / ROWS, fresh, copy_function=_link_or_copy)
        try:
            db = _open(fresh)
        except PSError as e:
            shutil.rmtree(fresh, ignore_errors=True)
            raise PSError(f"saved tiered table {str(path)!r} is corrupt: {e}") from None
        self.db.close()
        shutil.rmtree(self.path / ROWS)
        db.close()
        os.rename(fresh, self.path / ROWS)
        self.db = _open(self.path / ROWS)
        self.index, self.used = make_index(self.vocab), self.used[:0]
        self.rows = self.rows[:0]
        self.row_state = {s: a[:0] for s, a in self.row_state.items()}
        self.cold = int(meta["rows"])
        for s in self.scalars:
            self.scalars[s][...] = meta["scalars"][s]

    def close(self) -> None:
        """Close the engine and remove its files (saved directories stay)."""
        if self._cleanup.alive:
            self.db.close()
            self._cleanup()


def _link_or_copy(src: str, dst: str) -> None:
    """SST files are immutable: hard-link them; copy the small mutable ones (manifest, options)."""
    if src.endswith(".sst"):
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def read_meta(path: str | os.PathLike) -> dict:
    """The `meta.json` of a saved tiered table; PSError naming the path when missing or corrupt."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise PSError(f"saved tiered table {str(path)!r}: {META} is missing or corrupt: {e}") from None
    if meta.get("format") != FORMAT or not (path / ROWS).is_dir():
        raise PSError(f"saved tiered table {str(path)!r} is not a {FORMAT} store (format or rows/ missing)")
    return meta


def _read_batches(
    db: rocksdict.Rdict, record: np.dtype, path: Path
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, records) of every row in `db`, BATCH_ROWS at a time, in id order."""
    keys, values = [], []
    try:
        for k, v in db.items():
            keys.append(k)
            values.append(v)
            if len(keys) == BATCH_ROWS:
                yield _decode(keys, values, record, path)
                keys, values = [], []
    except PSError:
        raise
    except Exception as e:
        raise PSError(f"tiered table store {str(path)!r}: reading failed (corrupt?): {e}") from None
    if keys:
        yield _decode(keys, values, record, path)


def _decode(keys: list[bytes], values: list[bytes], record: np.dtype, path: Path) -> tuple:
    kb, vb = b"".join(keys), b"".join(values)
    if len(kb) != 8 * len(keys) or len(vb) != record.itemsize * len(values):
        raise PSError(
            f"tiered table store {str(path)!r} holds keys or values of the wrong size "
            f"(8-byte ids, {record.itemsize}-byte rows expected): corrupt or another layout"
        )
    return np.frombuffer(kb, KEY).astype(np.int64), np.frombuffer(vb, record)


def batches(path: str | os.PathLike) -> Iterator[dict[str, np.ndarray]]:
    """The rows of a saved tiered table as `load_state` arrays ("ids", "Param", state slots and the
    scalar state), BATCH_ROWS rows at a time; the store is opened read-only."""
    path = Path(path)
    meta = read_meta(path)
    dtype = np.dtype(meta["dtype"])
    record = np.dtype([(f, dtype, (meta["dim"],)) for f in meta["fields"]])
    try:
        db = rocksdict.Rdict(str(path / ROWS), _options(), access_type=rocksdict.AccessType.read_only())
    except Exception as e:
        raise PSError(f"saved tiered table {str(path)!r} cannot be opened (corrupt?): {e}") from None
    scalars = {s: np.asarray(v, dtype) for s, v in meta["scalars"].items()}
    try:
        for ids, rec in _read_batches(db, record, path):
            yield {"ids": ids, **{f: rec[f] for f in record.names}, **scalars}
    finally:
        db.close()


def save_entry(
    table: TieredSparseTable, path: str | os.PathLike, index: int, shard: int, num_shards: int, version: int
) -> dict:
    """Save `table` (table number `index` of shard `shard` of `num_shards`) into checkpoint directory
    `path` (`runtime.ps.checkpoint`); its manifest entry."""
    name = checkpoint.file_name(index, table.name, shard).removesuffix(".npz") + ".tiered"
    table.save(Path(path) / name)
    return {
        "table": table.name,
        "file": name,
        "store": STORE,
        "rows": len(table),
        "shard": shard,
        "num_shards": num_shards,
        "version": int(version),
    }


def load_entry(table: SparseTable, path: str | os.PathLike, entry: dict, shard: int, num_shards: int) -> int:
    """Load the rows of manifest entry `entry` (a tiered table's directory in checkpoint `path`) that
    belong to shard `shard` of `num_shards` into sparse `table` (tiered or in RAM); the entry's
    version. A tiered table saved by the same shard of as many shards is linked in whole (`load`)."""
    where = Path(path) / entry["file"]
    meta = read_meta(where)
    want = {"dim": table.dim, "dtype": table.dtype.name, "fields": ["Param", *table.state_slots]}
    if {k: meta.get(k) for k in want} != want:
        raise checkpoint.CheckpointError(
            f"checkpoint {str(path)!r}: {entry['file']!r} of table {table.name!r} has layout "
            f"{ {k: meta.get(k) for k in want} }; the table's spec needs {want}"
        )
    if entry.get("num_shards") == num_shards:
        if entry.get("shard") == shard:
            if isinstance(table, TieredSparseTable):
                table.load(where)
            else:
                for arrays in batches(where):
                    table.load_state(arrays)
        return int(entry["version"])  # (another shard's file of as many shards holds no row of this one)
    for arrays in batches(where):
        mine = shard_of(arrays["ids"], num_shards) == shard
        per_row = ("ids", *meta["fields"])
        table.load_state({k: (a[mine] if k in per_row else a) for k, a in arrays.items()})
    return int(entry["version"])


def tier_stats(table: TieredSparseTable) -> dict:
    """The table's counters as plain data, with its hit rate and residency."""
    return {
        **asdict(table.stats),
        "hit_rate": table.stats.hit_rate,
        "resident": table.resident(),
        "rows": len(table),
    }
