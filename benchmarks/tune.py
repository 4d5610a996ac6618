"""The cost model against measurement: predicted vs measured throughput of the CTR benchmark's model.

For every setting of the grid (cpu trainers x micro-batches x PS shards x modes; one gpu trainer,
EMULATED on the CPU when there is no CUDA device) this trains the model of benchmarks/ctr.py for
`--warmup` + `--steps` steps on the local engine, measures examples/s over the timed steps and
compares it with the cost model's prediction (transpiler/cost/model.py) from this machine's profile
(runtime/profile/machine.py, cached under ~/.cache/hetps; `--refresh` measures it again). All processes
share this machine's cores, so the prediction is made with cores = the cores this process may use,
under the load other processes put on them: before and after each measurement the machine's load is
probed (runtime/profile/load.py: the share of a core a busy process gets alone, with one per core
and in a chain; ~0.6 s) and each row is predicted under the median of its probes, with a
prediction interval (the probes' spread and the model's band); `--no-load` predicts as if the
machine were idle. Each row prints the load average at its measurements; the last lines give the
errors of the model without the load too (the same measurements).

Throughput on a shared machine moves between runs of the same setting (by ~20% per row on a quiet
2-core machine), so the grid is measured `--repeats` times, in rounds (every setting once per
round, so a slow spell of the machine hits all settings alike), and each row reports the median
with the spread (lowest .. highest as % of the median); the error is predicted / median - 1. The
`others` column is the median number of cores that processes outside the run kept busy during its
measurements (runtime/profile/load.py `machine_busy_s`: the machine's busy CPU time less the run's own
processes'), the load the probes try to predict under.

It prints one row per setting with the error and each role's predicted vs measured CPU
milliseconds per step and process (medians; a check of the model's parts that other processes'
load skews little), the setting the tuner picks from the same grid with its measured throughput
against the best measured one, the time the whole run took, and last `prediction error: max N%`.

    python benchmarks/tune.py                    # the whole grid, 24 settings x 3 repeats (~7 min)
    python benchmarks/tune.py --repeats 1        # one pass (~2.5 min), noisier
    python benchmarks/tune.py --trainers 1 --micro-batches 4 --servers 1 --modes async --steps 20
    python benchmarks/tune.py --micro-batches 1,8 --servers 1 --repeats 3 --steps 40   # 8 settings (~4 min)
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


@dataclass
class Row:
    """One setting: its prediction and every measurement of it (examples/s, CPU ms per process)."""

    settings: Any
    prediction: Any
    rates: list[float] = field(default_factory=list)
    cpu_ms: list[dict[str, float]] = field(default_factory=list)
    loads: list[Any] = field(default_factory=list)  # the machine's load probed before and after each run
    others: list[float] = field(default_factory=list)  # cores other processes kept busy during each run

    def others_busy(self) -> str:
        """The median cores other processes kept busy over the timed steps of the row's runs."""
        return f"{statistics.median(self.others):.2f}" if self.others else ""

    def load_average(self) -> str:
        """The load average at the row's measurements (lowest-highest)."""
        got = [x.load_average for x in self.loads]
        return f"{min(got):.1f}-{max(got):.1f}" if got else ""

    def covered(self) -> bool:
        """The median measured lies in the prediction interval."""
        return self.prediction.low <= self.measured <= self.prediction.high

    @property
    def measured(self) -> float:
        return statistics.median(self.rates)

    @property
    def error(self) -> float:
        return self.prediction.examples_per_s / self.measured - 1

    def spread(self) -> str:
        """Lowest .. highest measurement as % of the median (empty with one measurement)."""
        if len(self.rates) < 2:
            return ""
        lo, hi = (100 * (r / self.measured - 1) for r in (min(self.rates), max(self.rates)))
        return f"{lo:+.0f}..{hi:+.0f}%"

    def cpu_use(self) -> str:
        """Each role's predicted CPU ms per step and process against the median measured over its
        processes and repeats (the driver's own is not modelled)."""
        out = []
        for r in self.prediction.roles:
            got = [ms for run in self.cpu_ms for name, ms in run.items() if name.split(":")[0] == r.role]
            if got:
                pred_ms = 1e3 * (r.busy_s if r.server else r.cpu_s)
                out.append(f"{r.role} {pred_ms:.1f}/{statistics.median(got):.1f}")
        return ", ".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per setting (after warm-up)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each setting (the median counts)")
    ap.add_argument("--trainers", type=ints, default=[1, 2], help="cpu trainer counts, e.g. 1,2")
    ap.add_argument("--micro-batches", type=ints, default=[1, 4, 8])
    ap.add_argument("--servers", type=ints, default=[1, 2])
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--refresh", action="store_true", help="profile this machine again")
    ap.add_argument(
        "--no-load",
        dest="load",
        action="store_false",
        help="predict as if the machine were idle (no load probes before the measurements)",
    )
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 2 or args.warmup < 1:
        ap.error("--repeats and --warmup must be at least 1, --steps at least 2")
    return args


def prepare(args: argparse.Namespace) -> tuple[Any, list[Row]]:
    """The cost model of the CTR plan from this machine's profile, and one Row per grid setting."""
    from benchmarks import ctr
    from runtime.profile.load import available_cores
    from runtime.profile.machine import machine_profile, unique_fraction
    from transpiler import transpile
    from transpiler.cost.model import PlanCost, Workload
    from transpiler.settings import ScaleConfig

    plan = transpile(ctr.build().main)
    t0 = time.perf_counter()
    profile = machine_profile(plan, refresh=args.refresh, log=print)
    cores = available_cores()
    frac = unique_fraction(plan, ctr.batches()[0])
    print(
        f"profile {profile.machine} ({time.perf_counter() - t0:.1f} s; emulated kinds: "
        f"{profile.emulated or 'none'}); {cores} cores shared by every process; unique ids "
        f"{100 * frac:.0f}% of a step's ids; load average {os.getloadavg()[0]:.1f}"
    )
    cost = PlanCost(plan, profile)
    workload = Workload(ctr.BATCH, cores, frac)
    if args.load:
        print(f"load now: {profile.load.describe()}")
    rows = [
        Row(s, cost.predict(s, workload))
        for s in (
            ScaleConfig({"cpu": n, "gpu": 1}, mb, servers, mode)
            for mode, n, mb, servers in itertools.product(
                args.modes.split(","), args.trainers, args.micro_batches, args.servers
            )
        )
    ]
    return cost, rows


def measure(args: argparse.Namespace, cost: Any, rows: list[Row]) -> None:
    """Train every setting `--repeats` times, one round through the grid after another (each between
    two probes of the machine's load, `--load`)."""
    from dataclasses import replace

    from benchmarks import ctr
    from runtime.profile.load import probe as probe_load

    for k in range(args.repeats):
        t0 = time.perf_counter()
        for row in rows:
            s = row.settings
            if args.load:
                row.loads.append(probe_load(seconds=0.2, slices=2))
            hist, cpu_ms, _, _, others = ctr.hetps(
                args.steps, args.warmup, s.trainers, s.micro_batches, s.mode, s.servers
            )
            row.rates.append(hist.examples_per_s(skip=args.warmup))
            row.cpu_ms.append(cpu_ms)
            if others is not None:
                row.others.append(others)
            got = ""
            if args.load:
                row.loads.append(probe_load(seconds=0.2, slices=2))
                x, y = row.loads[-2:]
                w = replace(
                    row.prediction.workload,
                    share_alone=(x.alone + y.alone) / 2,
                    share_all=(x.all_cores + y.all_cores) / 2,
                    share_chain=(x.chain + y.chain) / 2,
                    competing=(x.competing + y.competing) / 2,
                    groups=median_groups([x, y]),
                )
                got = (
                    f"; a run got {x.capacity:.2f} cores before it, {y.capacity:.2f} after: predicted "
                    f"{cost.predict(s, w).examples_per_s:,.0f}"
                )
            busy = "" if others is None else f"; other processes kept {others:.2f} cores busy during it"
            print(
                f"    {s.describe()}: {row.rates[-1]:,.0f} examples/s (load average "
                f"{os.getloadavg()[0]:.1f}{busy}{got})",
                flush=True,
            )
        print(
            f"  round {k + 1} of {args.repeats}: {len(rows)} settings in {time.perf_counter() - t0:.0f} s "
            f"(load average {os.getloadavg()[0]:.1f})",
            flush=True,
        )


def median_groups(loads: list[Any]) -> tuple[tuple[float, float], ...]:
    """The other sessions' groups of the probe whose groups held the median of their threads."""
    ranked = sorted(loads, key=lambda x: sum(d for d, _ in x.groups))
    return ranked[(len(ranked) - 1) // 2].groups


def repredict(cost: Any, rows: list[Row]) -> Any:
    """Each row predicted again under the load probed before its measurements (the medians of the
    shares a thread got); returns the workload of the whole run's median load, for the tuner."""
    from dataclasses import replace

    def under(w: Any, loads: list[Any]) -> Any:
        return replace(
            w,
            share_alone=statistics.median(x.alone for x in loads),
            share_all=statistics.median(x.all_cores for x in loads),
            share_spread=min(statistics.median(x.spread for x in loads), 1.0),
            share_chain=statistics.median(x.chain for x in loads),
            competing=statistics.median(x.competing for x in loads),
            groups=median_groups(loads),
        )

    for row in rows:
        if row.loads:
            row.prediction = cost.predict(row.settings, under(row.prediction.workload, row.loads))
    every = [x for r in rows for x in r.loads]
    return under(rows[0].prediction.workload, every) if every else rows[0].prediction.workload


def ungrouped(cost: Any, row: Row) -> float:
    """The row's error predicted with the other sessions' runnable threads taken as the run's own
    session's (the cost model without the scheduler's groups)."""
    from dataclasses import replace

    w = row.prediction.workload
    flat = replace(w, competing=w.competing + sum(d for d, _ in w.groups), groups=())
    return cost.predict(row.settings, flat).examples_per_s / row.measured - 1


def report(cost: Any, rows: list[Row], workload: Any) -> None:
    from transpiler.cost.tune import best_setting

    print(
        f"{'mode':>5} {'cpu':>3} {'mb':>3} {'shards':>6} {'predicted':>10} {'interval':>17} {'measured':>10} "
        f"{'spread':>9} {'error':>6} {'load avg':>8} {'others':>6}  {'bottleneck':<10} CPU ms per step and "
        "process, "
        "predicted/measured"
    )
    for r in rows:
        s, p = r.settings, r.prediction
        print(
            f"{s.mode:>5} {s.trainers['cpu']:>3} {s.micro_batches:>3} {s.servers:>6} "
            f"{p.examples_per_s:>10,.0f} {f'{p.low:,.0f}..{p.high:,.0f}':>17} {r.measured:>10,.0f} "
            f"{r.spread():>9} {100 * r.error:>+5.0f}% {r.load_average():>8} {r.others_busy():>6}  "
            f"{p.bottleneck:<10} {r.cpu_use()}"
        )
    inside = sum(r.covered() for r in rows)
    print(f"the median measured lies in the prediction interval in {inside} of {len(rows)} settings")
    tuned, _ = best_setting(cost, [r.settings for r in rows], workload)
    got = next(r for r in rows if r.prediction.scale == tuned.scale)
    top = max(rows, key=lambda r: r.measured)
    overlap = got is not top and len(got.rates) > 1 and max(got.rates) >= min(top.rates)
    print(
        f"tuned setting ({tuned.scale.describe()}): measured {got.measured:,.0f} examples/s = "
        f"{100 * got.measured / top.measured:.0f}% of the best measured "
        f"({top.prediction.scale.describe()}: {top.measured:,.0f}; medians)"
        + ("; their measurements overlap (within the noise)" if overlap else "")
    )


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    logging.getLogger("hetps.device").setLevel(logging.ERROR)  # the emulation is stated below
    t0 = time.perf_counter()
    cost, rows = prepare(args)
    measure(args, cost, rows)
    blind = [abs(r.error) for r in rows]  # the model as if the machine were idle
    report(cost, rows, repredict(cost, rows))
    errors = [abs(r.error) for r in rows]
    loads = [x.load_average for r in rows for x in r.loads]
    print(
        f"{len(rows)} settings x {args.repeats} repeats in {(time.perf_counter() - t0) / 60:.1f} min"
        + (f"; load average {min(loads):.1f}-{max(loads):.1f}" if loads else "")
        + f"; median |error| {100 * statistics.median(errors):.0f}%"
    )
    if args.load:
        print(
            f"without the load (the machine taken as idle): median |error| "
            f"{100 * statistics.median(blind):.0f}%, max {100 * max(blind):.0f}%"
        )
        if any(r.prediction.workload.groups for r in rows):
            flat = [abs(ungrouped(cost, r)) for r in rows]
            print(
                "with the other sessions' threads counted as if in the run's own session (no "
                f"groups): median |error| {100 * statistics.median(flat):.0f}%, max {100 * max(flat):.0f}%"
            )
    print(f"prediction error: max {100 * max(errors):.0f}%")
    return rows


if __name__ == "__main__":
    main()
