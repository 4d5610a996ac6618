"""Paddle references computed in new Python processes, for Paddle 3.3.1's legacy-IR sparse
optimizers, which are not reproducible.

Inside a process that has built and run other Paddle programs their trajectories moved by
4e-4 – 2e-2 from run to run. Even in a fresh process the legacy sparse Adam DeepFM is not the same
every time: 4 of 30 fresh processes moved 2e-5 – 1.1e-3 from the trajectory that the other 26
reproduced to the bit (with or without OMP_NUM_THREADS=1 or FLAGS_cpu_deterministic=1 in the
environment; measured 2026-12-01, the cause of a rare CI failure at 2.5e-4). So a reference is the
result that two fresh processes agree on bit for bit, never one run's.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

TRIES = 5


def _same(a: Any, b: Any) -> bool:
    """Equal to the bit: arrays and numbers by value (NaN equal to NaN), lists and tuples item by
    item; anything else (an imported program) is not compared."""
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray | np.generic | float | int):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    return True


def agreed(fn: Callable[..., Any], *args: Any, compare: Callable[[Any], Any] = lambda r: r) -> Any:
    """`fn(*args)` in new Python processes (two at once, then one more at a time, at most `TRIES`)
    until two results agree to the bit on `compare(result)`; that result. AssertionError when no two
    agree."""
    ctx = multiprocessing.get_context("spawn")

    def fresh(n: int) -> list[Any]:  # n results, each from its own new process, all at once
        with contextlib.ExitStack() as stack:
            pools = [stack.enter_context(ProcessPoolExecutor(1, mp_context=ctx)) for _ in range(n)]
            return [f.result(timeout=600) for f in [pool.submit(fn, *args) for pool in pools]]

    seen = fresh(2)
    if _same(compare(seen[0]), compare(seen[1])):
        return seen[0]
    for _ in range(TRIES - 2):
        [got] = fresh(1)
        if any(_same(compare(got), compare(old)) for old in seen):
            return got
        seen.append(got)
    raise AssertionError(
        f"Paddle's {fn.__name__}{args} gave a different result in each of {TRIES} fresh "
        "processes: no reference to compare with"
    )
