"""The gpu trainer's own host work per step for the CTR model's dense stage, on the cupy stand-in.

Runs the gpu trainer's sub-program of `benchmarks/ctr.py`'s model (the MLP 400-400-400 and its
loss, batch 512, one micro-batch) in this process, step after step, as a trainer runs it: its
segments through the Executor with the trainer's handlers (`Mail` with its copy stream for the
received and sent tensors, the held tables' pull and step on the device), on `tests/fake_cupy.py`.
CPU time per step minus the time inside the stand-in's kernels (numpy underneath) is the host work
the same code does on a GPU: op dispatch, copies' bookkeeping, the optimizer's per-table calls.
Messages (ZeroMQ, shared memory) are not in it: `ctr.py --stand-in` reports the whole trainer.

    python benchmarks/gpu_host_work.py [--steps 50] [--profile]
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


def setup(batch: int):
    """(run one step, the stand-in module)."""
    import ctr
    import fake_cupy

    from runtime.exec.comm_ops import comm_handlers, seeded_fill
    from runtime.exec.device import to_host
    from runtime.exec.executor import Executor
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

    kept = held_tables.HeldTables(Client(), [t.name for t in dense], 0, False, xp=fake_cupy)

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
    exe = Executor(fake_cupy, handlers=handlers)

    def step(t: int) -> None:
        it = Item(t, 0, 0, batch, batch)
        mail.deliver(it.key, dict(host_in))
        for seg, out in zip(segs, outs, strict=True):
            got = exe.run(seg, feed=None, fetch_list=out, return_numpy=False, scope=it.env, ctx=it)
            it.env.update(zip(out, got, strict=True))
            for _, _, value in mail.take_outgoing():
                mail.to_host(value)
        to_host(it.env[loss])
        mail.forget(it.key)
        held.apply()

    return step, fake_cupy


def measure(batch: int, steps: int, profile: bool = False) -> dict[str, float]:
    """CPU ms per step of the gpu trainer's step on the stand-in (`cpu_ms`), of its kernels alone
    (`kernel_ms`: one step's kernel calls recorded, then replayed back to back) and the difference,
    its host work (`host_ms`)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # (as in a trainer process)
        return _measure(batch, steps, profile)


def _measure(batch: int, steps: int, profile: bool) -> dict[str, float]:
    step, fc = setup(batch)
    for t in range(3):
        step(t)
    prof = cProfile.Profile() if profile else None
    cpu0 = time.process_time()
    if prof:
        prof.enable()
    for t in range(steps):
        step(3 + t)
    if prof:
        prof.disable()
    cpu_ms = 1e3 * (time.process_time() - cpu0) / steps
    fc.RECORD = []
    step(3 + steps)
    calls, fc.RECORD = fc.RECORD, None
    kernel_ms = 1e3 * fc.replay(calls, steps) / steps
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return {"cpu_ms": cpu_ms, "kernel_ms": kernel_ms, "host_ms": cpu_ms - kernel_ms, "calls": len(calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions (by own time)")
    args = ap.parse_args()
    got = measure(args.batch, args.steps, args.profile)
    print(
        f"gpu trainer dense stage, batch {args.batch}, stand-in: {got['cpu_ms']:.2f} CPU ms per step, of "
        f"which {got['kernel_ms']:.2f} in its {got['calls']} kernels: host work {got['host_ms']:.2f} "
        "CPU ms per step "
        f"(goal <= 1); load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
