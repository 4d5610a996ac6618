"""Matrix products over several CPU threads: the `gemm` and `matmul` kernels' 2-D numpy products.

numpy releases the GIL inside BLAS, so a product's rows can be computed on several threads at once,
each calling single-threaded BLAS. `Pool.matmul` cuts the product's rows into one chunk per thread,
which the calling thread and the pool's helpers claim in turn: a helper that is not running when a
product starts (its core busy with another process) delays nothing, because the caller, done with
its own chunk, takes the one left. (BLAS's own threads spin while they wait and split the work in
fixed shares: on cores shared with other processes they cost more CPU and gained less; measured in
benchmarks/README.md, issue 18 round 6.)

One pool per process, `set_threads(n)`; 1 (the default) computes every product on the calling
thread. A trainer process sets it from `train(kernel_threads=...)`.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np

MIN_FLOPS = 2e7  # a smaller product runs on the calling thread: handing out chunks would cost more
# Chunks per thread. More would balance better but run smaller BLAS calls, which cost more CPU per
# row: on the CTR benchmark's 512 x 400 products 1 gave 34 700-35 600 examples/s (gpu trainer 19.1-19.7
# CPU ms per step), 2 gave 31 100-34 000 (20.6-22.1 ms), 4 and 8 less, chunks shrinking toward the
# end (guided) less too.
CHUNKS_PER_THREAD = 1


class _Job:
    """One product being computed: its row chunks, claimed in order by whichever thread is free."""

    def __init__(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, chunks: int) -> None:
        self.a, self.b, self.out = a, b, out
        m = a.shape[0]
        self.bounds = [m * i // chunks for i in range(chunks + 1)]
        self.claim = itertools.count()  # next() on it is atomic under the GIL
        self.left = chunks
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        """Compute chunks until none is left to claim."""
        while (i := next(self.claim)) < len(self.bounds) - 1:
            r0, r1 = self.bounds[i], self.bounds[i + 1]
            try:
                np.matmul(self.a[r0:r1], self.b, out=self.out[r0:r1])
            except BaseException as e:  # noqa: BLE001 - raised again by the caller
                self.error = e
            with self.lock:
                self.left -= 1
                if not self.left:
                    self.done.set()


class Pool:
    """`threads - 1` helper threads (daemons) for `matmul`; the calling thread is the other one."""

    def __init__(self, threads: int) -> None:
        self.threads = _checked(threads)
        self._cv = threading.Condition()
        self._job: _Job | None = None
        self._posted = 0  # how many jobs were posted (a helper takes each it has not seen)
        self._closed = False
        self._helpers = [
            threading.Thread(target=self._helper, daemon=True, name=f"hetps-kernel-{i}")
            for i in range(threads - 1)
        ]
        for t in self._helpers:
            t.start()

    def _helper(self) -> None:
        seen = 0
        while True:
            with self._cv:
                while self._posted == seen and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                seen, job = self._posted, self._job
            job.work()

    def close(self) -> None:
        """Stop the helpers (a product in progress is finished by its caller)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._helpers:
            t.join()

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a @ b for 2-D numpy arrays, its rows in chunks over the pool's threads when it is large
        enough to pay (`MIN_FLOPS`); the same values as a @ b up to rounding."""
        m, n = a.shape[0], b.shape[1]
        if self.threads < 2 or 2.0 * m * n * a.shape[1] < MIN_FLOPS or m < 2 * self.threads:
            return a @ b
        out = np.empty((m, n), np.result_type(a, b))
        job = _Job(a, b, out, self.threads * CHUNKS_PER_THREAD)
        with self._cv:
            self._job, self._posted = job, self._posted + 1
            self._cv.notify_all()
        job.work()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return out


def _checked(threads: Any) -> int:
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"kernel threads must be a positive int, got {threads!r}")
    return threads


_pool = Pool(1)


def set_threads(threads: int) -> None:
    """Compute this process's large matrix products on `threads` threads (1: the calling thread)."""
    global _pool
    if _checked(threads) != _pool.threads:
        old, _pool = _pool, Pool(threads)
        old.close()


def threads() -> int:
    """The threads this process's large matrix products use (`set_threads`)."""
    return _pool.threads


def matmul(a: Any, b: Any) -> Any:
    """a @ b; a product of two 2-D numpy arrays over this process's kernel threads (`set_threads`),
    any other (cupy, batched, 1-D) as `@` computes it."""
    if type(a) is np.ndarray and type(b) is np.ndarray and a.ndim == 2 and b.ndim == 2:
        return _pool.matmul(a, b)
    return a @ b
