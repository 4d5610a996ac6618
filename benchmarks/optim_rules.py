"""Cost of the optimizer rules on a parameter-server sparse table: one `SparseTable.push` (the
server-side update of a step) with plain lazy Adam as the reference, against non-lazy Adam, Paddle's
SelectedRows Adam (`paddle_sparse`, lazy and not: the non-lazy one moves every row the table holds,
as Paddle moves the whole table), an LR schedule and L2 decay (which densifies the gradient over the
held rows, as Paddle's regularizer does).

Prints, per setting, microseconds per push (median and min of --repeats) and the ratios of the mins
to lazy Adam's, measured in the same run.

    python benchmarks/optim_rules.py                  # 100k held rows, dim 16, 4096-id pushes
    python benchmarks/optim_rules.py --rows 1000000
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from runtime.ps import make_table
from transpiler.tables import TableSpec

SETTINGS = {
    "adam lazy (reference)": {"lazy_mode": True},
    "adam": {},
    "adam paddle_sparse lazy": {"lazy_mode": True, "paddle_sparse": True},
    "adam paddle_sparse": {"paddle_sparse": True},
    "adam lazy + cosine schedule": {"lazy_mode": True, "lr_schedule": {"type": "cosine", "T_max": 100}},
    "adam lazy + l2_decay": {"lazy_mode": True, "l2_decay": 1e-4},
}


def time_push(opt: dict, rows: int, dim: int, ids_per_push: int, repeats: int) -> tuple[float, float]:
    spec = TableSpec(
        name="emb",
        kind="sparse",
        shape=[-1, dim],
        dtype="float32",
        initializer={"type": "uniform", "low": -0.01, "high": 0.01, "seed": 1},
        optimizer={"type": "adam", "lr": 0.001, **opt},
    )
    table = make_table(spec)
    table.pull(np.arange(rows, dtype=np.int64))  # the rows the server holds
    rng = np.random.default_rng(0)
    times = []
    for _ in range(repeats):
        ids = rng.integers(0, rows, ids_per_push)
        grad = rng.standard_normal((ids_per_push, dim)).astype(np.float32)
        t0 = time.perf_counter()
        table.push(grad, ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, min(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--ids", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    print(f"sparse table: {a.rows} held rows x {a.dim}, {a.ids} ids per push, median of {a.repeats}")
    ref = None
    print(f"  {'setting':30s} {'median us':>10s} {'min us':>10s}   min ratio")
    for name, opt in SETTINGS.items():
        med, low = time_push(opt, a.rows, a.dim, a.ids, a.repeats)
        ref = ref or low
        print(f"  {name:30s} {med:10.0f} {low:10.0f}   x{low / ref:6.2f}")


if __name__ == "__main__":
    main()
