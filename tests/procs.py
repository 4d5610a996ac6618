"""Process checks shared by the engine tests: a run must leave no process behind."""

from __future__ import annotations

import os
import time


def alive(pids) -> list[int]:
    """The pids that still name a running process (a zombie, dead but not yet reaped by its
    parent or by init, does not count)."""
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        if _state(pid) not in ("Z", "X"):
            out.append(pid)
    return out


def _state(pid: int) -> str:
    """The one-letter state of /proc/PID/stat ("" when unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def wait_dead(pids, timeout: float = 10.0) -> list[int]:
    """The pids still alive after up to `timeout` s (Ray reaps a killed actor's worker asynchronously)."""
    deadline = time.monotonic() + timeout
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
