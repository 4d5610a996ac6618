"""Measure the parts of a cost profile on this machine (runtime/profile/machine.py caches them):

- kernels: every kernel op of a plan's sub-programs, on each trainer kind (cpu: numpy; gpu: cupy on a
  CUDA device, else numpy, marked *emulated*), at two micro-batch sizes, fitted as
  fixed + per example; recv / pull ops are fed random values of their declared shapes (recv: in
  [0, 1)), sends and pushes do nothing, so only the kernels are timed (the median call of a few
  repeats; numpy kernels by the thread's CPU time, so other processes taking the cores do not inflate them);
- the link: ZeroMQ messages as the trainers send them (their encoding, signed with a secret as
  every trainer's messages are), of two sizes, fitted as latency + per byte;
- the parameter server: a real shard process, dense pulls / pushes of two sizes and sparse row
  pulls / pushes of two row widths, fitted as per request + per byte (+ per row for sparse rows).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from runtime.exec.device import cuda_available, cupy_module
from runtime.exec.executor import Executor
from runtime.transport.channels import Inbox, Links, Outbox, pack_tensors
from transpiler.config import KINDS
from transpiler.cost.profile import KernelCost, LinkCost, PSCost, kernel_ops, op_signature
from transpiler.ir import Program
from transpiler.plan import Plan
from transpiler.tables import Sharding, TableSpec

SIZES = (32, 256)


# -- kernels ---------------------------------------------------------------------------------------
def _xp(kind: str) -> tuple[Any, bool]:
    """(array module, emulated) for a trainer kind."""
    if kind == "gpu" and cuda_available():
        return cupy_module(), False
    return np, kind == "gpu"


def _sync(xp: Any) -> None:
    if xp is not np:
        xp.cuda.Device().synchronize()


def _stubs(xp: Any, state: dict[str, int], rng: np.random.Generator) -> dict[str, Callable]:
    """Executor handlers standing in for comm and PS ops: random values of the declared shapes."""

    def shape(s) -> tuple[int, ...]:
        return tuple(state["m"] if d == -1 else d for d in s)

    def recv(op, values, ctx):
        # values in [0, 1): what any received tensor may hold, labels of a bce loss included
        a = op.attrs
        values[op.outputs["Out"][0]] = xp.asarray(rng.random(shape(a["shape"])).astype(a["dtype"]))

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
    vocab = min([t.shape[0] for t in plan.tables if t.kind == "sparse"] or [1000])
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
            times.setdefault(sig, {}).setdefault(state["m"], []).append(dt)
        return res

    return run


def _fit(calls: dict[int, list[float]], sizes: tuple[int, int]) -> KernelCost:
    """fixed + per example through the median call at each of the two sizes: the typical call, as a
    run's trainer makes it once per item between other kernels (the fastest of the repeats, which
    found every cache warm, was 6-17% below the median call of the CTR model's MLP kernels)."""
    a, b = sizes
    t = {m: statistics.median(got) for m, got in calls.items()}
    per = max((t[b] - t[a]) / (b - a), 0.0)
    return KernelCost(max(t[a] - per * a, 0.0), per)


# -- link and parameter server --------------------------------------------------------------------
def measure_link(sizes: tuple[int, int] = (1024, 1 << 20), count: int = 50) -> LinkCost:
    """One ZeroMQ message (ipc, the trainers' encoding), sent and received: latency + per byte.
    Signed and verified with a secret, as a run's trainers sign every message (the HMAC over the
    bytes costs several times the copy: unsigned, the per-byte cost came out ~9x too low)."""
    tmp = tempfile.mkdtemp(prefix="hetps-profile-")
    secret = os.urandom(32)
    inbox = Inbox(f"ipc://{tmp}/link", Links.derive(secret, "b", senders=["a"]))
    out = Outbox(Links.derive(secret, "a", {"b": inbox.endpoint}))
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


def _table(name: str, kind: str, shape: list[int]) -> TableSpec:
    """A table spec for the probe shard: zeros, SGD with lr 0 (the probes leave values unchanged)."""
    by = Sharding("table", 1, 0) if kind == "dense" else Sharding("id_hash", 1)
    return TableSpec(
        name=name,
        kind=kind,
        shape=shape,
        dtype="float32",
        initializer={"type": "constant", "value": 0.0},
        optimizer={"type": "sgd", "lr": 0.0, "state": {}},
        sharding=by,
    )


def measure_ps(count: int = 20) -> PSCost:
    """Round trips to a real shard: a tiny dense pull (per request), eight tiny tables in one pull
    (per table in a request), a 4 MB dense pull + push (per byte), 8192 sparse rows of dim 16 and of
    dim 1 pulled + pushed (per byte and per row); and the client's CPU time over all of them against
    their wall time (the client's own share of a round trip: ~0.45 on the 2-core machine)."""
    from runtime.ps import PSClient
    from runtime.ps.local import Servers

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
        spent = [0.0, 0.0]  # this process's CPU time, wall time, over every timed round trip

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(count):
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times.append(time.perf_counter() - t0)
                spent[0] += time.process_time() - c0
                spent[1] += times[-1]
            return min(times)

        tiny = best(lambda: client.pull("t0"))
        eight = best(lambda: client.pull_many([(f"t{i}", None) for i in range(8)]))
        big = best(lambda: client.push("big", client.pull("big")))
        rows = best(lambda: (client.pull("rows", ids), client.push("rows", grad, ids)))
        rows1 = best(lambda: (client.pull("rows1", ids), client.push("rows1", grad1, ids)))
    part = max(eight - tiny, 0.0) / 7
    lookup, union = _lookup_cost()
    n = 2 * len(ids)  # rows moved (pull + push)
    byte_s = max(rows - rows1, 0.0) / (n * (grad.itemsize * 15))
    row_s = max(rows1 - 2 * tiny - n * grad1.itemsize * byte_s, 0.0) / n
    big_byte_s = max(big - 2 * tiny, 0.0) / (2 * 4 * 1024 * 1024)
    client_cpu = min(spent[0] / spent[1], 1.0) if spent[1] > 0 else 1.0
    return PSCost(max(tiny - part, 0.0), big_byte_s, byte_s, row_s, lookup, part, union, client_cpu)


def _lookup_cost(n: int = 13_312, dim: int = 8, repeats: int = 5) -> tuple[float, float]:
    """A reader's own work per id, as the trainer does it: (per id looked up in one table: the pulled
    rows gathered by position in the step's unique ids, the rows' gradients merged for the push;
    per id of a step's feed: the union of the step's ids, once per feed, for the rows' prefetch), by
    this thread's CPU time, the median of `repeats`, as the kernels are timed (wall time took
    other processes' load in)."""
    from ops_registry import SparseRows

    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.2, n), 10**6).astype(np.int64)
    union = np.unique(ids)
    rows = rng.standard_normal((len(union), dim)).astype(np.float32)
    grads = rng.standard_normal((n, dim)).astype(np.float32)
    hashed = rng.integers(0, 10**6, n)  # a step's ids as hashed features spread them
    looked, unioned = [], []
    for _ in range(repeats):
        t0 = time.thread_time()
        rows.take(np.searchsorted(union, ids), axis=0)
        SparseRows(ids, grads, 10**6).merged(np)
        t1 = time.thread_time()
        np.unique(hashed)
        looked.append(t1 - t0)
        unioned.append(time.thread_time() - t1)
    return statistics.median(looked) / n, statistics.median(unioned) / n
