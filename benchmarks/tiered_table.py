"""Tiered sparse table (rows in RocksDB under a RAM tier, `storage="disk"`) against the RAM table.

A Zipf-distributed id stream (bounded power law over the table's ids, alpha 1.1, ranks scattered
over the id space by a multiplicative hash), batches of 4096 x 26 ids unique'd per step, dim 16,
Adagrad. Each table is first filled with `rows` rows (the initializer's values, zero moments: what
lazily created rows hold; `fill_s` / `fill_rows_per_s`: the table's `load_state` calls alone),
then runs `warmup` steps (a tiered table: until its RAM tier is full, so that the hit rate is the
steady state's) + `steps` timed steps of pull + push; the RAM table of as many rows (at most
`--ram-max`; else the last one measured) is the reference of `ratio_to_ram`. Per (table, rows),
in a fresh subprocess: throughput (pulled + pushed rows/s), the RAM hit rate of the pulls
(`hit_rate`; `hit_rate_pull_and_push` counts the push's lookups too, all hits after its pull) and
its bound `ideal_hit_rate` (a tier of `max_rows` rows holding the stream's most probable ids, from
the stream's known distribution: `ideal_hit_rate`), the
process's anonymous resident memory growth (RssAnon after the fill and after the steps, against the budget;
peak RSS), disk bytes per row.

    python benchmarks/tiered_table.py                       # --rows 100000,1000000 --budget 64MiB
    python benchmarks/tiered_table.py --rows 10000000 --kinds disk --steps 5
    python benchmarks/tiered_table.py --rows 1000000,10000000 --budget-ratio 10   # table = 10 x budget
    python benchmarks/tiered_table.py --delta --rows 1000000 --touch 1000,10000,100000

`--delta`: delta checkpoints (runtime/ps/delta.py). Per kind, a table of `rows` rows is saved in
full, then for each `touch` count that many rows (Zipf-drawn, distinct) get one push and the table
is saved again as a delta: the delta's new bytes on disk against the full save's (its reference in
the same run), bytes per touched row, and both save times.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from threadpoolctl import threadpool_limits  # noqa: E402

from ops_registry import init_rows  # noqa: E402
from runtime.ps import make_table  # noqa: E402
from runtime.ps.index import unique_ids  # noqa: E402
from runtime.ps.tiered import parse_bytes  # noqa: E402
from transpiler.tables import TableSpec  # noqa: E402

DIM, BATCH, SLOTS, ALPHA = 16, 4096, 26, 1.1
ROW_BYTES = 2 * DIM * 4  # a row of the table in RAM: Param + Adagrad's Moment, float32
INIT = {"type": "uniform", "low": -0.05, "high": 0.05, "seed": 1}


def rss() -> int:
    """Anonymous resident bytes (RssAnon: the process's own memory; file pages the OS may drop,
    such as RocksDB's SST files in the page cache, are not counted), after returning freed heap
    memory to the OS (malloc_trim)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def rss_file() -> int:
    """File-backed resident bytes (RssFile: the mmap'd SST pages the OS may drop)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssFile:"))


def pymalloc_bytes() -> int:
    """Bytes of Python's small-object arenas now (`sys._debugmallocstats`, read from its stderr):
    freed small objects (the engine's keys and values as bytes) stay there until a whole arena
    is free."""
    import os
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        line = next(x for x in f if "bytes/arena" in x)
    return int(line.split("=")[1].replace(",", ""))


def zipf_ids(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """`size` ids in [0, n): rank r (1-based) with probability ~ r^-ALPHA, ranks hashed over ids."""
    u = rng.random(size)
    rank = np.floor(((n ** (1 - ALPHA) - 1) * u + 1) ** (1 / (1 - ALPHA))).astype(np.int64) - 1
    return (np.minimum(rank, n - 1) * 2654435761) % n  # a permutation of [0, n) for n not divisible by it


def rank_probs(n: int, lo: int, hi: int) -> np.ndarray:
    """P(rank = r) of `zipf_ids`' stream over [0, n) for ranks lo <= r < hi: rank r is drawn when
    the inverse-CDF point x = ((n^(1-a) - 1) u + 1)^(1/(1-a)) lies in [r + 1, r + 2)."""
    x = np.arange(lo + 1, hi + 2, dtype=np.float64)
    cdf = np.minimum(1.0, (x ** (1 - ALPHA) - 1) / (n ** (1 - ALPHA) - 1))
    return np.diff(cdf)


def ideal_hit_rate(n: int, capacity: int, draws: int = BATCH * SLOTS) -> float:
    """The pull hit rate of a RAM tier holding the `capacity` most probable ids of the stream for
    good (the optimum of any online policy on an i.i.d. stream), per step of `draws` ids unique'd:
    id i is in a step with probability q_i = 1 - (1 - p_i)^draws, so the rate is the sum of q over
    the top `capacity` ranks over the sum of q over all ranks (computed in chunks of 10^7 ranks)."""
    top = total = 0.0
    for lo in range(0, n, 10**7):
        hi = min(n, lo + 10**7)
        q = -np.expm1(draws * np.log1p(-rank_probs(n, lo, hi)))
        total += q.sum()
        top += q[: max(0, min(hi, capacity) - lo)].sum()
    return top / total


def make_spec(kind: str, rows: int, budget: str, **extra: object) -> TableSpec:
    """The benchmark's table: [rows, DIM] with Adagrad, in RAM (`memory`) or tiered (`disk`)."""
    return TableSpec(
        "emb",
        "sparse",
        [rows, DIM],
        initializer=INIT,
        optimizer={"type": "adagrad", "lr": 0.01},
        storage=kind,
        memory_budget=budget if kind == "disk" else None,
        **extra,
    )


def fill(t, rows: int) -> float:
    """Load `rows` initial rows into `t`; seconds in the table's `load_state` calls alone."""
    fill_s, chunk = 0.0, 1 << 19
    for lo in range(0, rows, chunk):
        ids = np.arange(lo, min(rows, lo + chunk))
        param = init_rows(INIT, (rows, DIM), "float32", ids)
        t0 = time.perf_counter()
        t.load_state({"ids": ids, "Param": param, "Moment": np.zeros_like(param)})
        fill_s += time.perf_counter() - t0
    return fill_s


def step_batches(rows: int):
    """Endless (unique'd ids, grads) of the Zipf stream (seed 0: the same stream for every kind)."""
    rng = np.random.default_rng(0)
    while True:
        ids = unique_ids(zipf_ids(rng, rows, BATCH * SLOTS))
        yield ids, rng.normal(0, 1e-3, (ids.size, DIM)).astype(np.float32)


def run_steps(t, rows: int, warmup: int, steps: int) -> dict:
    """`warmup` steps (a disk table: at least until its RAM tier has evicted once or a step misses
    none, at most 1000), then `steps` timed steps of pull + push; rows moved, seconds, RAM
    hits/lookups."""
    stream, disk = step_batches(rows), hasattr(t, "stats")
    n = 0
    missed = disk
    while n < warmup or (missed and not t.stats.evicted and n < 1000):
        ids, g = next(stream)
        before = t.stats.lookups - t.stats.ram_hits if disk else 0
        t.pull(ids)
        t.push(g, ids)
        missed = disk and t.stats.lookups - t.stats.ram_hits > before  # (a miss: the tier is not warm)
        n += 1
    work = [next(stream) for _ in range(steps)]
    h0, l0 = (t.stats.ram_hits, t.stats.lookups) if disk else (0, 0)
    pull_hits = 0  # (the pulls' own hits: a push after its pull finds every row in RAM)
    t0, c0 = time.perf_counter(), time.process_time()
    for ids, g in work:
        before = t.stats.ram_hits if disk else 0
        t.pull(ids)
        pull_hits += t.stats.ram_hits - before if disk else ids.size
        t.push(g, ids)
    run_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    hits, lookups = (t.stats.ram_hits - h0, t.stats.lookups - l0) if disk else (1, 1)
    moved = 2 * sum(ids.size for ids, _ in work)
    pull_hit = pull_hits / (moved // 2)
    return {
        "warmup_steps": n,
        "moved": moved,
        "run_s": run_s,
        "cpu_s": cpu_s,
        "hit": hits / lookups,
        "pull_hit": pull_hit,
    }


def one(kind: str, rows: int, budget: str, warmup: int, steps: int) -> dict:
    """One table's measurements (see the module docstring)."""
    base, base_py = rss(), pymalloc_bytes()
    t = make_table(make_spec(kind, rows, budget))
    fill_s = fill(t, rows)
    filled = rss()
    r = run_steps(t, rows, warmup, steps)
    moved, run_s, cpu_s = r["moved"], r["run_s"], r["cpu_s"]
    out = {
        "kind": kind,
        "rows": len(t),
        "fill_s": round(fill_s, 1),
        "fill_rows_per_s": round(rows / fill_s),
        "warmup_steps": r["warmup_steps"],
        "unique_per_step": round(moved / 2 / steps),
        "rows_per_s": round(moved / run_s),
        "rows_per_cpu_s": round(moved / cpu_s),
        "ms_per_step": round(1000 * run_s / steps, 1),
        "hit_rate": round(r["pull_hit"], 3),
        "hit_rate_pull_and_push": round(r["hit"], 3),
        "rss_growth_mib": round((rss() - base) / 2**20, 1),
        "rss_after_fill_mib": round((filled - base) / 2**20, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10, 1),
        "table_mib": round(t.memory_bytes() / 2**20, 1),
    }
    if kind == "disk":
        t.flush()  # every row on disk once: the bytes a row costs there
        t.store.db.compact_range(None, None)
        out.update(
            budget_mib=round(parse_bytes(budget) / 2**20, 1),
            resident=t.resident(),
            max_rows=t.max_rows,
            ideal_hit_rate=round(ideal_hit_rate(rows, t.max_rows), 3),
            engine_mib=round(t.engine_bytes() / 2**20, 1),
            **{
                f"rocksdb_{k}_mib": round(t.store.db.property_int_value(f"rocksdb.{p}") / 2**20, 1)
                for k, p in (
                    ("pinned", "block-cache-pinned-usage"),
                    ("readers", "estimate-table-readers-mem"),
                )
            },
            pymalloc_growth_mib=round((pymalloc_bytes() - base_py) / 2**20, 1),
            sst_files=len(list(t.store.path.glob("*.sst"))),
            rss_file_mib=round(rss_file() / 2**20, 1),
            resident_over_budget=round(out["rss_growth_mib"] * 2**20 / parse_bytes(budget), 2),
            table_over_budget=round(rows * ROW_BYTES / parse_bytes(budget), 1),
            disk_bytes_per_row=round(t.disk_bytes() / len(t), 1),
            evicted=t.stats.evicted,
        )
        t.close()
    return out


def delta_one(kind: str, rows: int, budget: str, touch: list[int]) -> list[dict]:
    import shutil
    import tempfile

    from runtime.ps.shard import Shard, save_shards

    spec = make_spec(kind, rows, budget, delta_every=1 << 30)
    shard, rng = Shard([spec]), np.random.default_rng(0)
    fill(shard.tables["emb"], rows)
    root = Path(tempfile.mkdtemp(prefix="hetps-delta-bench-"))
    out = []
    try:
        t0 = time.perf_counter()
        save_shards([shard], root / "full")
        full_s, prev = time.perf_counter() - t0, root / "full"
        full_bytes = _new_bytes(root / "full", None)
        for i, k in enumerate(touch):
            ids = np.unique(zipf_ids(rng, rows, 4 * k))[:k]
            for lo in range(0, ids.size, 1 << 15):
                part = ids[lo : lo + (1 << 15)]
                shard.push("emb", rng.normal(0, 1e-3, (part.size, DIM)).astype(np.float32), part)
            t0 = time.perf_counter()
            save_shards([shard], root / f"delta{i}")
            out.append(
                {
                    "kind": kind,
                    "rows": rows,
                    "touched": int(ids.size),
                    "full_bytes": full_bytes,
                    "delta_bytes": (d := _new_bytes(root / f"delta{i}", prev)),
                    "delta_over_full": round(d / full_bytes, 5),
                    "bytes_per_touched_row": round(d / ids.size, 1),
                    "full_save_s": round(full_s, 2),
                    "delta_save_s": round(time.perf_counter() - t0, 2),
                }
            )
            prev = root / f"delta{i}"
    finally:
        shard.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def _new_bytes(path: Path, prev: Path | None) -> int:
    """Bytes of the files of checkpoint `path` that are not hard links of those of `prev`."""
    seen = {f.stat().st_ino for f in prev.rglob("*") if f.is_file()} if prev else set()
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.stat().st_ino not in seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="100000,1000000", help="table sizes, comma-separated")
    ap.add_argument("--kinds", default="memory,disk", help="memory (RAM table) and/or disk (tiered)")
    ap.add_argument("--budget", default="64MiB", help="the tiered table's memory_budget")
    ap.add_argument(
        "--budget-ratio",
        type=float,
        help="instead of --budget: each table's budget is its RAM size (rows x 128 bytes) / this",
    )
    ap.add_argument(
        "--ram-max",
        type=int,
        default=10**7,
        help="largest RAM table measured; a larger disk table is compared with the last RAM one",
    )
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--delta", action="store_true", help="measure delta checkpoints (see above)")
    ap.add_argument("--touch", default="1000,10000,100000", help="with --delta: rows touched per delta")
    ap.add_argument("--one", nargs=2, metavar=("KIND", "ROWS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.delta:
        print(f"delta checkpoints, dim {DIM}, Adagrad, budget {a.budget} (disk)")
        for rows in (int(r) for r in a.rows.split(",")):
            for kind in a.kinds.split(","):
                with threadpool_limits(1):
                    for r in delta_one(kind, rows, a.budget, [int(k) for k in a.touch.split(",")]):
                        print(json.dumps(r), flush=True)
        return
    if a.one:
        with threadpool_limits(1):
            print(json.dumps(one(a.one[0], int(a.one[1]), a.budget, a.warmup, a.steps)))
        return
    print(
        f"Zipf alpha {ALPHA}, {BATCH} x {SLOTS} ids per step (unique'd), dim {DIM}, Adagrad, "
        f"budget {f'table / {a.budget_ratio}' if a.budget_ratio else a.budget}"
    )
    ref = None
    for rows in (int(r) for r in a.rows.split(",")):
        for kind in a.kinds.split(","):
            if kind == "memory" and rows > a.ram_max:
                continue  # (the last RAM table measured stays the reference)
            r = run_one(kind, rows, a)
            if kind == "memory":
                ref = r
            elif ref is not None:
                r["ram_ref_rows"] = ref["rows"]
                r["ratio_to_ram"] = round(r["rows_per_s"] / ref["rows_per_s"], 3)
                r["cpu_ratio_to_ram"] = round(r["rows_per_cpu_s"] / ref["rows_per_cpu_s"], 3)
            print(json.dumps(r), flush=True)


def run_one(kind: str, rows: int, a: argparse.Namespace) -> dict:
    """`one(kind, rows, ...)` in a fresh subprocess (its memory measured alone)."""
    budget = str(int(rows * ROW_BYTES / a.budget_ratio)) if a.budget_ratio else a.budget
    cmd = [sys.executable, __file__, "--one", kind, str(rows), "--budget", budget]
    cmd += ["--warmup", str(a.warmup), "--steps", str(a.steps)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:  # the measurement runs in a child: show what it said, not only its code
        sys.exit(f"{kind} table of {rows} rows failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
