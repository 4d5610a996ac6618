"""A trainer's parameter-server calls on a thread of their own (`Background`), and the pulls in
flight there (`Prefetch`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.ps import PSClient


class Background:
    """Parameter-server calls on a thread of their own (ZeroMQ sockets are not thread-safe, so the
    thread owns its own PSClient): pushes and dense prefetches leave the trainer's critical path.
    Tasks run in submission order; `check` raises the error of a failed one in the trainer.

    Once a task has failed, every later task fails at once with that same error, without calling
    the servers: a rejected push (e.g. a NaN gradient) means the step is never applied, so a sync
    pull queued behind it would wait for its whole timeout and then blame the server; whoever waits
    on any later future gets the first cause instead."""

    def __init__(self, make_client: Callable[[], PSClient]) -> None:
        self.make, self.client = make_client, None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hetps-ps")
        self.pending: list[Future] = []
        self.failed: BaseException | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        f = self.pool.submit(self._call, fn, args)
        self.pending.append(f)
        return f

    def _call(self, fn, args):
        if self.failed is not None:
            raise self.failed
        try:
            if self.client is None:
                self.client = self.make()
            return fn(self.client, *args)
        except BaseException as e:
            self.failed = e
            raise

    def check(self) -> None:
        for f in [f for f in self.pending if f.done()]:
            self.pending.remove(f)
            f.result()

    def settle(self) -> None:
        """Wait for every task submitted so far, in order; raise the first failure."""
        for f in list(self.pending):
            f.result()
        self.check()

    def close(self) -> None:
        """Wait for every task; then close the thread's client."""
        self.pool.submit(lambda: self.client and self.client.close())
        self.pool.shutdown(wait=True)
        self.check()


def pull_task(client: PSClient, pulls: list[tuple[str, np.ndarray | None]], step: int | None) -> list:
    return client.pull_many(pulls, step=step)


@dataclass
class Prefetch:
    """Pulls in flight on the background thread: `fut` gives a list of arrays (`PSClient.pull_many`'s
    or `push_pull`'s result), of which this prefetch's begin at `at`."""

    fut: Future
    at: int = 0

    def arrays(self, n: int) -> list[np.ndarray]:
        return self.fut.result()[self.at : self.at + n]
