"""Process checks shared by the engine tests: a run must leave no process behind."""

from __future__ import annotations

import os
import time


def alive(pids) -> list[int]:
    """The pids that still name a process."""
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        out.append(pid)
    return out


def wait_dead(pids, timeout: float = 10.0) -> list[int]:
    """The pids still alive after up to `timeout` s (Ray reaps a killed actor's worker asynchronously)."""
    deadline = time.monotonic() + timeout
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
