"""How busy this machine is now, for the cost model (`transpiler.cost.profile.Load`).

- the cores this process may use: its CPU affinity, capped by a cgroup CPU quota (`cpu.max`);
- contention: a calibration kernel (matrix products, one BLAS thread) runs in one process alone,
  then in one process per core at once; each one's CPU time against the wall time it took is the
  share of a core it got. Linux shares a core among the runnable threads (by their weights), so
  both shares say how a run's capacity grows with its threads beside the other processes' load
  (the scheduler shares cores among threads, and with autogroups among sessions first);
- a chain: two processes computing in turn and waking each other (as trainers pass items), its
  CPU time against the wall time: beside other processes every wake waits for a core;
- the other processes' runnable threads, weighted by their nice values (`competing`, sampled from
  /proc): a run's busiest thread gets about cores / (competing + the run's own busy threads) of a
  core, which the two shares above, measured by a probe of one or two threads for a moment,
  overestimate when the others are always runnable (busy loops: 0.86 and 0.55 measured where a
  thread of a run got ~0.5). Where the kernel groups processes by session (autogroups), the cores
  are shared among the groups first: the threads of other sessions are counted per group
  (`groups`), this session's own (where a run's processes are) in `competing`;
- the load average and the run queue (`procs_running` of /proc/stat, sampled), for the record.

A probe takes about `3 * seconds`; the spread of the estimate over its slices is the `spread`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from transpiler.cost.profile import Load

# the load moved when a thread's share of a core differs by more than this (absolute) and by more
# than STALE_RATIO of the larger share: a cached load is then stale
STALE_ABS = 0.1
STALE_RATIO = 0.2


def available_cores() -> int:
    """CPU cores this process may run on: its affinity, capped by a cgroup v2 quota (`cpu.max`)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = max(1, min(cores, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def machine_busy_s() -> float:
    """CPU seconds every core of this machine has spent busy since boot (/proc/stat: user, nice,
    system, irq, softirq, and steal: time the hypervisor gave this machine's cores to others)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_queue(seconds: float = 0.2, every: float = 0.01) -> float:
    """Mean runnable threads on the machine over `seconds` (`procs_running`, this sampler excluded)."""
    got = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running"):
                got.append(int(line.split()[1]) - 1)
        time.sleep(every)
    return max(statistics.fmean(got), 0.0) if got else 0.0


def autogroups_on() -> bool:
    """Whether the kernel groups processes by session for scheduling (Linux autogroups)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def autogroup(pid: int | str = "self", on: bool | None = None) -> tuple[str, float] | None:
    """(name, weight) of the scheduling group (Linux autogroup: one per session) process `pid` is
    in, its weight 1.25 ** -nice of the group; None when the kernel does not group by session
    (`on`: `autogroups_on()` if already known)."""
    if not (autogroups_on() if on is None else on):
        return None
    try:
        name, _, nice = Path(f"/proc/{pid}/autogroup").read_text().split()  # "/autogroup-4 nice 0"
        return name, 1.25 ** -int(nice)
    except (OSError, ValueError):
        return None


def _runnable_weight(
    skip: int, pids: Collection[int] | None, grouped: bool
) -> dict[tuple[str, float] | None, float]:
    """Runnable threads on the machine now (state R in /proc/PID/task/TID/stat), each weighted as
    Linux's scheduler weighs it against a thread of nice 0 (about 1.25 ** -nice), by the scheduling
    group of their process (`autogroup`, where `grouped`; None: not grouped), process `skip` (the
    sampler) left out; only the processes `pids` where given."""
    total: dict[tuple[str, float] | None, float] = {}
    names = [str(p) for p in pids] if pids is not None else [e.name for e in os.scandir("/proc")]
    for name in names:
        if not name.isdigit() or int(name) == skip:
            continue
        try:
            got = 0.0
            for tid in os.listdir(f"/proc/{name}/task"):
                with open(f"/proc/{name}/task/{tid}/stat", "rb") as f:
                    rest = f.read().rsplit(b")", 1)[1].split()
                if rest[0] == b"R":
                    got += 1.25 ** -int(rest[16])  # (fields after the name: state ... nice at 16)
        except (OSError, IndexError, ValueError):  # (a thread that ended meanwhile)
            continue
        if got:
            group = autogroup(name, grouped)
            total[group] = total.get(group, 0.0) + got
    return total


def competition(
    seconds: float = 0.2, every: float = 0.02, pids: Collection[int] | None = None
) -> tuple[float, tuple[tuple[float, float], ...]]:
    """The other processes' mean runnable threads over `seconds`, weighted by their nice value (a
    `nice 19` thread counts ~0.014 of a normal one): (those in this process's scheduling group,
    or all of them when the kernel does not group by session; per other group with runnable
    threads: (its threads, its weight against this group's), `Load.groups`). `pids` limits the
    count to those processes (default: every process but this one)."""
    samples, me, grouped = [], os.getpid(), autogroups_on()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        samples.append(_runnable_weight(me, pids, grouped))
        time.sleep(every)
    mine = autogroup(on=grouped)
    sums: dict[tuple[str, float] | None, float] = {}
    for sample in samples:
        for group, threads in sample.items():
            key = None if group is None or mine is None or group[0] == mine[0] else group
            sums[key] = sums.get(key, 0.0) + threads
    n = max(len(samples), 1)
    own_weight = 1.0 if mine is None else mine[1]
    others = tuple(
        (v / n, g[1] / own_weight)
        for g, v in sorted(sums.items(), key=str)
        if g is not None and v / n >= 0.01
    )
    return sums.get(None, 0.0) / n, others


def competing(seconds: float = 0.2, every: float = 0.02, pids: Collection[int] | None = None) -> float:
    """All the other processes' mean runnable threads over `seconds`, weighted by nice, whatever
    their scheduling group (`competition` tells them apart)."""
    own, others = competition(seconds, every, pids)
    return own + sum(d for d, _ in others)


def _slices(seconds: float, slices: int, start: float, out: Any) -> None:
    """Busy matrix products from wall time `start`; puts the share of a core got in each slice."""
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).standard_normal((256, 256))
    got = []
    with threadpool_limits(1):
        while time.time() < start:
            time.sleep(0.001)
        for _ in range(slices):
            w0, c0 = time.perf_counter(), time.process_time()
            end = w0 + seconds / slices
            while time.perf_counter() < end:
                a @ a
            got.append(min((time.process_time() - c0) / (time.perf_counter() - w0), 1.0))
    out.put(got)


def _shares(processes: int, seconds: float, slices: int) -> list[float]:
    """Per slice of `seconds / slices`, the mean share of a core `processes` busy processes got
    (forked: they share this process's session, as a run's trainers and shards do)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start = time.time() + 0.05
    pool = [ctx.Process(target=_slices, args=(seconds, slices, start, out)) for _ in range(processes)]
    for p in pool:
        p.start()
    try:
        got = [out.get(timeout=30 + 4 * seconds) for _ in pool]
    finally:
        for p in pool:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join()
    return [statistics.fmean(g[k] for g in got) for k in range(slices)]


def _burn(seconds: float, a: np.ndarray) -> None:
    """Compute until this process has used `seconds` of CPU."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        a @ a


def _echo(conn: Any, work_s: float) -> None:
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).standard_normal((64, 64))
    with threadpool_limits(1):
        while conn.recv() is not None:
            _burn(work_s, a)
            conn.send(1)
    conn.send(time.process_time())


def chain(seconds: float = 0.4, work_s: float = 0.002) -> float:
    """The share of the wall time a chain of two processes progresses: each computes `work_s` of CPU
    and wakes the other (a message through a pipe), as a run's trainers pass items along; the
    processes' CPU time / the wall time. Beside other processes, each wake waits for a core: this
    falls below a busy thread's share."""
    from threadpoolctl import threadpool_limits

    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(there, work_s))
    proc.start()
    a = np.random.default_rng(0).standard_normal((64, 64))
    try:
        with threadpool_limits(1):
            here.send(1)
            here.recv()  # the echo is up
            w0, c0 = time.perf_counter(), time.process_time()
            mine, rounds = 0.0, 0
            while time.perf_counter() - w0 < seconds:
                _burn(work_s, a)
                here.send(1)
                here.recv()
                rounds += 1
            wall, mine = time.perf_counter() - w0, time.process_time() - c0
            here.send(None)
            if not here.poll(30):
                raise RuntimeError("the load probe's echo process did not answer within 30 s")
            here.recv()
    finally:
        proc.join(5)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    return min((mine + rounds * work_s) / wall, 1.0)


def probe(seconds: float = 0.4, slices: int = 4) -> Load:
    """This machine's load now: the calibration kernel alone, then on every core at once."""
    cores = available_cores()
    alone = _shares(1, seconds, slices)
    everywhere = _shares(cores, seconds, slices)
    mid = statistics.median(everywhere)
    own, others = competition()
    return Load(
        cores=cores,
        alone=statistics.median(alone),
        all_cores=mid,
        chain=chain(seconds),
        spread=min((max(everywhere) - min(everywhere)) / 2 / mid, 1.0),
        load_average=os.getloadavg()[0],
        run_queue=run_queue(),
        competing=own,
        groups=others,
        at=time.time(),
    )


def moved(then: Load, now: Load) -> str | None:
    """Why a profile's load is stale against `now` (the cores, or the share of them a run gets,
    moved), or None."""
    if then.cores != now.cores:
        return f"the cores available moved from {then.cores} to {now.cores}"
    pairs = (
        ("alone", then.alone, now.alone),
        ("with one per core", then.all_cores, now.all_cores),
        ("in a chain of two", then.chain, now.chain),
    )
    for what, a, b in pairs:
        if abs(a - b) > STALE_ABS and abs(a - b) > STALE_RATIO * max(a, b):
            return (
                f"the share of a core a busy thread gets {what} moved from {100 * a:.0f}% to {100 * b:.0f}% "
                f"(load average {then.load_average:.1f} -> {now.load_average:.1f})"
            )
    return None
