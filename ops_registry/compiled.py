"""The compiled (numba) sparse kernels: each a cached getter that imports numba and compiles on first
use (`cache=True`: once per machine, the compiled code kept beside this file). `ops_registry.base`
calls them from `COMPILED_FROM` rows on (`stable_argsort`, `RowMerge.sum`, `scatter_add`); below
that, and on a machine without numba (the GPU check's, benchmarks/gpu_check.sh), plain numpy: the
same results, slower on large arrays."""

from __future__ import annotations

import functools
import importlib.util
import sys

import numpy as np

# From this many rows the compiled kernels pay: numba's import costs a process ~0.4 s once, which
# small arrays never repay (tests, tutorials, small batches stay on plain numpy). Without numba: never.
COMPILED_FROM = 4096 if importlib.util.find_spec("numba") is not None else sys.maxsize


@functools.cache
def radix_argsort():
    """The compiled stable LSD radix argsort of non-negative int64 keys (numba, cached like
    `segment_sum`)."""
    import numba

    @numba.njit(cache=True, nogil=True)
    def radix_argsort(keys):  # pragma: no cover - compiled
        n = keys.shape[0]
        order = np.arange(n)
        if n == 0:
            return order
        hi = keys.max()
        k, k2, o2 = keys.copy(), np.empty_like(keys), np.empty_like(order)
        count = np.empty(2049, np.int64)
        shift = 0
        while shift < 64 and (hi >> shift) > 0:
            count[:] = 0
            for i in range(n):
                count[((k[i] >> shift) & 2047) + 1] += 1
            for b in range(2048):
                count[b + 1] += count[b]
            for i in range(n):  # stable: equal digits keep their order
                d = (k[i] >> shift) & 2047
                j = count[d]
                k2[j], o2[j] = k[i], order[i]
                count[d] = j + 1
            k, k2 = k2, k
            order, o2 = o2, order
            shift += 11
        return order

    return radix_argsort


@functools.cache
def segment_sum():
    """The compiled segmented sum (numba, compiled on first use and cached beside this file): for
    each run `starts[s]:starts[s+1]` of `order`, the sum of those rows of `values`, accumulated in
    float64 in `order`'s order and rounded once. One pass, no `values[order]` copy: ~10x faster than
    `np.add.reduceat` on a CTR step's row gradients (13 312 x 16 -> 3 640 rows: 72 vs 689 µs; x 1:
    18 µs). Used from `COMPILED_FROM` rows."""
    import numba

    @numba.njit(cache=True, nogil=True)
    def segment_sum(order, starts, values):  # pragma: no cover - compiled
        n, k, d = order.shape[0], starts.shape[0], values.shape[1]
        out = np.empty((k, d), values.dtype)
        if d == 1:  # (a wide table's rows: a scalar sum per run, 5x faster than the loop below)
            for s in range(k):
                end = starts[s + 1] if s + 1 < k else n
                a = 0.0
                for i in range(starts[s], end):
                    a += values[order[i], 0]
                out[s, 0] = a
            return out
        acc = np.empty(d, np.float64)
        for s in range(k):
            acc[:] = 0.0
            end = starts[s + 1] if s + 1 < k else n
            for i in range(starts[s], end):
                r = order[i]
                for j in range(d):
                    acc[j] += values[r, j]
            for j in range(d):
                out[s, j] = acc[j]
        return out

    return segment_sum


@functools.cache
def add_rows():
    """The compiled target[index[i]] += values[i], row by row in index order (numba, cached like
    `segment_sum`); repeated rows accumulate, as np.add.at does."""
    import numba

    @numba.njit(cache=True, nogil=True)
    def add_rows(target, index, values):  # pragma: no cover - compiled
        n, d = target.shape
        for i in range(index.shape[0]):
            r = index[i]
            if r < 0:
                r += n
            if r < 0 or r >= n:
                raise IndexError("scatter_add: an index is out of the table's rows")
            for j in range(d):
                target[r, j] += values[i, j]

    return add_rows
