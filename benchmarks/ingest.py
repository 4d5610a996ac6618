"""Criteo TSV ingestion: lines/s per reader with 1 and 2 readers, and the share of a step spent
waiting for data.

A Criteo-format file (label, 13 integer, 26 hex categorical columns, tab-separated; ~10% empty
fields, Zipf-distributed categoricals) is generated, then read by `runtime.data.open_dataset` with
the Criteo schema (log1p dense, 26 hashed slots):
- reference: the line-by-line `CriteoReader` on the same file, in the same run;
- 1 reader: one process reads the whole file (`Dataset.shard(0, 1)`);
- 2 readers: two processes at once, each reading its half (`shard(i, 2)`);
lines/s per reader = its lines / its wall time; per CPU second = its lines / its CPU time (parsing
runs on the prefetch thread; both threads' CPU time counts). Then one process trains Wide&Deep
(26 slots, Adam) with `Executor` on batches from the dataset and measures the time it blocks on
the next batch (the prefetch thread parses the next batches meanwhile).

    python benchmarks/ingest.py                 # --lines 300000 --batch 2048 --steps 60
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
from threadpoolctl import threadpool_limits

SCHEMA = {
    "label": "label",
    "dense": [f"I{i}" for i in range(1, 14)],
    "transform": "log1p",
    "sparse": [f"C{i}" for i in range(1, 27)],
    "vocab": 100_000,
}


def write_criteo(path: Path, lines: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    cols = {"label": (rng.random(lines) < 0.25).astype(np.int8)}
    for i in range(1, 14):
        v = np.minimum(rng.zipf(1.5, lines), 10**6).astype(object)
        v[rng.random(lines) < 0.1] = ""
        cols[f"I{i}"] = pa.array([str(x) for x in v])
    for i in range(1, 27):
        words = np.char.mod("%08x", rng.integers(0, 2**31, 50_000))
        v = words[np.minimum(rng.zipf(1.2, lines), 50_000) - 1].astype(object)
        v[rng.random(lines) < 0.1] = ""
        cols[f"C{i}"] = pa.array(v.tolist(), pa.string())
    opts = pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    pcsv.write_csv(pa.table(cols), str(path), opts)


def read_shard(ds, index: int, count: int, out) -> None:
    t, c = time.perf_counter(), time.process_time()
    rows = sum(len(feed["label"]) for feed, _ in ds.shard(index, count))
    out.put((index, rows, time.perf_counter() - t, time.process_time() - c))


def readers(ds, count: int) -> list[tuple[int, int, float, float]]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=read_shard, args=(ds, i, count, q)) for i in range(count)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return got


def legacy_rate(path: Path, batch: int, limit: int) -> float:
    from runtime.data import CriteoReader

    t, n = time.perf_counter(), 0
    for b in CriteoReader(path, vocab=100_000, batch_size=batch):
        n += len(b["label"])
        if n >= limit:
            break
    return n / (time.perf_counter() - t)


def data_wait(ds, steps: int) -> tuple[float, float]:
    """(share of the loop's time blocked on the next batch, seconds per step)."""
    from runtime import Executor
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    model = wide_deep(num_slots=26, num_dense=13, vocab=SCHEMA["vocab"], dim=16, optimizer=nn.Adam(lr=0.001))
    exe = Executor()
    exe.run(model.startup)
    it = iter(ds)
    exe.run(model.main, feed=next(it))  # warm-up
    waited, t0, done = 0.0, time.perf_counter(), 0
    for _ in range(steps):
        t = time.perf_counter()
        feed = next(it, None)
        waited += time.perf_counter() - t
        if feed is None:
            break
        exe.run(model.main, feed=feed)
        done += 1
    total = time.perf_counter() - t0
    return waited / total, total / max(done, 1)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=300_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=60, help="training steps for the data-wait figure")
    ap.add_argument("--dir", help="where to write the file (default: a temporary directory)")
    args = ap.parse_args(argv)
    threadpool_limits(1)
    from runtime.data import open_dataset

    with tempfile.TemporaryDirectory(prefix="hetps-ingest-", dir=args.dir) as tmp:
        path = Path(tmp) / "day_0.txt"
        t = time.perf_counter()
        write_criteo(path, args.lines)
        size = path.stat().st_size
        print(
            f"{args.lines:,} Criteo lines, {size / 2**20:.0f} MiB, written in {time.perf_counter() - t:.1f} s"
        )
        ds = open_dataset(path, SCHEMA, batch_size=args.batch)
        ds.plan(1), ds.plan(2)  # the newline counts, done once by the driver in training
        ref = legacy_rate(path, args.batch, min(args.lines, 50_000))
        print(f"reference: CriteoReader (line by line) {ref:>12,.0f} lines/s")
        out: dict[str, float] = {"legacy": ref}
        for count in (1, 2):
            got = readers(ds, count)
            wall = max(g[2] for g in got)
            for i, rows, secs, cpu in got:
                print(
                    f"{count} reader(s), reader {i}: {rows / secs:>12,.0f} lines/s  "
                    f"({rows / cpu:,.0f} per CPU second, {rows:,} lines in {secs:.2f} s)  "
                    f"= {rows / secs / ref:.1f}x the reference"
                )
            out[f"readers{count}"] = sum(g[1] for g in got) / wall
            out[f"cpu{count}"] = sum(g[3] for g in got)
            print(
                f"{count} reader(s) together: {out[f'readers{count}']:,.0f} lines/s, "
                f"{out[f'cpu{count}']:.2f} CPU s in all"
            )
        ratio = out["readers2"] / out["readers1"]
        print(
            f"2 readers / 1 reader: {ratio:.2f}x lines/s (on a machine shared with other jobs, a lower "
            f"bound); CPU s in all: {out['cpu2'] / out['cpu1']:.2f}x (1.0: no line parsed twice)"
        )
        share, per_step = data_wait(ds, args.steps)
        out["wait_share"] = share
        print(
            f"training Wide&Deep (batch {args.batch}, Executor, 1 process): {per_step * 1e3:.0f} ms/step, "
            f"{share:.1%} of it waiting for data"
        )
    return out


if __name__ == "__main__":
    main()
