"""`evaluate` in one process vs on worker processes (`workers=N`, `servers=S`) over a Criteo text file.

A generated Criteo-format file of `--rows` rows is read by a schema (`open_dataset`) and scored by a
Wide&Deep plan (initial tables: the timing does not depend on trained values). Each round times the
one-process path and every `--workers` setting, interleaved; the script first checks that they agree
(examples equal, loss within 1e-6). Prints examples/s (median and best of `--repeats` rounds) and the
ratio of each setting to the one-process figure measured in the same run. The parallel figure
includes starting the shards and workers (about a second each on a loaded machine): it pays off only
when the data takes longer than that to score, and when there are free cores.

    python benchmarks/evaluate_workers.py            # --rows 100000 --workers 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ingest import SCHEMA, write_criteo  # noqa: E402  (benchmarks/ingest.py: the Criteo file and schema)

from runtime.data import open_dataset  # noqa: E402
from runtime.evaluation.evaluate import evaluate  # noqa: E402
from transpiler import builder as nn  # noqa: E402
from transpiler import transpile  # noqa: E402
from transpiler.models import wide_deep  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--workers", default="2", help="comma-separated worker counts, e.g. 2,4")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    plan = transpile(wide_deep(vocab=100_000, dim=8, hidden=(64, 32), optimizer=nn.SGD(0.1)).main)
    settings = [None, *(int(w) for w in args.workers.split(","))]
    with tempfile.TemporaryDirectory(prefix="hetps-bench-eval-") as tmp:
        path = Path(tmp) / "day_0.txt"
        write_criteo(path, args.rows)
        ds = open_dataset(path, SCHEMA, batch_size=args.batch_size)
        times: dict = {w: [] for w in settings}
        ref = None
        for _ in range(args.repeats):
            for w in settings:
                t0 = time.perf_counter()
                res = evaluate(plan, ds, workers=w, servers=None if w is None else args.servers)
                times[w].append(time.perf_counter() - t0)
                ref = ref or res
                assert res["examples"] == ref["examples"] and abs(res["loss"] - ref["loss"]) <= 1e-6 * abs(
                    ref["loss"]
                ), (w, res, ref)
    base = args.rows / statistics.median(times[None])
    print(f"{args.rows} rows, batch {args.batch_size}, {args.servers} shards for the parallel runs")
    for w in settings:
        med, best = args.rows / statistics.median(times[w]), args.rows / min(times[w])
        what = "one process" if w is None else f"workers={w}"
        print(f"{what:>12}: {med:9.0f} examples/s median, {best:9.0f} best, {med / base:5.2f}x one process")


if __name__ == "__main__":
    main()
