"""The machine's load in the cost model: the probe (runtime/profile/load.py), the share of the cores a
run gets (`transpiler.cost.model.share_of_cores`, by hand), prediction intervals, and a cached
profile that goes stale when the load moved."""

from __future__ import annotations

import json
import os

import pytest
from test_cost import dense_model, gemm_price, synthetic_profile

from runtime.profile import load as rl
from runtime.profile import machine as rp
from transpiler import transpile
from transpiler.cost.model import MODEL_BAND, Workload, group_cores, predict, share_of_cores
from transpiler.cost.profile import LinkCost, Load, Profile, PSCost
from transpiler.settings import ScaleConfig


def test_share_of_cores_by_hand():
    # an idle machine: every thread a whole core
    assert share_of_cores(3.0, 2.0, 2, 1.0, 1.0) == 1.0
    # sessions shared (autogroups): one thread gets 0.5 of a core, two get 0.25 each, i.e. the run
    # gets 0.5 cores whatever its threads; a run keeping u = 1.5 cores busy gets 0.5 / 1.5
    assert share_of_cores(3.0, 2.0, 2, 0.5, 0.25) == pytest.approx(1 / 3)
    assert share_of_cores(1.0, 2.0, 2, 0.5, 0.25) == pytest.approx(0.5)  # u = 0.5: one thread's share
    # threads shared: one gets 0.5, two get 0.5 each; at u = 1.5 the run gets 0.5 + 0.5 * 0.5 cores
    assert share_of_cores(3.0, 2.0, 2, 0.5, 0.5) == pytest.approx(0.75 / 1.5)
    assert share_of_cores(3.0, 2.0, None, 0.5, 0.25) == 1.0  # no shared cores: no load modelled


def test_share_of_cores_beside_always_runnable_threads_by_hand():
    """Two busy threads of other processes always runnable on 2 cores (`competing` 2): the run's u
    busy threads share the cores with them, cores / (2 + u) each (u >= 1; a single thread's: 2 / 3),
    even where a short probe saw more; a share the probes saw lower wins; niced ones weigh little."""
    assert share_of_cores(3.0, 2.0, 2, 1.0, 1.0, 1.0, 2.0) == pytest.approx(2 / 3.5)  # u = 1.5
    assert share_of_cores(1.0, 2.0, 2, 1.0, 1.0, 1.0, 2.0) == pytest.approx(2 / 3)  # u = 0.5
    assert share_of_cores(3.0, 2.0, 2, 0.86, 0.55, 0.88, 2.0) == pytest.approx(2 / 3.5)
    assert share_of_cores(3.0, 2.0, 2, 0.5, 0.25, 1.0, 2.0) == pytest.approx(1 / 3)  # the probes' lower
    assert share_of_cores(3.0, 2.0, 2, 1.0, 1.0, 1.0, 2 * 1.25**-19) == 1.0  # two `nice 19` loops
    assert share_of_cores(3.0, 2.0, None, 1.0, 1.0, 1.0, 2.0) == 1.0


def test_group_cores_by_hand():
    """Linux's group scheduler (a session's processes are one group): the cores go to the groups in
    proportion to their weights, none above its runnable threads, the rest to the others."""
    assert group_cores(2, 1.0) == 1.0  # alone, fewer threads than cores: all it asks
    assert group_cores(2, 3.0) == 2.0  # alone: every core
    assert group_cores(2, 1.0, ((2.0, 1.0),)) == 1.0  # 1 + 2 threads in 2 groups: a core each
    assert group_cores(2, 1.5, ((2.0, 1.0),)) == pytest.approx(1.0)
    # a nice-10 session of two loops (weight 1.25 ** -10 = 0.107) leaves a one-thread run its core
    assert group_cores(2, 1.0, ((2.0, 1.25**-10),)) == 1.0
    assert group_cores(2, 2.0, ((2.0, 1.25**-10),)) == pytest.approx(2 / (1 + 1.25**-10))
    # 3 groups on 2 cores, each asking more than 2 / 3 of them: 2 / 3 each
    assert group_cores(2, 3.0, ((1.0, 1.0), (2.0, 1.0))) == pytest.approx(2 / 3)
    # 4 cores: a group of 0.5 threads gets them; the run (3) and a group of 4 share the 3.5 left
    assert group_cores(4, 3.0, ((0.5, 1.0), (4.0, 1.0))) == pytest.approx(1.75)


def test_share_of_cores_beside_other_sessions_by_hand():
    """Two busy loops in another session take one group's part of 2 cores (one core between them),
    so a run's single busy thread keeps a whole core, where the same loops in the run's own session
    leave it 2 / 3; a run keeping 3 cores busy gets 1 core: 1 / 3 of one each (cores / (2 + 3) =
    0.4 in its own session); idle in between (u = 0.5: its one thread has a core)."""
    other = ((2.0, 1.0),)
    assert share_of_cores(2.0, 2.0, 2, 1.0, 1.0, 1.0, 0.0, other) == 1.0
    assert share_of_cores(2.0, 2.0, 2, 1.0, 1.0, 1.0, 2.0) == pytest.approx(2 / 3)
    assert share_of_cores(6.0, 2.0, 2, 1.0, 1.0, 1.0, 0.0, other) == pytest.approx(1 / 3)
    assert share_of_cores(6.0, 2.0, 2, 1.0, 1.0, 1.0, 2.0) == pytest.approx(2 / 5)
    assert share_of_cores(1.0, 2.0, 2, 1.0, 1.0, 1.0, 0.0, other) == 1.0
    # one loop in the run's session as well: the run's group has 1 + 1 threads and gets 1 core
    assert share_of_cores(2.0, 2.0, 2, 1.0, 1.0, 1.0, 1.0, other) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="Workload.groups"):
        Workload(64, 2, groups=((-1.0, 1.0),))
    assert Load(2, groups=[[2, 1]]).groups == ((2.0, 1.0),)  # (as read back from a profile's JSON)


def test_competition_tells_other_sessions_from_this_one():
    """One busy loop started in this session and two in a session of their own: where the kernel
    groups by session (/proc/sys/kernel/sched_autogroup_enabled), this session's 1 and one other
    group of 2; where it does not, 3 in one count."""
    import subprocess
    import sys
    import time

    loop = [sys.executable, "-c", "while True: pass"]
    mine = subprocess.Popen(loop)
    theirs = subprocess.Popen(
        ["bash", "-c", f"{loop[0]} -c 'while True: pass' & {loop[0]} -c 'while True: pass' & wait"],
        start_new_session=True,
    )
    try:
        time.sleep(0.7)
        pids = [
            mine.pid,
            *(int(x) for x in subprocess.check_output(["pgrep", "-s", str(theirs.pid)]).split()),
        ]
        own, others = rl.competition(0.3, pids=pids)
        if rl.autogroup() is not None:
            assert own == pytest.approx(1.0, abs=0.02)
            assert len(others) == 1 and others[0] == pytest.approx((2.0, 1.0), abs=0.02)
        else:
            assert (own, others) == (pytest.approx(3.0, abs=0.02), ())
    finally:
        mine.kill()
        os.killpg(theirs.pid, 9)
        mine.wait()
        theirs.wait()


def test_competing_counts_other_processes_runnable_threads_by_nice():
    """Two busy loops, one at nice 0 and one at nice 10: counted over their own processes they are
    1 + 1.25 ** -10 runnable threads (a busy loop is always runnable, on a core or queued); over the
    whole machine at least that much (whatever else runs only adds to it)."""
    import subprocess
    import sys
    import time

    from runtime.profile.load import competing

    loops = [
        subprocess.Popen(["nice", "-n", str(n), sys.executable, "-c", "while True: pass"]) for n in (0, 10)
    ]
    try:
        time.sleep(0.5)
        expected = 1 + 1.25**-10
        assert competing(0.3, pids=[p.pid for p in loops]) == pytest.approx(expected, abs=0.02)
        assert competing(0.3) >= expected - 0.02
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert competing(0.1, pids=[p.pid for p in loops]) == 0  # (gone: nothing left to count)


def test_prediction_under_load_and_its_interval_by_hand():
    """With a share of 0.4 of a core alone and with one per core, a run gets 0.4 of each core it
    would keep busy, whatever it keeps busy: 0.4 x the idle machine's examples/s; the interval is the
    shares +-25% and the model's band."""
    plan = transpile(dense_model())
    prof = synthetic_profile(plan, gemm_price, link=(1e-4, 1e-8), ps=(5e-4, 1e-6, 0.0), emulated=["gpu"])
    s = ScaleConfig({"cpu": 1, "gpu": 1}, 2, 1, "sync")
    idle = predict(plan, prof, s, Workload(64, 2)).examples_per_s
    busy = predict(plan, prof, s, Workload(64, 2, 1.0, 0.4, 0.4, 0.25))
    assert busy.examples_per_s == pytest.approx(0.4 * idle)
    assert busy.low == pytest.approx(0.4 * 0.75 * (1 - MODEL_BAND) * idle)
    assert busy.high == pytest.approx(0.4 * 1.25 * (1 + MODEL_BAND) * idle)
    assert "other processes take a share" in busy.limit
    with pytest.raises(ValueError, match="share_alone"):
        Workload(64, 2, 1.0, 1.5)


def test_probe_measures_this_machine():
    got = rl.probe(seconds=0.1, slices=2)
    assert got.cores == len(os.sched_getaffinity(0)) and 0 < got.alone <= 1 and 0 < got.all_cores <= 1
    assert got.load_average == pytest.approx(os.getloadavg()[0], abs=5) and got.run_queue >= 0


def test_load_moved():
    then = Load(2, alone=0.9, all_cores=0.8, load_average=1.0)
    assert rl.moved(then, Load(2, alone=0.85, all_cores=0.75)) is None
    assert "moved from 80% to 30%" in rl.moved(then, Load(2, alone=0.85, all_cores=0.3, load_average=6))
    assert "cores available moved from 2 to 4" in rl.moved(then, Load(4, alone=0.9, all_cores=0.8))


def test_cached_profile_goes_stale_when_the_load_moved(tmp_path, monkeypatch):
    """A cached profile keeps the load it was measured at; when the load now differs, the profile
    says it is stale and takes the new load (the rest stays); an unchanged load leaves it as is."""
    plan = transpile(dense_model())
    cached = synthetic_profile(plan, lambda k, op: None)
    cached.method, cached.load = rp.METHOD, Load(2, 1.0, 1.0, at=0.0)
    path = tmp_path / f"profile-{rp.machine_key()}.json"
    path.write_text(json.dumps(cached.to_dict()))
    now = Load(2, 0.5, 0.25, 0.1, load_average=6.0, at=600.0)
    monkeypatch.setattr(rp, "probe_load", lambda: now)
    said = []
    got = rp.machine_profile(plan, cache=tmp_path, log=said.append)
    assert got.load == now and any("is stale" in m and "100% to 50%" in m for m in said)
    assert Profile.from_dict(json.loads(path.read_text())).load == now
    said.clear()
    rp.machine_profile(plan, cache=tmp_path, log=said.append)
    assert not any("stale" in m for m in said)
    w = rp.workload_for(got, 256, "auto", 0.5)
    assert (w.cores, w.share_alone, w.share_all, w.share_spread) == (2, 0.5, 0.25, 0.1)
    assert rp.workload_for(got, 256, 4).share_all == 1.0  # N idle cores: no load


def test_profile_round_trips_its_load():
    load = Load(2, 0.5, 0.3, 0.1, 4.0, 3.0, 9.0)
    prof = Profile({}, LinkCost(1e-5, 1e-9), PSCost(1e-4, 1e-9, 1e-9), load=load)
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof
    old = prof.to_dict()
    del old["load"]  # a profile written before loads were measured
    assert Profile.from_dict(old).load is None
