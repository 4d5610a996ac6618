"""The gpu trainer's own host work per step for the CTR model's dense stage, on the cupy stand-in.

Runs the gpu trainer's sub-program of `benchmarks/ctr.py`'s model (the MLP 400-400-400 and its
loss, batch 512, one micro-batch) in this process, step after step, as a trainer runs it: its
segments through the Executor with the trainer's handlers (`Mail` with its copy stream for the
received and sent tensors, the held tables' pull and step on the device), on `tests/fake_cupy.py`.
CPU time per step minus the time inside the stand-in's kernels (numpy underneath) is the host work
the same code does on a GPU: op dispatch, copies' bookkeeping, the optimizer's per-table calls.
What counts as the device's, not the host's: each kernel call, a graph's replay as a whole (the
stand-in runs its kernels on the CPU; a GPU's host only launches it), and the host <-> device DMA
of `ndarray.set` / `get(out=)` from and into pinned buffers (a GPU's copy engine). What stays host
work: everything else, the memcpy into and out of the pinned staging buffers among it (real CPU
work on a GPU too), and the stand-in's per-call wrappers (cupy's own dispatch costs as much). The
stand-in's timer reads around each timed call are CPU a GPU does not spend: printed apart
(calibrated in the run), and the host work less them. Messages (ZeroMQ, shared memory) are not in
it: `ctr.py --stand-in` reports the whole trainer.

    python benchmarks/gpu_host_work.py [--steps 50] [--batch 512 8] [--profile]

Each batch size runs eagerly and with device graphs (`runtime.exec.graphs`), as `RunConfig.device_graphs`.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]
os.environ["HETPS_FAKE_CUPY"] = "fake_cupy"


def setup(batch: int, graphs: bool = False):
    """(run one step, the stand-in module, the executor's DeviceGraphs or None)."""
    import ctr
    import fake_cupy

    from runtime.exec.comm_ops import comm_handlers, seeded_fill
    from runtime.exec.device import to_host
    from runtime.exec.executor import Executor
    from runtime.exec.graphs import DeviceGraphs
    from runtime.ps import held_tables
    from runtime.ps.shard import Shard
    from runtime.trainer.mail import Item, Mail
    from transpiler import transpile
    from transpiler.passes.schedule import kept_outputs, segment_programs

    ctr.BATCH = batch
    plan = transpile(ctr.build().main)
    prog = plan.programs["gpu"]
    segs = segment_programs(prog)
    loss = next(n for n in prog.vars if n.startswith("mean") or n.startswith("reduce_mean"))
    outs = kept_outputs(segs, [loss])
    rng = np.random.default_rng(0)
    recvs = {op.attrs["tensor"]: prog.vars[op.attrs["tensor"]] for op in prog.ops if op.type == "recv"}
    host_in = {
        n: rng.uniform(0, 1, [batch if d == -1 else d for d in v.shape]).astype(v.dtype)
        for n, v in recvs.items()
    }
    dense = [t for t in plan.tables if t.kind == "dense"]
    shard = Shard(dense, mode="async")

    class Client:  # the one call HeldTables makes of a PSClient, answered by a Shard here
        specs = {t.name: t for t in dense}

        def hold(self, names):
            return {n: held_tables.hold(shard, n) for n in names}

    kept = held_tables.HeldTables(Client(), [t.name for t in dense], 0, False, xp=fake_cupy, graphs=graphs)

    class Held:  # the held tables' side of PSAccess: the device value, the step on the device
        def __init__(self):
            self.grads, self.t = {}, 0

        def pull_dense(self, it, table):
            return kept.pull(table, it.step)

        def push_dense(self, it, table, grad):
            self.grads[table] = grad

        def apply(self):
            kept.apply(self.grads, self.t)
            self.grads, self.t = {}, self.t + 1

    mail, held = Mail(fake_cupy), Held()
    handlers = {**comm_handlers(mail), **comm_handlers(held)}
    handlers["fill_constant"] = seeded_fill(fake_cupy, None, lambda it, v: v)
    exe = Executor(fake_cupy, handlers=handlers, graphs=DeviceGraphs(fake_cupy) if graphs else None)

    def step(t: int) -> None:
        it = Item(t, 0, 0, batch, batch)
        mail.deliver(it.key, dict(host_in))
        for seg, out in zip(segs, outs, strict=True):
            got = exe.run(seg, feed=None, fetch_list=out, return_numpy=False, scope=it.env, ctx=it)
            it.env.update(zip(out, got, strict=True))
            mail.to_host_all([value for *_, value in mail.take_outgoing()])
        to_host(it.env[loss])
        mail.forget(it.key)
        held.apply()
        if exe.graphs is not None:  # (the step is applied: its item's lane of graph buffers is free)
            exe.graphs.release(it.key)

    return step, fake_cupy, (exe.graphs, kept.graphed)


def measure(batch: int, steps: int, profile: bool = False, graphs: bool = False) -> dict[str, float]:
    """CPU ms per step of the gpu trainer's step on the stand-in (`cpu_ms`), of that the time inside
    its kernels (`kernel_ms`: numpy underneath, timed call by call, a graph's replay as a whole)
    and the difference, its host work (`host_ms`); `calls`: the kernels of one step (copies in and
    out of a graph's buffers included), `replays`: graph launches in all. `timer_ms`: of `host_ms`,
    the stand-in's own timer reads around each timed call (`timed` per step, each costing the host
    `timer_us`, calibrated in this run on an empty kernel): CPU that hetps on a GPU does not spend."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # (as in a trainer process)
        return _measure(batch, steps, profile, graphs)


def _measure(batch: int, steps: int, profile: bool, graphs: bool) -> dict[str, float]:
    step, fc, dg = setup(batch, graphs)
    for t in range(3):
        step(t)
    prof = cProfile.Profile() if profile else None
    fc.TIME_KERNELS, fc.KERNEL_S[0], fc.TIMED[0] = True, 0.0, 0
    cpu0 = time.process_time()
    if prof:
        prof.enable()
    for t in range(steps):
        step(3 + t)
    if prof:
        prof.disable()
    cpu_ms = 1e3 * (time.process_time() - cpu0) / steps
    fc.TIME_KERNELS, kernel_ms, timed = False, 1e3 * fc.KERNEL_S[0] / steps, fc.TIMED[0] / steps
    fc.RECORD = []
    step(3 + steps)
    calls, fc.RECORD = fc.RECORD, None
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    segs, held = dg
    for g in (segs, held):
        if g is not None and g.stats.refused:
            print(f"  (eager: {g.stats.refused})")
    replays = segs.stats.replays + held.stats.replays if segs is not None else 0
    timer_us = timer_cost_us(fc)
    return {
        "cpu_ms": cpu_ms,
        "kernel_ms": kernel_ms,
        "host_ms": cpu_ms - kernel_ms,
        "calls": len(calls),
        "replays": replays,
        "timed": timed,
        "timer_us": timer_us,
        "timer_ms": timed * timer_us / 1e3,
    }


def timer_cost_us(fc, n: int = 20000) -> float:
    """CPU us that timing one kernel call adds outside the timed span (charged to host work): an
    empty kernel run `n` times timed and untimed, the timed span taken out."""
    noop = int

    def loop() -> float:
        t0 = time.process_time()
        for _ in range(n):
            fc._run(noop, (), {})
        return time.process_time() - t0

    untimed = min(loop() for _ in range(3))
    fc.TIME_KERNELS, fc.KERNEL_S[0] = True, 0.0
    timed = loop()
    fc.TIME_KERNELS, inside = False, fc.KERNEL_S[0]
    return max(timed - inside - untimed, 0.0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, nargs="+", default=[512, 8])
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions (by own time)")
    args = ap.parse_args()
    for batch in args.batch:
        got = {g: measure(batch, args.steps, args.profile, g) for g in (False, True)}
        for g, m in got.items():
            print(
                f"batch {batch:>5}, {'graphs' if g else 'eager '}: {m['cpu_ms']:6.2f} CPU ms per step, of "
                f"which {m['kernel_ms']:6.2f} in its {m['calls']} kernels: host work {m['host_ms']:5.2f} "
                f"CPU ms per step (goal <= 1)" + (f"; {m['replays']} graph replays" if g else "")
            )
            less = m["host_ms"] - m["timer_ms"]
            print(
                f"{'':>11}of that the stand-in's timer reads {m['timer_ms']:5.3f} ({m['timed']:.0f} timed "
                f"calls x {m['timer_us']:.2f} us): host work less them {less:5.2f} CPU ms per step"
            )
        ratio = got[False]["host_ms"] / max(got[True]["host_ms"], 1e-9)
        print(f"batch {batch:>5}: host work eager / graphs = {ratio:.1f}x")
    print(f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
