"""This machine's cost profile for the cost model (transpiler/cost/model.py), measured once and cached.

The parts are measured by runtime/profile/measure.py (kernels, the link, the parameter server);
this module adds the runtime's own overhead, calibrated from short training runs of a small
Wide&Deep (1, 4 and 8 micro-batches, sync and async, seconds): each process's CPU per step beyond what
the measured parts explain, fitted per item and per step, per mode.

The profile is cached as JSON under `$XDG_CACHE_HOME/hetps` (default `~/.cache/hetps`), one file per
machine (host, CPU model, cores, GPU); kernels of new op signatures are added to it as they are met.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from runtime.exec.device import cuda_available, cupy_module
from runtime.profile.load import moved
from runtime.profile.load import probe as probe_load
from runtime.profile.measure import measure_link, measure_ps, profile_kernels
from transpiler.config import TranspileConfig
from transpiler.cost.model import Workload
from transpiler.cost.money import Objective
from transpiler.cost.profile import LinkCost, Overhead, Profile, PSCost
from transpiler.cost.tune import Budget, TuneResult
from transpiler.cost.tune import tune as _tune
from transpiler.ir import Program
from transpiler.plan import Plan, transpile
from transpiler.settings import ScaleConfig

# The version of how a profile is measured: a cached profile of another version is measured again
# (2: the link probe signs its messages as trainers do; the reader's union of a step's ids;
# 3: kernels by their median call, the overhead through three runs per mode, a reader's own work per
# id by its CPU time, the client's CPU share of a PS round trip; 4: the calibration plan's ops per
# item recorded, the overhead per item scaled by them).
METHOD = 4


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetps"


def machine_key() -> str:
    """Host, CPU model, cores and GPU: a profile is valid on the machine it was measured on."""
    cpu = ""
    try:
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
    except OSError:
        pass
    gpu = "none"
    if cuda_available():
        gpu = cupy_module().cuda.runtime.getDeviceProperties(0)["name"].decode()
    text = f"{platform.node()}|{cpu}|{os.cpu_count()}|{gpu}"
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", platform.node())[:40] or "host"
    return f"{host}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"


# -- the runtime's own overhead -------------------------------------------------------------------
MARGIN = 60  # steps a calibration run goes on after its last mark (> 0.1 s of this small model's)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_per_step(
    plan: Plan, data: Any, mode: str, micro_batches: int, steps: int, warmup: int
) -> dict[str, float]:
    """CPU seconds per step of every process of a short run (cpu=1, gpu=1, one shard), counted in
    steps done between the marks (`History.steps_done`: a step callback runs up to 0.1 s late); the
    run goes on `MARGIN` steps after the last mark, so every process is still there to be read."""
    from runtime.driver.train import train
    from runtime.engines import LocalEngine

    eng, marks = LocalEngine(), []

    def mark(record: dict) -> None:
        if record["step"] in (warmup - 1, warmup + steps - 1):
            marks.append(
                {
                    **{n: cpu_seconds(p) for n, p in eng.pids().items() if p},
                    "driver": time.process_time(),
                    "at": time.perf_counter(),
                }
            )

    hist = train(
        plan,
        data,
        steps=warmup + steps + MARGIN,
        batch_size=256,
        trainers={"cpu": 1, "gpu": 1},
        servers=1,
        mode=mode,
        micro_batches=micro_batches,
        allow_emulation=True,
        engine=eng,
        callback=mark,
        progress=False,
    )
    done = hist.steps_done(marks[1].pop("at")) - hist.steps_done(marks[0].pop("at"))
    return {n: (marks[1][n] - marks[0][n]) / done for n in marks[0]}


CALIBRATION_MICRO_BATCHES = (1, 4, 8)


def measure_overhead(link: LinkCost, ps: PSCost, steps: int = 40, warmup: int = 5) -> dict[str, Overhead]:
    """Calibrate the runtime's own work in each PS mode: short runs of a small Wide&Deep at 1, 4 and
    8 micro-batches measure each process's CPU per step; what the model does not explain
    (kernels, messages, PS calls) is fitted as per item + per step (`lower_line`) for the reader
    and the other trainer, per trainer for the shard, per item + per step for the driver."""
    import logging

    from runtime.data import SyntheticCTR
    from transpiler import builder
    from transpiler.cost.model import PlanCost
    from transpiler.models import wide_deep

    logging.getLogger("hetps.device").setLevel(logging.ERROR)  # the calibration emulates its gpu
    model = wide_deep(num_slots=8, vocab=1000, dim=8, hidden=(64,), optimizer=builder.SGD(lr=0.01))
    plan = transpile(model.main)
    kernels, emulated = profile_kernels(plan)
    cost = PlanCost(plan, Profile(kernels, link, ps, os.cpu_count() or 1, emulated))
    data = SyntheticCTR(vocab=1000, num_slots=8)
    return {mode: _fit_overhead(plan, cost, data, mode, steps, warmup) for mode in ("sync", "async")}


def lower_line(points: dict[int, float]) -> tuple[float, float]:
    """(per item, per step), each >= 0, of the line under {items: seconds} that the points lie on or
    above with the least total excess: the CPU a run spends beyond its work only ever adds (a
    collection, page faults, a core's caches taken by another process), so the lowest line through
    the runs is the overhead and a run that caught a hiccup lies above it. (Through two runs, one
    run's hiccup went in whole: an async calibration once came out 0 per item and 4.3 ms per step
    where others give ~0.3 ms and ~0.3 ms.) Among the lines through two points (where such a line
    lies), the one every point is on or above with the smallest sum of excesses."""
    xs = sorted(points)
    if len(xs) < 2:
        return 0.0, max(points[xs[0]], 0.0) if xs else 0.0
    best = None
    for i, a in enumerate(xs):
        for b in xs[i + 1 :]:
            slope = (points[b] - points[a]) / (b - a)
            excess = [points[x] - points[a] - slope * (x - a) for x in xs]
            if min(excess) >= -1e-12 and (best is None or sum(excess) < best[0]):
                best = (sum(excess), slope, points[a] - slope * a)
    _, slope, step = best  # the lower convex hull has an edge: some pair always qualifies
    if slope < 0:  # a falling line: no per-item cost, the per step the lowest point
        return 0.0, max(min(points.values()), 0.0)
    return slope, max(step, 0.0)


def _fit_overhead(plan: Plan, cost: Any, data: Any, mode: str, steps: int, warmup: int) -> Overhead:
    resid: dict[str, dict[int, float]] = {}
    driver: dict[int, float] = {}
    for mb in CALIBRATION_MICRO_BATCHES:
        got = _cpu_per_step(plan, data, mode, mb, steps, warmup)
        driver[mb] = got["driver"]
        pred = cost.predict(ScaleConfig({"cpu": 1, "gpu": 1}, mb, 1, mode), Workload(256))
        for r in pred.roles:
            name = f"{r.role}:0"
            model_s = r.busy_s if r.server else r.cpu_s
            resid.setdefault(r.role, {})[mb] = got.get(name, model_s) - model_s

    reader_item, reader_step = lower_line(resid["cpu"])
    item, step = lower_line(resid["gpu"])
    talking = cost.talking(ScaleConfig({"cpu": 1, "gpu": 1}, 1, 1, mode))
    serve = max(min(resid["ps"].values()), 0.0) / max(talking, 1)  # per trainer that talks to the shard
    driver_item, driver_step = lower_line(driver)
    ops = {t: tc.ops for t, tc in cost.types.items()}
    return Overhead(
        reader_item, reader_step, item, step, serve, driver_item, driver_step, ops["cpu"], ops["gpu"]
    )


# -- the cached profile ----------------------------------------------------------------------------
def load_profile(path: str | Path) -> Profile:
    """A profile JSON file (`Profile.to_dict`), e.g. one written by `machine_profile`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no profile at {path}")
    try:
        return Profile.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a hetps profile ({type(e).__name__}: {e}); write one with "
            "Profile.to_dict, or let hetps measure this machine (no --profile)"
        ) from None


def machine_profile(
    plan: Plan,
    *,
    refresh: bool = False,
    cache: Path | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> Profile:
    """This machine's profile, with kernel times for every op of `plan`: from the cache, measuring
    (and saving) what it lacks; `refresh` measures everything again."""
    path = (cache or cache_dir()) / f"profile-{machine_key()}.json"
    prof = None
    if not refresh and path.is_file():
        try:
            prof = load_profile(path)
        except ValueError as e:
            log(f"{e}: measuring this machine again")
    if prof is not None and prof.method != METHOD:
        log(f"{path} was measured by another hetps (method {prof.method}, now {METHOD}): measuring again")
        prof = None
    measured = prof is None
    if measured:
        log("profiling the link and the parameter server (a few seconds) ...")
        link, ps = measure_link(), measure_ps()
        log("calibrating the runtime's own overhead (six short training runs) ...")
        overhead = measure_overhead(link, ps)
        prof = Profile({}, link, ps, os.cpu_count() or 1, [], machine_key(), overhead, METHOD)
    reloaded = _check_load(prof, path, log)
    missing = prof.missing(plan.programs)
    if missing:
        log(f"profiling {sum(len(v) for v in missing.values())} kernel(s) on {', '.join(missing)} ...")
        have = {f"{k}/{s}" for k, t in prof.kernels.items() for s in t}
        kernels, emulated = profile_kernels(plan, tuple(missing), skip=have)
        for kind, table in kernels.items():
            prof.kernels.setdefault(kind, {}).update(table)
        prof.emulated = sorted(set(prof.emulated) | set(emulated))
    if measured or missing or reloaded:
        _write_atomic(path, json.dumps(prof.to_dict(), indent=1))
    return prof


def _check_load(prof: Profile, path: Path, log: Callable[[str], None]) -> bool:
    """Probe the machine's load now (about a second); when the profile has none or its load moved,
    the profile is stale: take the new load (kernels, link and PS are timed by CPU time or the
    fastest of repeats, which other processes' load moves little; the load is what moved). True when
    the profile changed."""
    now = probe_load()
    why = "it has no load measured" if prof.load is None else moved(prof.load, now)
    if why is None:
        return False
    if prof.load is not None:
        age = max(now.at - prof.load.at, 0.0) / 60
        log(f"{path.name} is stale ({why}; measured {age:.0f} min ago): re-profiling the load")
    prof.load = now
    log(f"load: {now.describe()}")
    return True


def workload_for(
    profile: Profile,
    batch_size: int = 512,
    cores: int | str | None = None,
    unique_fraction: float = 1.0,
) -> Workload:
    """The cost model's workload: `cores` "auto": all processes share this machine's available cores
    under the load the profile measured; N: they share N idle cores; None: a core each."""
    if cores != "auto":
        return Workload(batch_size, cores, unique_fraction)
    load = profile.load or probe_load()
    return Workload(
        batch_size,
        load.cores,
        unique_fraction,
        load.alone,
        load.all_cores,
        load.spread,
        load.chain,
        load.competing,
        load.groups,
    )


def _write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file of its own, renamed over `path`: a reader (or a second
    process profiling at the same time) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def unique_fraction(plan: Plan, batch: dict[str, np.ndarray]) -> float:
    """Unique ids / ids in `batch`'s columns that the plan's sparse pulls dedupe."""
    fracs = []
    for prog in plan.programs.values():
        for op in prog.ops:
            if op.type == "unique_ids" and op.inputs["Ids"][0] in batch:
                ids = np.asarray(batch[op.inputs["Ids"][0]])
                fracs.append(len(np.unique(ids)) / max(ids.size, 1))
    return float(np.mean(fracs)) if fracs else 1.0


def tune(
    program: Program | Plan,
    budget: Budget,
    *,
    config: TranspileConfig | None = None,
    batch_size: int = 512,
    cores: int | str | None = None,
    sample: dict[str, np.ndarray] | None = None,
    profile: Profile | None = None,
    log: Callable[[str], None] = lambda s: None,
    objective: Objective | None = None,
    workload: Workload | None = None,
    device_map: dict[str, str] | None = None,
) -> TuneResult:
    """Profile this machine (cached, unless `profile` is given) and search placement and resources
    for `program` within `budget` (see transpiler.cost.tune.tune). A Plan keeps its placement: only trainer
    counts, micro-batches, shards and modes are searched. `sample`: a batch of the data, for the share
    of unique ids among a step's ids (default 1.0: every id distinct). `cores` "auto": this machine's
    cores under its load now (`workload`); `objective`: what to maximize (default: examples/s);
    `workload`: the cost model's workload as it is (batch_size, cores and sample then unused);
    `device_map`: trainer type -> the kind it runs on (as train's)."""
    if isinstance(program, Plan):
        plan, config = program, program.config
    else:
        config = config or TranspileConfig()
        plan = transpile(program, config)
    profile = profile or machine_profile(plan, log=log)
    if workload is None:
        frac = unique_fraction(plan, sample) if sample is not None else 1.0
        workload = workload_for(profile, batch_size, cores, frac)
    return _tune(
        program if isinstance(program, Program) else None,
        profile,
        budget,
        config,
        transpile_fn=(lambda p, c: plan) if isinstance(program, Plan) else None,
        placement=not isinstance(program, Plan),
        objective=objective,
        workload=workload,
        device_map=device_map,
    )
