"""The tiered table's engine against LMDB: microseconds per key of a batched read and write.

A tiered table's miss costs one key of a batched multi-get (its promotion) and, once evicted dirty,
one key of a write batch. This fills a RocksDB store through the table's own `RowStore`
(runtime/ps/tiered_store.py: its options, no compression, a 64 MiB budget's caches) and an LMDB
environment (py-lmdb's `Cursor.putmulti` / `getmulti`: the loops in C) with the same `rows`
records of 136 bytes (dim 16 + Adagrad moments) under 8-byte random ids, then times batches of
`keys` distinct random ids: the read (records decoded into one buffer) and the write of the same
keys, per key, in `repeats` rounds (median), and the bytes on disk per row. LMDB is not a
dependency of hetps: `pip install lmdb` to run it.

    python benchmarks/engine_lookup.py                   # --rows 2000000 --keys 8000 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.ps.tiered_store import EngineMemory, RowStore  # noqa: E402
from runtime.ps.tiered_store import _keys as keys  # noqa: E402  (the store's own key encoding)

RECORD = np.dtype([("row", np.float32, (34,))])  # 16 values + 16 moments + 2 statistics: 136 bytes
CHUNK = 1 << 18


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--keys", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        import lmdb
    except ImportError:
        sys.exit("LMDB is not installed: pip install lmdb")
    rng = np.random.default_rng(0)
    ids = rng.choice(1 << 62, args.rows, replace=False).astype(np.int64)
    rec = rng.standard_normal((args.rows, 34)).astype(np.float32).view(RECORD).ravel()
    tmp = Path(tempfile.mkdtemp(prefix="hetps-engines-"))
    try:
        store = RowStore(tmp / "rocksdb", RECORD, "bench", memory=EngineMemory.of_budget(64 << 20))
        env = lmdb.open(str(tmp / "lmdb"), map_size=1 << 38, sync=False, metasync=False, readahead=False)
        fill = {}
        t = time.perf_counter()
        for i in range(0, args.rows, CHUNK):
            store.put(ids[i : i + CHUNK], rec[i : i + CHUNK])
        store.flush()
        store.db.compact_range(None, None)
        fill["rocksdb"] = args.rows / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(0, args.rows, CHUNK):
            with env.begin(write=True) as txn:
                values = rec[i : i + CHUNK].view(f"V{RECORD.itemsize}").tolist()
                txn.cursor().putmulti(zip(keys(ids[i : i + CHUNK]), values, strict=True))
        fill["lmdb"] = args.rows / (time.perf_counter() - t)

        def lmdb_get(q: np.ndarray) -> None:
            with env.begin() as txn:
                got = txn.cursor().getmulti(keys(q))
            assert len(b"".join(v for _, v in got)) == q.size * RECORD.itemsize

        def lmdb_put(q: np.ndarray, r: np.ndarray) -> None:
            with env.begin(write=True) as txn:
                txn.cursor().putmulti(zip(keys(q), r.view(f"V{RECORD.itemsize}").tolist(), strict=True))

        def rocks_get(q: np.ndarray) -> None:
            found, _ = store.get(q)
            assert found.all()

        names = ("rocksdb get", "lmdb get", "rocksdb put", "lmdb put")
        times: dict[str, list[float]] = {k: [] for k in names}
        for _ in range(args.repeats):
            pick = rng.choice(args.rows, args.keys, replace=False)
            q, r = ids[pick], rec[pick]
            for name, call in (
                ("rocksdb get", lambda: rocks_get(q)),
                ("lmdb get", lambda: lmdb_get(q)),
                ("rocksdb put", lambda: store.put(q, r)),
                ("lmdb put", lambda: lmdb_put(q, r)),
            ):
                t = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - t) / args.keys * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{args.rows:,} rows of {RECORD.itemsize} bytes, batches of {args.keys:,} random distinct keys")
        print(
            f"{'engine':<8} {'fill rows/s':>12} {'get µs/key':>11} {'put µs/key':>11} {'miss µs':>8} "
            f"{'disk B/row':>10}"
        )
        for eng in ("rocksdb", "lmdb"):
            print(
                f"{eng:<8} {fill[eng]:>12,.0f} {med[eng + ' get']:>11.2f} {med[eng + ' put']:>11.2f} "
                f"{med[eng + ' get'] + med[eng + ' put']:>8.2f} {disk_bytes(tmp / eng) / args.rows:>10.1f}"
            )
        print(
            f"lmdb / rocksdb: get {med['lmdb get'] / med['rocksdb get']:.2f}x, put "
            f"{med['lmdb put'] / med['rocksdb put']:.2f}x, a miss (get + put) "
            f"{(med['lmdb get'] + med['lmdb put']) / (med['rocksdb get'] + med['rocksdb put']):.2f}x the time"
        )
        store.close()
        env.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
