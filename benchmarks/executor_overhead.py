"""Per-op dispatch cost of runtime.Executor over calling the numpy kernels directly.

A 200-op MLP (100 x [gemm, relu], 8 wide, batch 4: tensors so small that the kernels' own work is
a few microseconds) is run (a) by `Executor.run` and (b) by a plain loop that calls the same
registry kernels with the same arrays. The difference per op is what the executor adds.

    python benchmarks/executor_overhead.py [--layers 100] [--repeats 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from ops_registry import get_op
from runtime import Executor
from transpiler import Program
from transpiler import builder as nn


def build(layers: int, width: int) -> tuple[Program, Program, nn.Var]:
    main, startup = Program(), Program()
    with nn.program_guard(main, startup):
        h = nn.data("x", [-1, width])
        for _ in range(layers):
            h = nn.fc(h, width, act="relu")
    return main, startup, h


def time_us(fns: list, repeats: int) -> list[tuple[float, float]]:
    """(median, min) wall time of each fn in microseconds. Runs are interleaved so that load from
    other processes on the machine hits every fn alike; the min is the least disturbed run."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm up (compiles the program, fills caches)
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [(statistics.median(ts) * 1e6, min(ts) * 1e6) for ts in times]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=100, help="fc+relu layers (2 ops each)")
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    threadpool_limits(1)

    main_prog, startup, out = build(args.layers, args.width)
    exe = Executor()
    exe.run(startup)
    feed = {"x": np.random.default_rng(0).normal(size=(args.batch, args.width)).astype(np.float32)}
    n_ops = sum(op.type != "data" for op in main_prog.ops)

    gemm, relu = get_op("gemm"), get_op("relu")
    gemm_attrs = dict(gemm.attrs)
    weights = [
        (exe.scope[op.inputs["B"][0]], exe.scope[op.inputs["C"][0]])
        for op in main_prog.ops
        if op.type == "gemm"
    ]

    def direct():
        h = feed["x"]
        for w, b in weights:
            h = gemm.kernel(np, {"A": h, "B": w, "C": b}, gemm_attrs)["Y"]
            h = relu.kernel(np, {"X": h}, {})["Y"]
        return h

    (via_exe,) = exe.run(main_prog, feed=feed, fetch_list=[out])
    assert np.array_equal(via_exe, direct()), "executor and direct kernel calls disagree"
    (exe_med, exe_min), (dir_med, dir_min) = time_us(
        [lambda: exe.run(main_prog, feed=feed, fetch_list=[out]), direct], args.repeats
    )
    res = {
        "ops": n_ops,
        "executor_us_per_op": exe_med / n_ops,
        "direct_us_per_op": dir_med / n_ops,
        "overhead_us_per_op": (exe_med - dir_med) / n_ops,
        "overhead_us_per_op_min": (exe_min - dir_min) / n_ops,
    }
    print(f"{n_ops} ops, batch {args.batch}, width {args.width}, {args.repeats} runs: median (min) per op")
    print(
        f"  Executor.run      : {exe_med / n_ops:6.2f} us/op ({exe_min / n_ops:.2f})  "
        f"= {exe_med / 1e3:.2f} ms/run"
    )
    print(
        f"  direct kernel call: {dir_med / n_ops:6.2f} us/op ({dir_min / n_ops:.2f})  "
        f"= {dir_med / 1e3:.2f} ms/run"
    )
    print(
        f"  executor overhead : {res['overhead_us_per_op']:6.2f} us/op ({res['overhead_us_per_op_min']:.2f})"
    )
    return res


if __name__ == "__main__":
    main()
