"""Criteo TSV ingestion: lines per CPU second of each reader with 1 and 2 readers, and the share
of a training step spent waiting for data.

A Criteo-format file (label, 13 integer, 26 hex categorical columns, tab-separated; ~10% empty
fields, Zipf-distributed categoricals) is generated, then read by `runtime.data.open_dataset` with
the Criteo schema (log1p dense, 26 hashed slots):
- reference: the line-by-line `CriteoReader` on the same file, in the same run;
- 1 reader: one process reads the whole file (`Dataset.shard(0, 1)`);
- 2 readers: two processes at once, each reading its half (`shard(i, 2)`);
- what the machine gives two processes at once: 1, then 2 CPU-bound Python loops ("spinners").
The main figure is lines per reader core: a reader's lines / its process's CPU seconds (the
prefetch thread that parses and the thread that takes the batches both count), which the other
jobs of a shared machine move less than wall time; lines/s of wall time are printed too. The
readers are forked from a driver that did what `train`'s driver does once (`Dataset.prepare`:
newline counts, the feeds' widths); what a freshly spawned reader process does once before its
first line (imports, loading the compiled hash) is measured apart. The reader runs are repeated
(`--repeat`) and medians printed. Then one process trains Wide&Deep (26 slots, Adam) with
`Executor` on batches from the dataset and measures the time it blocks on the next batch (the
prefetch thread parses the next batches meanwhile).

    python benchmarks/ingest.py                 # --lines 300000 --batch 2048 --repeat 5 --steps 60
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

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


@dataclass(frozen=True)
class Read:
    """What one process did: its lines (loop turns for a spinner), in wall seconds and CPU seconds
    (all its threads)."""

    index: int
    rows: int
    wall: float
    cpu: float


@dataclass(frozen=True)
class Run:
    """One measurement: one process alone, then two at once."""

    one: Read
    two: list[Read]

    def together(self) -> float:
        """Lines/s of the two together (wall time: until the later one is done)."""
        return sum(r.rows for r in self.two) / max(r.wall for r in self.two)

    def scale(self) -> float:
        return self.together() / (self.one.rows / self.one.wall)


def read_shard(ds, index: int, count: int, out) -> None:
    t, c = time.perf_counter(), time.process_time()
    rows = sum(len(feed["label"]) for feed, _ in ds.shard(index, count))
    out.put(Read(index, rows, time.perf_counter() - t, time.process_time() - c))


def spin(index: int, turns: int, out) -> None:
    """A CPU-bound Python loop: what two processes at once get of the machine's cores."""
    t, c = time.perf_counter(), time.process_time()
    x = 0
    for i in range(turns):
        x += i
    out.put(Read(index, turns, time.perf_counter() - t, time.process_time() - c))


def at_once(target, args: list[tuple]) -> list[Read]:
    """Run `target(*a, queue)` for each `a` in forked processes at once; their `Read`s."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, q)) for a in args]
    for p in procs:
        p.start()
    got = sorted((q.get(timeout=600) for _ in procs), key=lambda r: r.index)
    for p in procs:
        p.join(timeout=60)
    return got


def readers(ds, count: int) -> list[Read]:
    return at_once(read_shard, [(ds, i, count) for i in range(count)])


def spinners(count: int, turns: int = 4_000_000) -> list[Read]:
    return at_once(spin, [(i, turns) for i in range(count)])


def legacy_rate(path: Path, batch: int, limit: int) -> tuple[float, float]:
    """(lines/s, lines per CPU second) of the line-by-line `CriteoReader` on its first `limit` lines."""
    from runtime.data import CriteoReader

    t, c, n = time.perf_counter(), time.process_time(), 0
    for b in CriteoReader(path, vocab=100_000, batch_size=batch):
        n += len(b["label"])
        if n >= limit:
            break
    return n / (time.perf_counter() - t), n / (time.process_time() - c)


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


def startup(out) -> None:
    """What a freshly spawned reader process does once before its first line: import the data
    stack and load the compiled hash (numba: from its on-disk cache after the first run)."""
    t, c = time.perf_counter(), time.process_time()
    from runtime.data.files import fnv

    fnv.ids(pa.array(["x"]), b"", 1, 2)
    out.put((time.perf_counter() - t, time.process_time() - c))


def startup_cost() -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=startup, args=(q,))
    p.start()
    got = q.get(timeout=300)
    p.join(timeout=60)
    return got


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=300_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5, help="runs of the 1- and 2-reader measurements")
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
            f"{args.lines:,} Criteo lines, {size / 2**20:.0f} MiB, written in {time.perf_counter() - t:.1f} "
            f"s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        ds = open_dataset(path, SCHEMA, batch_size=args.batch)
        ds.prepare(1), ds.prepare(2)  # what the driver does once in training
        wall, cpu = startup_cost()
        print(
            f"once per spawned reader process, before its first line (imports, compiled hash loaded): "
            f"{wall:.2f} s, {cpu:.2f} CPU s (not in the figures below)"
        )
        ref_wall, ref = legacy_rate(path, args.batch, min(args.lines, 50_000))
        print(f"reference: CriteoReader (line by line) {ref:,.0f} lines/CPU s ({ref_wall:,.0f} lines/s)")
        out: dict[str, float] = {"legacy": ref}
        runs: list[Run] = []
        machine: list[Run] = []
        for r in range(args.repeat):
            machine.append(Run(spinners(1)[0], spinners(2)))
            runs.append(Run(readers(ds, 1)[0], readers(ds, 2)))
            one, two = runs[-1].one, runs[-1].two
            print(
                f"run {r + 1}: 1 reader {one.rows / one.cpu:>9,.0f} lines/CPU s ({one.rows / one.wall:,.0f} "
                f"lines/s); 2 readers {' + '.join(f'{g.rows / g.cpu:,.0f}' for g in two)} lines/CPU s, "
                f"together {runs[-1].together():,.0f} lines/s = {runs[-1].scale():.2f}x 1 reader "
                f"(2 spinners: {machine[-1].scale():.2f}x 1)"
            )
        out.update(
            per_cpu1=median(run.one.rows / run.one.cpu for run in runs),
            per_cpu2=median(g.rows / g.cpu for run in runs for g in run.two),
            wall1=median(run.one.rows / run.one.wall for run in runs),
            wall2=median(run.together() for run in runs),
            scale=median(run.scale() for run in runs),
            machine=median(run.scale() for run in machine),
            cpu_ratio=median(sum(g.cpu for g in run.two) / run.one.cpu for run in runs),
        )
        rows2 = {sum(g.rows for g in run.two) for run in runs}
        print(
            f"medians of {args.repeat} runs (load average now {os.getloadavg()[0]:.1f}):\n"
            f"  per reader core: 1 reader {out['per_cpu1']:,.0f} lines/CPU s = {out['per_cpu1'] / ref:.1f}x "
            f"the reference; each of 2 readers {out['per_cpu2']:,.0f} lines/CPU s "
            f"({out['per_cpu2'] / out['per_cpu1']:.2f}x 1 reader's)\n"
            f"  wall: 1 reader {out['wall1']:,.0f} lines/s; 2 readers together {out['wall2']:,.0f} lines/s "
            f"= {out['scale']:.2f}x 1 reader, where 2 CPU-bound spinners got {out['machine']:.2f}x 1 "
            f"(2.0: two idle cores; less when other jobs share them)\n"
            f"  2 readers read {sorted(rows2)} lines together (of {args.lines:,}), with "
            f"{out['cpu_ratio']:.2f}x 1 reader's CPU seconds (1.0: no line parsed twice)"
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
