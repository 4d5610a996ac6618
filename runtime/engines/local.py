"""The embedded local engine: every shard and trainer is a process on this machine (spawn).

Addresses are `ipc://` sockets in a private temporary run directory (`/tmp/hetps-run-*`). `stop`
sends SIGTERM, waits, then SIGKILLs what is left, reaps all and removes the run directory.

No process outlives its driver (the process that made the engine), even one killed by SIGKILL:
every child asks the kernel for SIGKILL when its parent dies (Linux: `prctl(PR_SET_PDEATHSIG)`,
so a child blocked anywhere, even stopped, dies at once) and runs a watcher thread that ends it
within 0.1 s of seeing its parent gone (other systems); a tiny janitor process (plain Python, no
imports of hetps) waits for the driver's death and then removes the run directory. A child ends
with `os._exit` once its last messages are delivered, so no interpreter clean-up (pyzmq's
zero-copy buffers, a thread still blocked in a call) can crash or delay its exit.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from .base import Engine, ProcessFailure, child_main

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_S = 0.1  # how often a child and the janitor look whether the driver is still there

# The janitor: argv = [driver pid, run directory]. Ctrl-C goes to the whole terminal process group;
# the janitor ignores it (the driver cleans up itself then, and kills the janitor).
_JANITOR = f"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent, path = int(sys.argv[1]), sys.argv[2]
while os.getppid() == parent:
    time.sleep({WATCH_S})
shutil.rmtree(path, ignore_errors=True)
"""


def describe_exit(code: int) -> str:
    """'exited with code 1' / 'was killed by signal SIGKILL' for a multiprocessing exit code."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stopped(pid: int | None) -> str:
    """How process `pid` is stopped ("" when it is not, or when /proc cannot tell: not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return ""
    return {b"T": "is stopped (SIGSTOP, SIGTSTP or a debugger)",
            b"t": "is stopped by a debugger (ptrace)"}.get(state, "")


def follow_parent(parent: int) -> None:
    """End this process (SIGKILL from the kernel on Linux, else `os._exit` from a watcher thread)
    as soon as process `parent`, the one that started it, is gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watcher thread alone
            pass
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="hetps-parent-watch", daemon=True).start()


def process_main(parent: int, name: str, target: Callable[..., Any], kwargs: dict[str, Any], report: str,
                 secret: bytes | None) -> None:
    """A local engine process: follow the driver, run `child_main`, then exit at once with its code."""
    follow_parent(parent)
    code = child_main(name, target, kwargs, report, secret)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)


class LocalEngine(Engine):
    def __init__(self) -> None:
        self.tmp: str | None = None  # made on first use, removed by stop
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.janitor: subprocess.Popen | None = None

    def endpoint(self, name: str) -> str:
        if self.tmp is None:
            self.tmp = tempfile.mkdtemp(prefix="hetps-run-")
            self.janitor = _start_janitor(self.tmp)
        return f"ipc://{self.tmp}/{name.replace(':', '-')}"

    def start(self, name: str, target: Callable[..., Any], kwargs: dict[str, Any], *,
              report: str, secret: bytes | None = None, resources: dict[str, float] | None = None) -> None:
        if name in self.procs:
            raise ValueError(f"a process named {name!r} was already started")
        p = self.ctx.Process(target=process_main, args=(os.getpid(), name, target, kwargs, report, secret),
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

    def stalled(self) -> dict[str, str]:
        out = {}
        for name, p in self.procs.items():
            if p.exitcode is None and (how := _stopped(p.pid)):
                out[name] = how
        return out

    def pids(self) -> dict[str, int | None]:
        return {name: p.pid for name, p in self.procs.items()}

    def stop(self, timeout: float = 3.0) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()
                try:
                    os.kill(p.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self.janitor is not None:
            self.janitor.kill()
            self.janitor.wait()
            self.janitor = None


def _start_janitor(run_dir: str) -> subprocess.Popen | None:
    """The process that removes `run_dir` once this one has died (see the module docstring)."""
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _JANITOR, str(os.getpid()), run_dir],
                                stdin=subprocess.DEVNULL, close_fds=True)
    except OSError as e:
        log.warning("no janitor for %s (%s): if this process is killed, remove it by hand", run_dir, e)
        return None
