"""Transpile synthetic CTR programs of about 1k, 10k and 100k ops; print ops/s for each.

A program is a stack of W&D towers: tower i looks up `ids_i` in a deep table (sum-pooled, then a
two-layer MLP) and in a wide table (sum-pooled), adds both to a running logit, and the logit goes
through a log loss; SGD. Forward, backward and optimizer ops all count. The running sum of
towers joins every light op into one component, so placement solves one minimum cut over the
whole program — the worst case for it. Goal: 10k ops in <= 1 s; 100k in <= 12x the 10k time.

    python benchmarks/transpile_scale.py [--sizes 1000 10000 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import time

from transpiler import Program, transpile
from transpiler import builder as nn

OPS_PER_TOWER = 25  # measured: 11 forward, 9 backward, 5 optimize


def synthetic(n_ops: int, dim: int = 8, vocab: int = 1000) -> Program:
    """A training program of about `n_ops` ops (see the module docstring)."""
    main, startup = Program(), Program()
    with nn.program_guard(main, startup):
        label = nn.data("label", [-1, 1])
        logit = None
        for i in range(max(1, n_ops // OPS_PER_TOWER)):
            ids = nn.data(f"ids_{i}", [-1, 4], "int64")
            deep = nn.reduce_sum(nn.embedding(ids, vocab, dim, name=f"deep_{i}"), axes=[1])
            wide = nn.reduce_sum(nn.embedding(ids, vocab, 1, name=f"wide_{i}"), axes=[1])
            tower = nn.add(nn.fc(nn.fc(deep, 16, act="relu"), 1), wide)
            logit = tower if logit is None else nn.add(logit, tower)
        loss = nn.reduce_mean(nn.sigmoid_cross_entropy_with_logits(logit, label))
        nn.SGD(0.01).minimize(loss)
    return main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--repeat", type=int, default=3, help="best of N transpiles per size")
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    transpile(synthetic(200))  # warm imports (networkx) out of the timings
    wall, cpu = {}, {}
    for n in args.sizes:
        prog = synthetic(n)
        plan = None
        for _ in range(args.repeat):
            plan = None  # each transpile starts from the same heap: no earlier plan alive
            gc.collect()
            t, c = time.perf_counter(), time.process_time()
            plan = transpile(prog)
            wall[n] = min(wall.get(n, float("inf")), time.perf_counter() - t)
            cpu[n] = min(cpu.get(n, float("inf")), time.process_time() - c)
        ops = len(prog.ops)
        print(
            f"{ops:>7} ops: {wall[n]:7.3f} s wall ({ops / wall[n]:>7,.0f} ops/s), {cpu[n]:7.3f} s cpu "
            f"({ops / cpu[n]:>7,.0f} ops/s); {sum(len(p.ops) for p in plan.programs.values())} ops in "
            f"{len(plan.programs)} sub-programs, {len(plan.channels)} boundary tensors",
            flush=True,
        )
    if 10000 in wall and 100000 in wall:
        print(
            f"10k: {wall[10000]:.3f} s wall, {cpu[10000]:.3f} s cpu (goal <= 1 s); 100k / 10k: "
            f"{wall[100000] / wall[10000]:.1f}x wall, {cpu[100000] / cpu[10000]:.1f}x cpu (goal <= 12x)"
        )


if __name__ == "__main__":
    main()
