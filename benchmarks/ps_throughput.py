"""Parameter-server throughput and memory (issue 5's benchmark).

1. One CTR step's ids (SyntheticCTR, batch 512 x 26 slots, vocab 100 000, unique'd), dim 16, SGD:
   pull + push of those rows on one sparse table, in rows/s —
   - bound: numpy `take` + `np.add.at` on a preallocated [vocab, 16] array, same rows;
   - in-process `SparseTable` (id index, lazy rows, the registry's sgd kernel);
   - over the wire: one server process, `PSClient`, tcp and ipc.
   Goal: in-process >= 50% of the bound.
2. Memory (in a fresh subprocess): a 10M-row x 16 sparse table with Adagrad state; resident memory
   against the raw bytes of keys (int64) + rows + state (float32). Goal: <= 1.5x.

    python benchmarks/ps_throughput.py [--steps 40] [--rounds 5] [--rows 10000000] [--push-rows 100000]
                                       [--skip-memory]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from threadpoolctl import threadpool_limits  # noqa: E402

from runtime.data import SyntheticCTR  # noqa: E402
from runtime.ps import Servers, make_table  # noqa: E402
from transpiler.tables import TableSpec  # noqa: E402

VOCAB, DIM = 100_000, 16


def spec(opt: str = "sgd", vocab: int = VOCAB) -> TableSpec:
    return TableSpec(
        name="emb",
        kind="sparse",
        shape=[vocab, DIM],
        dtype="float32",
        initializer={"type": "uniform", "low": -0.05, "high": 0.05, "seed": 1},
        optimizer={"type": opt, "lr": 0.01},
    )


def throughput(n_steps: int, rounds: int) -> None:
    data = SyntheticCTR(vocab=VOCAB, seed=0)
    rng = np.random.default_rng(0)
    steps = []
    for i in range(n_steps):
        ids = np.unique(data.batch(i, 512)["sparse"])
        steps.append((ids, rng.normal(0, 1e-3, (ids.size, DIM)).astype(np.float32)))
    rows = sum(ids.size for ids, _ in steps)
    print(
        f"{n_steps} steps, {rows / n_steps:.0f} unique ids per step (of 512 x 26), dim {DIM}; "
        f"{rounds} interleaved rounds"
    )

    dense = np.random.default_rng(1).uniform(-0.05, 0.05, (VOCAB, DIM)).astype(np.float32)

    def bound(ids, g):
        dense.take(ids, axis=0)
        np.add.at(dense, ids, g)

    def warm(run):
        for ids, _ in steps:  # rows exist: measure the steady state, not first-touch creation
            run(ids, np.zeros((ids.size, DIM), np.float32))
        return run

    def table_step(table):
        def run(ids, g):
            table.pull(ids)
            table.push(g, ids)

        return warm(run)

    def client_step(client):
        def run(ids, g):
            client.pull("emb", ids)
            client.push("emb", g, ids)

        return warm(run)

    with (
        Servers([spec()], transport="tcp") as tcp,
        Servers([spec()], transport="ipc") as ipc,
        tcp.client() as c_tcp,
        ipc.client() as c_ipc,
    ):
        cases = {
            "bound: take + np.add.at": bound,
            "in-process table (sgd)": table_step(make_table(spec("sgd"))),
            "in-process table (adagrad)": table_step(make_table(spec("adagrad"))),
            "over the wire, 1 server, tcp (sgd)": client_step(c_tcp),
            "over the wire, 1 server, ipc (sgd)": client_step(c_ipc),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):  # interleaved, so that load from other processes hits every case
            for name, fn in cases.items():
                t = time.perf_counter()
                for ids, g in steps:
                    fn(ids, g)
                times[name].append(time.perf_counter() - t)
    best = {name: min(ts) for name, ts in times.items()}
    mid = {name: float(np.median(ts)) for name, ts in times.items()}
    bound_name = "bound: take + np.add.at"
    print(
        f"{'pull + push of one step':40s} {'ms/step':>8s} {'M rows/s':>9s} {'vs bound':>9s}   "
        f"(min over rounds; median)"
    )
    for name in times:
        print(
            f"{name:40s} {1e3 * best[name] / n_steps:8.3f} {rows / best[name] / 1e6:9.2f} "
            f"{best[bound_name] / best[name]:8.0%}    median: {1e3 * mid[name] / n_steps:7.3f} ms, "
            f"{mid[bound_name] / mid[name]:4.0%} of bound"
        )


def _rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(n_rows: int, batch: int) -> None:
    """Runs in a fresh process: fill a sparse Adagrad table with `n_rows` rows by pushes of `batch`
    new ids, report resident memory."""
    table = make_table(spec("adagrad", vocab=-1))
    base = _rss_kib()
    t = time.perf_counter()
    for start in range(0, n_rows, batch):
        # distinct, scattered int64 ids (an odd multiplier is a bijection modulo 2^64)
        ids = np.arange(start, min(start + batch, n_rows), dtype=np.int64)
        with np.errstate(over="ignore"):
            ids = (ids * 0x5851F42D4C957F2D) & (2**62 - 1)
        table.push(np.full((ids.size, DIM), 1e-3, np.float32), ids)
    fill_s = time.perf_counter() - t
    raw = n_rows * (8 + 2 * DIM * 4)  # key + row + Adagrad moment
    index = table.index
    alloc = (
        table.rows.nbytes
        + sum(a.nbytes for a in table.row_state.values())
        + sum(a.nbytes for a in (index.main_keys, index.main_slots, index.delta_keys, index.delta_slots))
    )
    used = (_rss_kib() - base) * 1024
    ctypes.CDLL(None).malloc_trim(0)  # glibc: hand freed heap pages (temporaries) back to the OS
    trimmed = (_rss_kib() - base) * 1024
    print(
        f"{len(table):,} rows x {DIM} float32 + Adagrad moment, pushed {batch:,} new ids at a "
        f"time in {fill_s:.1f} s"
    )
    print(f"raw bytes (int64 keys + rows + state):   {raw / 2**20:7.0f} MiB")
    print(f"resident memory added (VmRSS):            {used / 2**20:7.0f} MiB = {used / raw:.2f}x raw")
    print(f"  after malloc_trim (freed temporaries):  {trimmed / 2**20:7.0f} MiB = {trimmed / raw:.2f}x raw")
    print(f"allocated, incl. never-touched capacity:  {alloc / 2**20:7.0f} MiB = {alloc / raw:.2f}x raw")
    print(f"process peak (VmHWM, incl. transients):   {_rss_kib('VmHWM') / 2**10:7.0f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--push-rows", type=int, default=100_000, help="new ids per push when filling")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    threadpool_limits(1)
    if a.memory_child:
        memory_child(a.rows, a.push_rows)
        return
    throughput(a.steps, a.rounds)
    if not a.skip_memory:
        print()
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--memory-child",
                "--rows",
                str(a.rows),
                "--push-rows",
                str(a.push_rows),
            ],
            check=True,
        )


if __name__ == "__main__":
    main()
