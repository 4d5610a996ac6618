"""CTR training throughput: hetps heterogeneous (local engine, gpu emulated without CUDA) vs Paddle 3.3.1.

The model (docs/design.md): Wide&Deep, batch 512, 26 categorical slots hashed into one vocabulary of
100 000 ids, deep embedding dim 16 + wide (dim 1), 13 dense features, MLP 400-400-400, SGD.

In one run this measures, on the same 20 pre-generated synthetic batches (cycled):
1. the machine's bound: the MLP's forward + backward GEMMs alone with single-threaded BLAS, times
   the number of cores, as examples/s (what a perfect 2-core implementation could reach); and, to
   see what the cores give together, the same GEMMs run back to back by 1 and by `cores` processes;
2. PaddlePaddle 3.3.1, single process, legacy static IR (FLAGS_enable_pir_api=0), sparse embedding
   gradients, FLAGS_paddle_num_threads=2 (a subprocess, so its flags and threads are its own);
3. for reference, the untranspiled program in one process with hetps's own Executor (1 kernel
   thread; and with the hetps run's kernel threads, when it has more than 1);
4. hetps: the program transpiled by type (embeddings on cpu trainers, MLP on the emulated gpu
   trainer, tables on parameter-server shards), trained with `runtime.train` on the local engine,
   in each of `--modes` (async first: the best setting measured on this 2-core machine);
and prints examples/s, the ratios and where hetps's time goes (each trainer's time use, and the CPU
milliseconds every process spends per step). Each side trains `--warmup` steps, then is timed over
`--steps` steps. Also (issue 18), from the same run: the dense stage's ms per step (CPU; GPU when
there is a CUDA device), and per mode the lines `distribution tax: X.XX` (CPU ms per step of all
processes / the single process's), `cpu stage: N µs/example` (cpu trainers + shards) and `ceiling`
(examples/s with every core of this machine busy at that CPU per step: what no scheduling can pass),
and, for the first mode, a labelled prediction for a 16-core host with one accelerator.

    python benchmarks/ctr.py                       # the default, best setting for a 2-core machine
    python benchmarks/ctr.py --trainers cpu=2,gpu=1 --micro-batches 8 --modes sync --skip-paddle
    python benchmarks/ctr.py --stand-in --skip-paddle --steps 100   # the gpu trainer on tests/fake_cupy.py

Per mode it also prints the gpu trainer's host <-> device crossings per step (count and bytes each
way) and its host work: CPU ms per step besides its kernels. With `--stand-in` (no CUDA here) the
gpu trainer computes on the strict cupy stand-in of the tests, which counts every crossing and the
time inside its kernels (numpy underneath), both read over the timed steps; on a CUDA device the
crossings are hetps's own count (`runtime.exec.device.Crossings`, the run's total per step, the
held tables' one hold and final write-back included) and the host work is the trainer's whole CPU
time per step (its kernels run on the device).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# micro-batches per step when --micro-batches is not given, per mode (measured on the 2-core machine):
# an async reader keeps the next step's items in flight too, so one micro-batch (the MLP's GEMMs at
# the whole batch, one message each way per step) leaves the gpu trainer no idle time; in sync mode
# the reader reads and sorts step t+1 ahead and fuses its push with the next pull, so one micro-batch
# (the fewest messages and executor runs) is fastest too (quiet machine: 21 226 / 20 950 examples/s
# against 19 233 / 18 947 with 2 and 17 440-18 669 with 4).
BEST_MICRO_BATCHES = {"async": 1, "sync": 1}
# The gpu trainer's products over 2 threads (train(kernel_threads=...), ops_registry.parallel): the MLP
# uses the core that the cpu trainer and the shard leave idle (benchmarks/README.md, issue 18 round 6).
BEST_KERNEL_THREADS = "gpu=2"

REPO = Path(__file__).resolve().parents[1]
BATCH, SLOTS, VOCAB, DIM, DENSE, HIDDEN, LR = 512, 26, 100_000, 16, 13, (400, 400, 400), 0.01
NUM_BATCHES = 20
END_MARGIN = 20  # steps before the end of a run where its CPU times are taken (see `hetps`; at most
# half the timed steps)


def batches() -> list[dict[str, np.ndarray]]:
    from runtime.data import SyntheticCTR

    data = SyntheticCTR(vocab=VOCAB, num_slots=SLOTS, num_dense=DENSE, seed=0)
    return [data.batch(i, BATCH) for i in range(NUM_BATCHES)]


def _mlp_step(batch: int | None = None, xp=np):
    """A function running the MLP's forward + backward GEMMs once at `batch` examples (default
    `BATCH`; float32; numpy, or cupy)."""
    batch = batch or BATCH
    rng = np.random.default_rng(0)
    dims = [SLOTS * DIM + DENSE, *HIDDEN, 1]
    shapes = zip(dims, dims[1:], strict=False)
    ws = [xp.asarray(rng.normal(size=(a, b)).astype(np.float32)) for a, b in shapes]
    x = xp.asarray(rng.normal(size=(batch, dims[0])).astype(np.float32))

    def step() -> None:
        acts = [x]
        for w in ws:
            acts.append(acts[-1] @ w)
        g = xp.ones((batch, 1), np.float32)
        for i in reversed(range(len(ws))):
            _ = acts[i].T @ g  # weight gradient
            g = g @ ws[i].T  # input gradient (the first layer's feeds the embeddings)

    return step


def dense_stage_ms(repeats: int = 50, batch: int | None = None, stand_in: bool = False) -> dict[str, float]:
    """The dense stage's (the MLP's forward + backward at `batch` examples, default `BATCH`) median ms
    per step: "cpu", the CPU time of one BLAS thread (so time the core spent on others' processes
    does not count), and "gpu", the wall time on the CUDA device with a device sync, when there is
    one (cupy; not on the stand-in, whose kernels are numpy's)."""
    from threadpoolctl import threadpool_limits

    from runtime.exec.device import cuda_available, cupy_module

    def median_ms(step, clock, sync=lambda: None) -> float:
        step()
        sync()
        times = []
        for _ in range(repeats):
            t0 = clock()
            step()
            sync()
            times.append(clock() - t0)
        return 1e3 * float(np.median(times))

    with threadpool_limits(1):
        out = {"cpu": median_ms(_mlp_step(batch), time.process_time)}
    if cuda_available() and not stand_in:
        cupy = cupy_module()
        out["gpu"] = median_ms(_mlp_step(batch, cupy), time.perf_counter, cupy.cuda.Device().synchronize)
    return out


def bound(repeats: int = 30) -> float:
    """examples/s of the MLP's forward+backward GEMMs on one core (single-threaded BLAS) x cores,
    from the fastest of `repeats` timings (the least disturbed by other processes)."""
    from threadpoolctl import threadpool_limits

    step = _mlp_step()
    with threadpool_limits(1):
        step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return BATCH / min(times) * (os.cpu_count() or 1)


def _gemm_worker(seconds: float, out) -> None:
    from threadpoolctl import threadpool_limits

    step = _mlp_step()
    with threadpool_limits(1):
        step()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            n += 1
    out.put(n * BATCH / (time.perf_counter() - t0))


def parallel_gemms(processes: int, seconds: float = 4.0) -> float:
    """examples/s of the same GEMMs run back to back for `seconds` by `processes` processes at once
    (summed): what the cores really give together, disturbances included."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gemm_worker, args=(seconds, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    rates = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(rates)


def paddle_worker(steps: int, warmup: int) -> None:
    """Runs in a subprocess (flags must be set before paddle is imported); prints a JSON line."""
    os.environ["FLAGS_enable_pir_api"] = "0"
    import paddle
    import paddle.nn.functional as F

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("sparse", [-1, SLOTS], "int64")
        dense = paddle.static.data("dense", [-1, DENSE], "float32")
        label = paddle.static.data("label", [-1, 1], "float32")
        wide = paddle.static.nn.embedding(ids, size=[VOCAB, 1], is_sparse=True)
        # paddle.sum is broken in 3.3.1's legacy IR (docs/design.md): sum over slots = mean * slots
        wide = paddle.mean(paddle.reshape(wide, [-1, SLOTS]), axis=1, keepdim=True) * float(SLOTS)
        emb = paddle.static.nn.embedding(ids, size=[VOCAB, DIM], is_sparse=True)
        h = paddle.concat([paddle.reshape(emb, [-1, SLOTS * DIM]), dense], axis=1)
        for size in HIDDEN:
            h = paddle.static.nn.fc(h, size, activation="relu")
        logit = paddle.static.nn.fc(h, 1) + wide
        loss = paddle.mean(F.binary_cross_entropy_with_logits(logit, label, reduction="none"))
        paddle.optimizer.SGD(LR).minimize(loss)
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(startup)
    bs = batches()
    losses = []
    for i in range(warmup):
        exe.run(main, feed=bs[i % NUM_BATCHES], fetch_list=[loss])
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        (lv,) = exe.run(main, feed=bs[i % NUM_BATCHES], fetch_list=[loss])
        losses.append(float(lv))
    dt = time.perf_counter() - t0
    print(
        json.dumps({"examples_per_s": steps * BATCH / dt, "first_loss": losses[0], "last_loss": losses[-1]})
    )


def paddle(steps: int, warmup: int, threads: int) -> dict:
    env = {
        **os.environ,
        "FLAGS_paddle_num_threads": str(threads),
        "GLOG_minloglevel": "2",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--paddle-worker", "--steps", str(steps), "--warmup", str(warmup)]
        + ["--batch", str(BATCH)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the Paddle run failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def single_process(steps: int, warmup: int, kernel_threads: int = 1) -> tuple[float, float]:
    """(examples/s, CPU ms per step) of the untranspiled program in this process (hetps's Executor,
    one BLAS thread, its products over `kernel_threads` threads): the same kernels as the trainers,
    without any distribution."""
    from threadpoolctl import threadpool_limits

    from ops_registry import parallel
    from runtime import Executor

    model = build()
    bs = batches()
    exe = Executor()
    exe.run(model.startup)
    parallel.set_threads(kernel_threads)
    with threadpool_limits(1), contextlib.ExitStack() as undo:
        undo.callback(parallel.set_threads, 1)
        for i in range(warmup):
            exe.run(model.main, feed=bs[i % NUM_BATCHES])
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(warmup, warmup + steps):
            exe.run(model.main, feed=bs[i % NUM_BATCHES])
    return steps * BATCH / (time.perf_counter() - t0), 1e3 * (time.process_time() - c0) / steps


def build():
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    return wide_deep(
        num_slots=SLOTS, vocab=VOCAB, dim=DIM, num_dense=DENSE, hidden=HIDDEN, optimizer=nn.SGD(lr=LR)
    )


def steady_time_use(trace: Path, first: int, last: int) -> dict[str, dict[str, float]]:
    """Per trainer, the share of its wall time over steps `first`..`last` (from its first span of
    step `first` to the end of its last span of step `last`, in the run's Chrome trace) that it
    spent waiting for messages (`wait`) and for parameter-server pulls on its main lane (`ps`):
    start-up and the end of the run left out, which the whole run's `History.time_use` counts."""
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    lanes: dict[str, list[dict]] = {}
    for e in events:
        if e["ph"] == "X" and e["tid"] == 0 and names[e["pid"]].startswith("trainer "):
            lanes.setdefault(names[e["pid"]].split()[1], []).append(e)
    out = {}
    for name, spans in sorted(lanes.items()):
        timed = [
            e for e in spans if isinstance(e["args"].get("step"), int) and first <= e["args"]["step"] <= last
        ]
        t0, t1 = min(e["ts"] for e in timed), max(e["ts"] + e["dur"] for e in timed)

        def within(cond, spans=spans, t0=t0, t1=t1) -> float:
            return sum(max(0.0, min(e["ts"] + e["dur"], t1) - max(e["ts"], t0)) for e in spans if cond(e))

        out[name] = {
            "wait": within(lambda e: e["name"] == "wait") / (t1 - t0),
            "ps": within(lambda e: e["cat"] == "ps") / (t1 - t0),
        }
    return out


def _stand_in_counts() -> dict:
    """The stand-in's counts of each process using it, by pid (empty without `--stand-in`)."""
    folder = os.environ.get("HETPS_FAKE_CUPY_COUNTS")
    if not folder:
        return {}
    import fake_cupy

    return fake_cupy.read_counts(folder)


def hetps(
    steps: int,
    warmup: int,
    trainers: dict[str, int],
    micro_batches: int,
    mode: str,
    servers: int,
    dense_on_trainer: bool = True,
    kernel_threads: dict[str, int] | None = None,
):
    """Train the model; also returns each process's CPU ms per timed step, each trainer's waits over
    the timed steps (`steady_time_use`), with the stand-in each process's stand-in counts per timed
    step (crossings, bytes, kernel ms), and the cores other processes kept busy over the timed steps
    (the machine's busy CPU time less this run's processes' and the driver's, per wall second;
    steal time included; None with too few steps)."""
    from runtime import train
    from runtime.engines import LocalEngine
    from runtime.profile.load import machine_busy_s
    from runtime.profile.machine import cpu_seconds
    from transpiler import transpile

    plan = transpile(build().main)
    bs = batches()
    total = warmup + steps
    eng, marks = LocalEngine(), []

    # CPU times of every process when the driver records the end of warm-up and the step END_MARGIN
    # steps before the end (by the last steps a trainer may have exited: its /proc entry gone; one
    # that is gone is left out), with the time: the driver gets the trainers' step reports up to
    # runtime.transport.reports.EVERY_S late, so what the processes did between the marks is counted in steps
    # done between those times (from the steps' own times, History.time)
    def mark(record: dict) -> None:
        if record["step"] in (warmup - 1, total - 1 - min(END_MARGIN, steps // 2)):
            got = {"at": time.perf_counter(), "driver": time.process_time(), "machine": machine_busy_s()}
            counts = _stand_in_counts()
            for n, p in eng.pids().items():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    got[n] = cpu_seconds(p)
                if p in counts:
                    got[f"counts {n}"] = counts[p].__dict__
            marks.append(got)

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        hist = train(
            plan,
            bs,
            epochs=-(-total // NUM_BATCHES),
            steps=total,
            trainers=trainers,
            micro_batches=micro_batches,
            mode=mode,
            servers=servers,
            allow_emulation=True,
            engine=eng,
            callback=mark,
            trace=str(trace),
            dense_on_trainer=dense_on_trainer,
            kernel_threads=kernel_threads,
        )
        waits = steady_time_use(trace, warmup, total - 1) if steps > 1 else {}
    if len(marks) < 2:  # too few timed steps: nothing between the marks
        return hist, {}, waits, {}, None
    wall = marks[1]["at"] - marks[0]["at"]
    done = [hist.steps_done(m.pop("at")) for m in marks]
    n = done[1] - done[0]
    if n < 1:  # both marks heard after the run's last step: nothing between them
        return hist, {}, waits, {}, None
    counts = {
        k.split()[1]: {f: (marks[1][k][f] - v) / n for f, v in marks[0][k].items()}
        for k in [k for k in marks[0] if k.startswith("counts ") and k in marks[1]]
    }
    cpu_ms = {k: 1e3 * (marks[1][k] - marks[0][k]) / n for k in marks[0] if k in marks[1] and k in eng.pids()}
    if not any(cpu_ms.values()):  # (likewise: the marks were taken after the processes' last step)
        return hist, {}, waits, {}, None
    ours = sum(
        marks[1][k] - marks[0][k] for k in marks[0] if k in marks[1] and (k in eng.pids() or k == "driver")
    )
    others = max(marks[1]["machine"] - marks[0]["machine"] - ours, 0.0) / wall if wall > 0 else None
    return hist, cpu_ms, waits, counts, others


def device_lines(
    hist, cpu_ms: dict, counts: dict, kernel_ms: float | None
) -> tuple[list[str], dict[str, float]]:
    """Lines on the gpu trainer's crossings and host work per step, and those figures (`kernel_ms`:
    the stand-in's kernels' CPU ms per step, `gpu_host_work.measure`, None on a CUDA device)."""
    lines, figs = [], {}
    for name, st in hist.trainers.items():
        if "h2d" not in st:  # (not a device trainer)
            continue
        c = counts.get(name)
        if c is not None:  # the stand-in, over the timed steps
            per, where = c, "timed steps, counted by the stand-in"
            figs[f"{name} host ms"] = host = cpu_ms.get(name, float("nan")) - kernel_ms
            work = f"{host:.2f} CPU ms per step besides its kernels ({kernel_ms:.2f} ms, gpu_host_work.py)"
        else:  # hetps's own count over the whole run; the kernels ran on the device
            per, where = (
                {k: st[k] / max(hist.steps, 1) for k in ("h2d", "h2d_bytes", "d2h", "d2h_bytes")},
                ("the run's total per step, the held tables' hold and last write-back included"),
            )
            figs[f"{name} host ms"] = host = cpu_ms.get(name, float("nan"))
            work = f"{host:.2f} CPU ms per step (its whole CPU time: kernels run on the device)"
        figs.update({f"{name} {k}": per[k] for k in ("h2d", "h2d_bytes", "d2h", "d2h_bytes")})
        lines.append(
            f"  {name} crossings per step ({where}): host->device {per['h2d']:.1f} copies, "
            f"{per['h2d_bytes'] / 1e3:.1f} kB; device->host {per['d2h']:.1f} copies, "
            f"{per['d2h_bytes'] / 1e3:.1f} kB"
        )
        lines.append(f"  {name} host work: {work}; goal <= 1 at batch 512")
        if "graph_replays" in st:  # (runtime.exec.graphs: RunConfig.device_graphs)
            n = max(hist.steps, 1)
            lines.append(
                f"  {name} device graphs: {st['graph_replays'] / n:.1f} segment replays and "
                f"{st.get('held_graph_replays', 0) / n:.1f} held-table step replays per step, "
                f"{st['graph_eager_runs']} eager runs (warm-up, fallbacks), {st['graphs_captured']} captured"
            )
    return lines, figs


@dataclass(frozen=True)
class Costs:
    """One distributed run's CPU costs per step, by role, against the single process's."""

    cpu_ms: dict[str, float]  # CPU ms per step of each process (name as the engine gives it)
    single_ms: float  # CPU ms per step of the untranspiled program in one process
    gemm_ms: float  # the MLP's forward + backward GEMMs alone on one core, ms per step

    def role_ms(self, role: str) -> float:
        """CPU ms per step of all processes of `role` (cpu, gpu, ps, driver) together."""
        return sum(ms for name, ms in self.cpu_ms.items() if name.split(":")[0] == role)

    @property
    def tax(self) -> float:
        """CPU ms per step of all processes / the single process's CPU ms per step."""
        return sum(self.cpu_ms.values()) / self.single_ms

    def ceiling(self, cores: int) -> float:
        """examples/s with all `cores` busy at this CPU per step: no run of these processes on this
        machine can be faster, whatever its scheduling (a ceiling measured, not a prediction)."""
        return cores * 1e3 * BATCH / sum(self.cpu_ms.values())

    @property
    def cpu_stage_us(self) -> float:
        """CPU µs per example of the cpu trainers and the parameter-server shards."""
        return 1e3 * (self.role_ms("cpu") + self.role_ms("ps")) / BATCH


def predict(c: Costs, cores: int = 16, device_ms: float = 1.0, measured: bool = False) -> list[str]:
    """Lines of a prediction (a model, not a measurement) for `cores` cores feeding one accelerator
    whose dense stage takes `device_ms` per step (`measured` on this machine's GPU, else assumed),
    from the per-role CPU costs of this run."""
    host_ms = max(c.role_ms("gpu") - c.gemm_ms, 0.0)  # the gpu trainer's CPU work besides its GEMMs
    feeder_ms = c.role_ms("cpu") + c.role_ms("ps")  # cpu trainers + shards, CPU ms per step
    gpu_cap = 1e3 * BATCH / max(host_ms, device_ms)
    lines = [
        f"prediction for a {cores}-core host with one accelerator (a MODEL, not a measurement): "
        f"{'the dense stage took' if measured else 'assumes the dense stage takes'} {device_ms:.2f} ms "
        f"per step on the device{' here, and assumes' if measured else ','} the gpu trainer "
        f"keeps its measured CPU work besides the GEMMs ({host_ms:.1f} ms per step) on one core, "
        f"the driver and readers cost nothing, and the cpu trainers + shards "
        f"({feeder_ms:.1f} CPU ms per step here) scale linearly over the other cores "
        "(no memory-bandwidth contention, no extra cost per peer)"
    ]
    for n in sorted({1, 2, 4, 8, cores - 1}):
        feed = 1e3 * BATCH * n / feeder_ms if feeder_ms else float("inf")
        rate, limit = min((feed, f"{n} feeding core(s)"), (gpu_cap, "the gpu trainer"))
        lines.append(
            f"  {n:2d} core(s) of cpu trainers + shards: {rate:10,.0f} examples/s (limited by {limit})"
        )
    return lines


def parse_trainers(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def main(argv: list[str] | None = None) -> dict:
    global BATCH
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=BATCH, help="examples per step (the model's batch)")
    ap.add_argument("--steps", type=int, default=400, help="timed steps (after warm-up)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--trainers", type=parse_trainers, default=parse_trainers("cpu=1,gpu=1"))
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help=f"micro-batches per step (default per mode, the best measured here: {BEST_MICRO_BATCHES})",
    )
    ap.add_argument("--modes", default="async,sync", help="hetps modes to measure, the best first")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument(
        "--kernel-threads",
        type=parse_trainers,
        default=parse_trainers(BEST_KERNEL_THREADS),
        help=f"threads per trainer type for the large products (train(kernel_threads=...)); default "
        f"{BEST_KERNEL_THREADS}, the best measured here; gpu=1: every product on the trainer's own thread",
    )
    ap.add_argument("--paddle-threads", type=int, default=2)
    ap.add_argument("--skip-paddle", action="store_true")
    ap.add_argument(
        "--dense-on-servers",
        action="store_true",
        help="pull and push the MLP's tables through the servers every step (train(dense_on_trainer=False))",
    )
    ap.add_argument("--rounds", type=int, default=1, help="alternate Paddle and hetps this many times")
    ap.add_argument(
        "--stand-in",
        action="store_true",
        help="run the gpu trainer on the tests' strict cupy stand-in (tests/fake_cupy.py; no CUDA needed): "
        "crossings and host work per step counted",
    )
    ap.add_argument("--paddle-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    BATCH = args.batch
    if args.paddle_worker:
        paddle_worker(args.steps, args.warmup)
        return {}
    sys.path.insert(0, str(REPO))
    import logging

    logging.getLogger("hetps.device").setLevel(logging.ERROR)  # the emulation is stated below
    if args.stand_in:  # (trainer processes inherit the variables and the path to tests/)
        sys.path.insert(0, str(REPO / "tests"))
        os.environ["HETPS_FAKE_CUPY"] = "fake_cupy"
        os.environ["HETPS_FAKE_CUPY_COUNTS"] = counts = tempfile.mkdtemp(prefix="hetps-fake-cupy-")
        atexit.register(shutil.rmtree, counts, ignore_errors=True)
        args.kernel_threads = {**args.kernel_threads, "gpu": 1}  # (the stand-in's kernels: one thread)

    print(
        f"CTR benchmark: batch {BATCH}, {SLOTS} slots x vocab {VOCAB} x dim {DIM} + wide, {DENSE} dense, "
        f"MLP {'-'.join(map(str, HIDDEN))}, SGD; {args.warmup} warm-up + {args.steps} timed steps; "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    )
    out: dict = {"bound": bound(repeats=max(3, 30 * 512 // BATCH))}  # ~the same seconds at any batch
    print(f"bound (MLP GEMMs, 1 BLAS thread x {os.cpu_count()} cores):  {out['bound']:8,.0f} examples/s")
    cores = os.cpu_count() or 1
    one, out["parallel"] = parallel_gemms(1), parallel_gemms(cores)
    print(
        f"  the same GEMMs back to back for 4 s: 1 process {one:,.0f} examples/s, {cores} processes at "
        f"once {out['parallel']:,.0f} in all ({out['parallel'] / one:.2f}x one)"
    )
    from runtime.exec.device import cuda_available

    gpu_kind = "gpu on CUDA (cupy)" if cuda_available() else "gpu EMULATED on cpu"
    if args.stand_in:
        gpu_kind = "gpu on the cupy STAND-IN (tests/fake_cupy.py: numpy kernels, crossings counted)"
    stage = out["dense_stage_ms"] = dense_stage_ms(stand_in=args.stand_in)
    kernels_ms = None
    if args.stand_in:  # the gpu trainer's step alone, in this process (benchmarks/gpu_host_work.py)
        import gpu_host_work

        ref = gpu_host_work.measure(BATCH, steps=10, graphs=True)  # (as the trainers run: device graphs)
        kernels_ms = ref["kernel_ms"]
        print(
            f"gpu trainer's step alone on the stand-in (gpu_host_work.py, device graphs): "
            f"{ref['cpu_ms']:.2f} CPU ms, {ref['calls']} kernels taking {kernels_ms:.2f}: host work "
            f"{ref['host_ms']:.2f} CPU ms per step (no messages)"
        )
    line = (
        f"dense stage (the MLP's forward + backward, batch {BATCH}): cpu {stage['cpu']:.2f} CPU ms per step "
        "(1 BLAS thread)"
    )
    if "gpu" in stage:
        line += f", gpu {stage['gpu']:.2f} ms per step (CUDA): {stage['cpu'] / stage['gpu']:.1f}x faster"
    else:
        line += "; no CUDA device here: no gpu figure"
    print(line)
    gemm_ms = stage["cpu"]
    modes = args.modes.split(",")
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        got: dict[str, float] = {}
        rounds.append(got)
        if args.rounds > 1:
            print(f"-- round {r + 1} of {args.rounds} (Paddle and hetps alternate, so both see similar load)")
        if not args.skip_paddle:
            pd = paddle(args.steps, args.warmup, args.paddle_threads)
            got["paddle"] = pd["examples_per_s"]
            print(
                f"PaddlePaddle 3.3.1 legacy IR, {args.paddle_threads} threads:  {got['paddle']:8,.0f} "
                f"examples/s (loss {pd['first_loss']:.4f} -> {pd['last_loss']:.4f}; load average "
                f"{os.getloadavg()[0]:.1f})"
            )
        # the reference of the tax and of "x one process", measured in each round like the others
        got["single"], single_ms = single_process(args.steps, args.warmup)
        out["single"] = got["single"]
        print(
            f"hetps single process (no distribution, 1 BLAS thread):  {got['single']:8,.0f} examples/s, "
            f"{single_ms:.1f} CPU ms per step"
        )
        # the same kernels as the run's gpu trainer (its products over k threads): the reference of
        # the distribution tax, so that the tax counts what distribution costs, not what threads cost
        k = max(args.kernel_threads.values(), default=1)
        ref_ms = single_ms
        if k > 1:
            got["single_k"], ref_ms = single_process(args.steps, args.warmup, k)
            print(
                f"hetps single process, its products over {k} kernel threads:  {got['single_k']:8,.0f} "
                f"examples/s, {ref_ms:.1f} CPU ms per step"
            )
        for mode in modes:
            mbs = args.micro_batches or BEST_MICRO_BATCHES[mode]
            held = "dense tables through the servers" if args.dense_on_servers else "dense tables held"
            if args.trainers.get("gpu", 1) > 1:
                held = "dense tables through the servers (more than one gpu trainer)"
            setting = (
                f"{mode}, trainers {args.trainers}, {mbs} micro-batches, {args.servers} server(s), "
                f"{gpu_kind}, {held}, kernel threads {args.kernel_threads}"
            )
            hist, cpu_ms, waits, counts, _ = hetps(
                args.steps,
                args.warmup,
                args.trainers,
                mbs,
                mode,
                args.servers,
                not args.dense_on_servers,
                args.kernel_threads,
            )
            rate = got[mode] = hist.examples_per_s(skip=args.warmup)
            ratio = f"{rate / got['paddle']:.2f}x Paddle, " if "paddle" in got else ""
            ratio += f"{rate / got['single']:.2f}x one process, "
            if "single_k" in got:
                ratio += f"{rate / got['single_k']:.2f}x one process on {k} kernel threads, "
            print(
                f"hetps {mode:>5}:  {rate:8,.0f} examples/s = {ratio}{100 * rate / out['bound']:.0f}% of "
                f"the bound  [{setting}; loss {np.mean(hist.loss[:10]):.4f} -> "
                f"{np.mean(hist.loss[-10:]):.4f}, start-up {hist.startup_s:.1f} s, load average "
                f"{os.getloadavg()[0]:.1f}]"
            )
            print(
                "  where the time goes (share of each trainer's wall time over the whole run, start-up and "
                "end included; cpu = CPU time it got):"
            )
            print("  " + hist.time_use().replace("\n", "\n  "))
            print(
                "  over the timed steps (from the run's trace): "
                + "; ".join(
                    f"{n} waits {100 * w['wait']:.1f}% for messages, {100 * w['ps']:.1f}% for PS calls"
                    for n, w in waits.items()
                )
            )
            for n, w in waits.items():
                got[f"{n} waits % {mode}"] = 100 * (w["wait"] + w["ps"])
            if mode == "sync" and waits:
                gpu_wait = max(100 * (w["wait"] + w["ps"]) for n, w in waits.items() if n.startswith("gpu"))
                print(f"  sync: the gpu trainer waits {gpu_wait:.1f}% of the timed steps (goal <= 10)")
            if not cpu_ms:
                print(
                    f"  no per-step CPU figures: {args.steps} timed steps ended before the driver heard of "
                    "them (step reports reach it up to 0.1 s late); give --steps 40 or more for them"
                )
                out[f"trainers_{mode}"] = hist.trainers
                continue
            print(
                "  CPU ms per step: "
                + ", ".join(f"{n} {ms:.1f}" for n, ms in cpu_ms.items())
                + f"; total {sum(cpu_ms.values()):.1f} (the MLP's GEMMs alone: {gemm_ms:.1f} CPU ms "
                "on one core)"
            )
            dev_lines, figs = device_lines(hist, cpu_ms, counts, kernels_ms)
            print("\n".join(dev_lines)) if dev_lines else None
            got.update({f"{k} {mode}": v for k, v in figs.items()})
            costs = out[f"costs_{mode}"] = Costs(cpu_ms, ref_ms, gemm_ms)
            got[f"tax {mode}"], got[f"stage {mode}"] = costs.tax, costs.cpu_stage_us
            same = also = ""
            if k > 1:
                same = f" with the same {k} kernel threads"
                total = sum(cpu_ms.values())
                also = f"; against the 1-thread single process {single_ms:.1f}: {total / single_ms:.2f}"
            print(
                f"  distribution tax: {costs.tax:.2f}  (CPU ms per step of all processes "
                f"{sum(cpu_ms.values()):.1f} / single process{same} {ref_ms:.1f}{also}; goal <= 1.25)"
            )
            print(
                f"  cpu stage: {costs.cpu_stage_us:.1f} µs/example  (cpu trainers + shards, CPU time "
                "per example; goal <= 10)"
            )
            cores = os.cpu_count() or 1
            top = costs.ceiling(cores)
            got[f"ceiling x one process {mode}"] = top / got["single"]
            vs = f", {top / got['paddle']:.2f}x Paddle" if "paddle" in got else ""
            print(
                f"  ceiling: {top:,.0f} examples/s = {top / got['single']:.2f}x one process{vs}  (all "
                f"{cores} cores busy at this CPU per step; this run used {100 * rate / top:.0f}% of it)"
            )
            if r == args.rounds - 1 and mode == modes[0]:
                print(
                    "  "
                    + "\n  ".join(predict(costs, device_ms=stage.get("gpu", 1.0), measured="gpu" in stage))
                )
            out[f"trainers_{mode}"] = hist.trainers
    out["rounds"] = rounds
    if args.rounds > 1:
        print(f"-- medians over {args.rounds} rounds")
        for key in [k for k in ("paddle", "single", "single_k", *modes) if k in rounds[0]]:
            rates = [r[key] for r in rounds]
            line = (
                f"{key:>6}: {float(np.median(rates)):8,.0f} examples/s "
                f"(range {min(rates):,.0f} - {max(rates):,.0f})"
            )
            for ref in ("paddle", "single"):
                if key not in ("paddle", "single", "single_k") and ref in rounds[0]:
                    ratios = [r[key] / r[ref] for r in rounds]
                    line += (
                        f"; x {'Paddle' if ref == 'paddle' else 'one process'} of its round: median "
                        f"{float(np.median(ratios)):.2f} (range {min(ratios):.2f} - {max(ratios):.2f})"
                    )
            print(line)
        for key in [k for k in rounds[0] if k.startswith(("tax ", "stage ", "gpu", "ceiling "))]:
            vals = [r[key] for r in rounds]
            print(f"{key:>12}: median {float(np.median(vals)):.2f} (range {min(vals):.2f} - {max(vals):.2f})")
    print("(bar: 1.5x Paddle; goal: 3x Paddle and 50% of the bound)")
    return out


if __name__ == "__main__":
    main()
