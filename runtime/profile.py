"""Measure what the cost model (transpiler/cost.py) needs, on this machine, and cache it.

- kernels: every kernel op of a plan's sub-programs, on each trainer kind (cpu: numpy; gpu: cupy on a
  CUDA device, else numpy, marked *emulated*), at two micro-batch sizes, fitted as
  fixed + per example; recv / pull ops are fed random values of their declared shapes, sends and
  pushes do nothing, so only the kernels are timed (the fastest of a few repeats; numpy kernels by
  the thread's CPU time, so other processes taking the cores do not inflate them);
- the link: ZeroMQ messages (the trainers' own encoding) of two sizes, fitted as latency + per byte;
- the parameter server: a real shard process, dense pulls / pushes of two sizes and sparse row
  pulls / pushes of two row widths, fitted as per request + per byte (+ per row for sparse rows);
- the runtime's own overhead: short training runs of a small Wide&Deep (1 and 8 micro-batches,
  sync and async, seconds): each process's CPU per step beyond what the parts above explain, fitted
  per item and per step, per mode.

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

from transpiler.config import KINDS, TranspileConfig
from transpiler.cost import RunSettings
from transpiler.cost_profile import KernelCost, LinkCost, Overhead, Profile, PSCost, kernel_ops, op_signature
from transpiler.ir import Program
from transpiler.plan import Plan, transpile
from transpiler.tune import Budget, TuneResult
from transpiler.tune import tune as _tune

from .channels import Inbox, Outbox, pack_tensors
from .device import cuda_available
from .executor import Executor

SIZES = (32, 256)


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
        import cupy

        gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    text = f"{platform.node()}|{cpu}|{os.cpu_count()}|{gpu}"
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", platform.node())[:40] or "host"
    return f"{host}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"


# -- kernels ---------------------------------------------------------------------------------------
def _xp(kind: str) -> tuple[Any, bool]:
    """(array module, emulated) for a trainer kind."""
    if kind == "gpu" and cuda_available():
        import cupy

        return cupy, False
    return np, kind == "gpu"


def _sync(xp: Any) -> None:
    if xp is not np:
        xp.cuda.Device().synchronize()


def _stubs(xp: Any, state: dict[str, int], rng: np.random.Generator) -> dict[str, Callable]:
    """Executor handlers standing in for comm and PS ops: random values of the declared shapes."""

    def shape(s) -> tuple[int, ...]:
        return tuple(state["m"] if d == -1 else d for d in s)

    def recv(op, values, ctx):
        a = op.attrs
        values[op.outputs["Out"][0]] = xp.asarray(rng.standard_normal(shape(a["shape"])).astype(a["dtype"]))

    def pull_dense(op, values, ctx):
        a = op.attrs
        values[op.outputs["Out"][0]] = xp.asarray(
            0.01 * rng.standard_normal(tuple(a["shape"])).astype(a["dtype"])
        )

    def pull_sparse(op, values, ctx):
        n = int(values[op.inputs["Ids"][0]].shape[0])
        values[op.outputs["Out"][0]] = xp.asarray(
            0.01 * rng.standard_normal((n, op.attrs["dim"])).astype(op.attrs.get("dtype", "float32"))
        )

    def nothing(op, values, ctx):
        return None

    return {
        "recv": recv,
        "pull_dense": pull_dense,
        "pull_sparse": pull_sparse,
        "send": nothing,
        "push_dense": nothing,
        "push_sparse": nothing,
    }


def _feed(prog: Program, m: int, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for op in prog.ops:
        if op.type != "data":
            continue
        name = op.outputs["Out"][0]
        var = prog.global_block().vars[name]
        shape = tuple(m if d == -1 else d for d in var.shape)
        if np.dtype(var.dtype).kind in "iu":
            out[name] = rng.integers(0, vocab, shape).astype(var.dtype)
        else:
            out[name] = (
                rng.integers(0, 2, shape).astype(var.dtype)
                if "label" in name
                else rng.standard_normal(shape).astype(var.dtype)
            )
    return out


def profile_kernels(
    plan: Plan,
    kinds: tuple[str, ...] = KINDS,
    sizes: tuple[int, int] = SIZES,
    repeats: int = 5,
    skip: set[str] | None = None,
) -> tuple[dict[str, dict[str, KernelCost]], list[str]]:
    """Time every kernel op of `plan` on each kind at `sizes` examples per micro-batch; returns
    ({kind: {signature: KernelCost}}, kinds that were emulated). Signatures in `skip` ("kind/sig")
    are not measured again."""
    from threadpoolctl import threadpool_limits

    skip = skip or set()
    vocab = min([t["shape"][0] for t in plan.tables if t["kind"] == "sparse"] or [1000])
    out: dict[str, dict[str, KernelCost]] = {}
    emulated = []
    for kind in kinds:
        xp, emu = _xp(kind)
        if emu:
            emulated.append(kind)
        times: dict[str, dict[int, float]] = {}
        for prog in plan.programs.values():
            want = {op.id: op_signature(op, prog) for op in kernel_ops(prog)}
            if all(f"{kind}/{s}" in skip for s in want.values()):
                continue
            rng, state = np.random.default_rng(0), {"m": sizes[0]}
            exe = Executor(xp, handlers=_stubs(xp, state, rng))
            compiled = exe._compile(prog)  # noqa: SLF001 - wrap each kernel with a timer
            for step in compiled.steps:
                if step.op.id in want:
                    step.kernel = _timed(step.kernel, want[step.op.id], times, state, xp)
            with threadpool_limits(1):  # as a trainer runs (one BLAS thread per process)
                for m in sizes:
                    state["m"] = m
                    for _ in range(repeats + 1):  # the first run warms caches and is not kept
                        state["keep"] = _ > 0
                        exe.run(prog, feed=_feed(prog, m, vocab, rng))
        out[kind] = {sig: _fit(t, sizes) for sig, t in times.items()}
    return out, emulated


def _timed(kernel: Callable, sig: str, times: dict, state: dict, xp: Any) -> Callable:
    """The kernel, timed: CPU time of this thread for numpy kernels (one BLAS thread), so other
    processes taking the cores do not inflate it; wall time to the device's completion for cupy."""
    clock = time.thread_time if xp is np else time.perf_counter

    def run(x, ins, attrs):
        t0 = clock()
        res = kernel(x, ins, attrs)
        _sync(xp)
        dt = clock() - t0
        if state.get("keep"):
            best = times.setdefault(sig, {})
            best[state["m"]] = min(best.get(state["m"], dt), dt)
        return res

    return run


def _fit(t: dict[int, float], sizes: tuple[int, int]) -> KernelCost:
    a, b = sizes
    per = max((t[b] - t[a]) / (b - a), 0.0)
    return KernelCost(max(t[a] - per * a, 0.0), per)


# -- link and parameter server --------------------------------------------------------------------
def measure_link(sizes: tuple[int, int] = (1024, 1 << 20), count: int = 50) -> LinkCost:
    """One ZeroMQ message (ipc, the trainers' encoding), sent and received: latency + per byte."""
    tmp = tempfile.mkdtemp(prefix="hetps-profile-")
    inbox = Inbox(f"ipc://{tmp}/link")
    out = Outbox()
    got = {}
    try:
        for n in sizes:
            arr = np.zeros(n // 4, np.float32)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for i in range(count):
                    descs, arrays = pack_tensors([("x", arr)])
                    out.send(inbox.endpoint, {"k": "t", "s": i, "o": 0, "m": 0, "v": descs}, arrays)
                    if inbox.recv(5000) is None:
                        raise RuntimeError("the link probe's message did not arrive within 5 s")
                best = min(best, (time.perf_counter() - t0) / count)
            got[n] = best
    finally:
        out.close()
        inbox.close()
        for f in Path(tmp).iterdir():
            f.unlink()
        os.rmdir(tmp)
    a, b = sizes
    per = max((got[b] - got[a]) / (b - a), 0.0)
    return LinkCost(max(got[a] - per * a, 1e-7), per)


def _table(name: str, kind: str, shape: list[int]) -> dict[str, Any]:
    """A table spec for the probe shard: zeros, SGD with lr 0 (the probes leave values unchanged)."""
    by = (
        {"by": "table", "shard": 0, "num_shards": 1}
        if kind == "dense"
        else {"by": "id_hash", "num_shards": 1}
    )
    return {
        "name": name,
        "kind": kind,
        "shape": shape,
        "dtype": "float32",
        "initializer": {"type": "constant", "value": 0.0},
        "optimizer": {"type": "sgd", "lr": 0.0, "state": {}},
        "sharding": by,
    }


def measure_ps(count: int = 20) -> PSCost:
    """Round trips to a real shard: a tiny dense pull (per request), eight tiny tables in one pull
    (per table in a request), a 4 MB dense pull + push (per byte), 8192 sparse rows of dim 16 and of
    dim 1 pulled + pushed (per byte and per row)."""
    from .ps import PSClient
    from .ps.server import Servers

    specs = [
        _table("big", "dense", [1024, 1024]),
        _table("rows", "sparse", [100_000, 16]),
        _table("rows1", "sparse", [100_000, 1]),
        *(_table(f"t{i}", "dense", [4]) for i in range(8)),
    ]
    ids = np.unique(np.random.default_rng(0).integers(0, 100_000, 9000))[:8192]
    grad, grad1 = np.zeros((len(ids), 16), np.float32), np.zeros((len(ids), 1), np.float32)
    with (
        Servers(specs, 1, mode="async") as servers,
        PSClient(servers.endpoints, secret=servers.secret) as client,
    ):

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(count):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        tiny = best(lambda: client.pull("t0"))
        eight = best(lambda: client.pull_many([(f"t{i}", None) for i in range(8)]))
        big = best(lambda: client.push("big", client.pull("big")))
        rows = best(lambda: (client.pull("rows", ids), client.push("rows", grad, ids)))
        rows1 = best(lambda: (client.pull("rows1", ids), client.push("rows1", grad1, ids)))
    part = max(eight - tiny, 0.0) / 7
    lookup = _lookup_cost()
    n = 2 * len(ids)  # rows moved (pull + push)
    byte_s = max(rows - rows1, 0.0) / (n * (grad.itemsize * 15))
    row_s = max(rows1 - 2 * tiny - n * grad1.itemsize * byte_s, 0.0) / n
    big_byte_s = max(big - 2 * tiny, 0.0) / (2 * 4 * 1024 * 1024)
    return PSCost(max(tiny - part, 0.0), big_byte_s, byte_s, row_s, lookup, part)


def _lookup_cost(n: int = 13_312, dim: int = 8, repeats: int = 5) -> float:
    """A reader's own work per id looked up in one table, as the trainer does it: the pulled rows
    gathered by position in the step's unique ids, and the rows' gradients merged for the push."""
    from ops_registry import SparseRows

    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.2, n), 10**6).astype(np.int64)
    union = np.unique(ids)
    rows = rng.standard_normal((len(union), dim)).astype(np.float32)
    grads = rng.standard_normal((n, dim)).astype(np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        rows.take(np.searchsorted(union, ids), axis=0)
        SparseRows(ids, grads, 10**6).merged(np)
        best = min(best, time.perf_counter() - t0)
    return best / n


# -- the runtime's own overhead -------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_per_step(
    plan: Plan, data: Any, mode: str, micro_batches: int, steps: int, warmup: int
) -> dict[str, float]:
    """CPU seconds per step of every process of a short run (cpu=1, gpu=1, one shard)."""
    from .engines import LocalEngine
    from .train import train

    eng, marks = LocalEngine(), []

    def mark(record: dict) -> None:
        if record["step"] in (warmup - 1, warmup + steps - 1):
            marks.append(
                {**{n: cpu_seconds(p) for n, p in eng.pids().items() if p}, "driver": time.process_time()}
            )

    train(
        plan,
        data,
        steps=warmup + steps,
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
    return {n: (marks[1][n] - marks[0][n]) / steps for n in marks[0]}


def measure_overhead(link: LinkCost, ps: PSCost, steps: int = 40, warmup: int = 5) -> dict[str, Overhead]:
    """Calibrate the runtime's own work in each PS mode: two short runs of a small Wide&Deep (1 and
    8 micro-batches) measure each process's CPU per step; what the model does not explain
    (kernels, messages, PS calls) is fitted as per item + per step for the reader and the other
    trainer, per trainer for the shard, per item + per step for the driver."""
    import logging

    from transpiler import builder
    from transpiler.cost import PlanCost
    from transpiler.models import wide_deep

    from .data import SyntheticCTR

    logging.getLogger("hetps.device").setLevel(logging.ERROR)  # the calibration emulates its gpu
    model = wide_deep(num_slots=8, vocab=1000, dim=8, hidden=(64,), optimizer=builder.SGD(lr=0.01))
    plan = transpile(model.main)
    kernels, emulated = profile_kernels(plan)
    cost = PlanCost(plan, Profile(kernels, link, ps, os.cpu_count() or 1, emulated))
    data = SyntheticCTR(vocab=1000, num_slots=8)
    return {mode: _fit_overhead(plan, cost, data, mode, steps, warmup) for mode in ("sync", "async")}


def _fit_overhead(plan: Plan, cost: Any, data: Any, mode: str, steps: int, warmup: int) -> Overhead:
    resid: dict[str, dict[int, float]] = {}
    driver: dict[int, float] = {}
    for mb in (1, 8):
        got = _cpu_per_step(plan, data, mode, mb, steps, warmup)
        driver[mb] = got["driver"]
        pred = cost.predict(RunSettings({"cpu": 1, "gpu": 1}, mb, 1, mode, 256))
        for r in pred.roles:
            name = f"{r.role}:0"
            model_s = r.busy_s if r.server else r.cpu_s
            resid.setdefault(r.role, {})[mb] = got.get(name, model_s) - model_s

    def fit(role: str) -> tuple[float, float]:
        per_item = max((resid[role][8] - resid[role][1]) / 7, 0.0)
        return per_item, max(resid[role][1] - per_item, 0.0)

    reader_item, reader_step = fit("cpu")
    item, step = fit("gpu")
    serve = max(min(resid["ps"].values()), 0.0) / 2  # two trainers talk to the shard
    driver_item = max((driver[8] - driver[1]) / 7, 0.0)
    return Overhead(
        reader_item, reader_step, item, step, serve, driver_item, max(driver[1] - driver_item, 0.0)
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
    if prof is None:
        log("profiling the link and the parameter server (a few seconds) ...")
        link, ps = measure_link(), measure_ps()
        log("calibrating the runtime's own overhead (four short training runs) ...")
        prof = Profile({}, link, ps, os.cpu_count() or 1, [], machine_key(), measure_overhead(link, ps))
    missing = prof.missing(plan.programs)
    if missing:
        log(f"profiling {sum(len(v) for v in missing.values())} kernel(s) on {', '.join(missing)} ...")
        have = {f"{k}/{s}" for k, t in prof.kernels.items() for s in t}
        kernels, emulated = profile_kernels(plan, tuple(missing), skip=have)
        for kind, table in kernels.items():
            prof.kernels.setdefault(kind, {}).update(table)
        prof.emulated = sorted(set(prof.emulated) | set(emulated))
    if refresh or missing or not path.is_file():
        _write_atomic(path, json.dumps(prof.to_dict(), indent=1))
    return prof


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
    cores: int | None = None,
    sample: dict[str, np.ndarray] | None = None,
    profile: Profile | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> TuneResult:
    """Profile this machine (cached, unless `profile` is given) and search placement and resources
    for `program` within `budget` (see transpiler.tune.tune). A Plan keeps its placement: only trainer
    counts, micro-batches, shards and modes are searched. `sample`: a batch of the data, for the share
    of unique ids among a step's ids (default 1.0: every id distinct)."""
    if isinstance(program, Plan):
        plan, config = program, program.config
    else:
        config = config or TranspileConfig()
        plan = transpile(program, config)
    profile = profile or machine_profile(plan, log=log)
    frac = unique_fraction(plan, sample) if sample is not None else 1.0
    return _tune(
        program if isinstance(program, Program) else None,
        profile,
        budget,
        config,
        batch_size=batch_size,
        cores=cores,
        unique_fraction=frac,
        transpile_fn=(lambda p, c: plan) if isinstance(program, Plan) else None,
        placement=not isinstance(program, Plan),
    )
