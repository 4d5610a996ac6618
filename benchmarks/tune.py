"""The cost model against measurement: predicted vs measured throughput of the CTR benchmark's model.

For every setting of the grid (cpu trainers x micro-batches x PS shards x modes; one gpu trainer,
EMULATED on the CPU when there is no CUDA device) this trains the model of benchmarks/ctr.py for
`--warmup` + `--steps` steps on the local engine, measures examples/s over the timed steps and
compares it with the cost model's prediction (transpiler/cost.py) from this machine's profile
(runtime/profile.py, cached under ~/.cache/hetps; `--refresh` measures it again). All processes
share this machine's cores, so the prediction is made with cores = the machine's core count.

It prints one row per setting with the error (predicted / measured - 1) and each role's predicted
vs measured CPU milliseconds per step and process (a check of the model's parts that other
processes' load skews little), the setting the tuner
picks from the same grid with its measured throughput against the best measured one, and last
`prediction error: max N%`. Measurements on a machine other processes load are noisy: compare on a
quiet machine.

    python benchmarks/tune.py                              # the whole grid (24 settings, minutes)
    python benchmarks/tune.py --trainers 1 --micro-batches 4 --servers 1 --modes async --steps 20
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def cpu_use(pred, cpu_ms: dict[str, float]) -> str:
    """Each role's predicted CPU ms per step and process against the mean measured over its processes
    (the driver's own is not modelled): a check of the model's parts that load does not skew much."""
    out = []
    for r in pred.roles:
        got = [ms for name, ms in cpu_ms.items() if name.split(":")[0] == r.role]
        pred_ms = 1e3 * (r.cpu_s if not r.server else r.busy_s)
        if got:
            out.append(f"{r.role} {pred_ms:.1f}/{sum(got) / len(got):.1f}")
    return ", ".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per setting (after warm-up)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--trainers", type=ints, default=[1, 2], help="cpu trainer counts, e.g. 1,2")
    ap.add_argument("--micro-batches", type=ints, default=[1, 4, 8])
    ap.add_argument("--servers", type=ints, default=[1, 2])
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--refresh", action="store_true", help="profile this machine again")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    logging.getLogger("hetps.device").setLevel(logging.ERROR)  # the emulation is stated below

    from benchmarks import ctr
    from runtime.profile import machine_profile, unique_fraction
    from transpiler import transpile
    from transpiler.cost import PlanCost, RunSettings
    from transpiler.tune import best_setting

    plan = transpile(ctr.build().main)
    t0 = time.perf_counter()
    profile = machine_profile(plan, refresh=args.refresh, log=print)
    cores = os.cpu_count() or 1
    frac = unique_fraction(plan, ctr.batches()[0])
    print(
        f"profile {profile.machine} ({time.perf_counter() - t0:.1f} s; emulated kinds: "
        f"{profile.emulated or 'none'}); {cores} cores shared by every process; unique ids "
        f"{100 * frac:.0f}% of a step's ids; load average {os.getloadavg()[0]:.1f}"
    )
    cost = PlanCost(plan, profile)
    grid = [
        RunSettings({"cpu": n, "gpu": 1}, mb, servers, mode, ctr.BATCH, cores, frac)
        for mode, n, mb, servers in itertools.product(
            args.modes.split(","), args.trainers, args.micro_batches, args.servers
        )
    ]
    print(
        f"{'mode':>5} {'cpu':>3} {'mb':>3} {'shards':>6} {'predicted':>10} {'measured':>10} {'error':>7}"
        f"  {'bottleneck':<10} load  CPU ms per step and process, predicted/measured"
    )
    rows = []
    for s in grid:
        pred = cost.predict(s)
        hist, cpu_ms = ctr.hetps(args.steps, args.warmup, s.trainers, s.micro_batches, s.mode, s.servers)
        meas = hist.examples_per_s(skip=args.warmup)
        err = pred.examples_per_s / meas - 1
        rows.append({"settings": s, "predicted": pred.examples_per_s, "measured": meas, "error": err})
        print(
            f"{s.mode:>5} {s.trainers['cpu']:>3} {s.micro_batches:>3} {s.servers:>6} "
            f"{pred.examples_per_s:>10,.0f} {meas:>10,.0f} {100 * err:>+6.0f}%  {pred.bottleneck:<10} "
            f"{os.getloadavg()[0]:4.1f}  {cpu_use(pred, cpu_ms)}",
            flush=True,
        )
    tuned, _ = best_setting(cost, grid)
    got = next(r for r in rows if r["settings"] is tuned.settings)
    top = max(rows, key=lambda r: r["measured"])
    print(
        f"tuned setting ({tuned.settings.describe()}): measured {got['measured']:,.0f} examples/s = "
        f"{100 * got['measured'] / top['measured']:.0f}% of the best measured "
        f"({top['settings'].describe()}: {top['measured']:,.0f})"
    )
    print(f"prediction error: max {100 * max(abs(r['error']) for r in rows):.0f}%")
    return rows


if __name__ == "__main__":
    main()
