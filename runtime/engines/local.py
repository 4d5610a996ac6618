"""The embedded local engine: every shard and trainer is a process on this machine (spawn).

Addresses are `ipc://` sockets in a private temporary directory. Processes are daemonic and also
watch their parent (trainers and servers exit when it disappears), so none outlives the run, even
when the driver is killed. Messages are signed with a random per-run key (`secret`), so another
local process cannot inject requests. `stop` sends SIGTERM, waits, then SIGKILLs what is left and
reaps all.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

from .base import Engine, ProcessFailure, child_main


def describe_exit(code: int) -> str:
    """'exited with code 1' / 'was killed by signal SIGKILL' for a multiprocessing exit code."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class LocalEngine(Engine):
    def __init__(self) -> None:
        self.secret = os.urandom(32)  # every message of the run is signed, also on this machine
        self.tmp: str | None = None  # made on first use, removed by stop
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.process.BaseProcess] = {}

    def endpoint(self, name: str) -> str:
        if self.tmp is None:
            self.tmp = tempfile.mkdtemp(prefix="hetps-run-")
        return f"ipc://{self.tmp}/{name.replace(':', '-')}"

    def start(self, name: str, target: Callable[..., Any], kwargs: dict[str, Any], *,
              report: str, secret: bytes | None = None, resources: dict[str, float] | None = None) -> None:
        if name in self.procs:
            raise ValueError(f"a process named {name!r} was already started")
        p = self.ctx.Process(target=child_main, args=(name, target, kwargs, report, secret),
                             name=f"hetps-{name}", daemon=True)
        p.start()
        self.procs[name] = p

    def ended(self) -> dict[str, ProcessFailure | None]:
        out = {}
        for name, p in self.procs.items():
            code = p.exitcode
            if code is not None:
                out[name] = None if code == 0 else ProcessFailure(name, p.pid, describe_exit(code))
        return out

    def pids(self) -> dict[str, int | None]:
        return {name: p.pid for name, p in self.procs.items()}

    def stop(self, timeout: float = 3.0) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
