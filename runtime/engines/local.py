"""The embedded local engine: every shard and trainer is a process on this machine (spawn).

Addresses are `ipc://` sockets in a private temporary run directory (`/tmp/hetps-run-*`). `stop`
sends SIGTERM, waits, then SIGKILLs what is left, reaps all and removes the run directory.

No process outlives its driver (the process that made the engine), even one killed by SIGKILL:
every child asks the kernel for SIGKILL when its parent dies (Linux: `prctl(PR_SET_PDEATHSIG)`,
so a child blocked anywhere, even stopped, dies at once) and runs a watcher thread that ends it
within 0.1 s of seeing its parent gone (other systems); a tiny janitor process (plain Python, no
imports of hetps) waits for the driver's death and then removes the run directory and its
shared-memory twin in /dev/shm (`transport.shm.shm_dir_for`: same-host tensors' segments). A child ends
with `os._exit` once its last messages are delivered, so no interpreter clean-up (pyzmq's
zero-copy buffers, a thread still blocked in a call) can crash or delay its exit. (Linux sends that
SIGKILL when the *thread* that started a child ends: start processes from the thread that lives for
the run, as `train` does.)

Messages are signed with a random per-run key (`secret`), so another local process cannot inject
requests.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from runtime.engines.base import Engine, ProcessFailure, child_main
from runtime.transport.shm import shm_dir_for

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_S = 0.1  # how often a child and the janitor look whether the driver is still there

JANITOR_ROUNDS = 50  # the janitor's rounds of killing what holds the run's directories (0.1 s apart)

# The janitor: argv = [driver pid, directories...] (the run directory and its shared-memory twin; on
# the Ray engine, Ray's temp dir). It runs in a session of its own, so signals to the driver's
# process group (Ctrl-C, `timeout`, a closed terminal) do not end it before its work. Once the
# driver is gone it SIGKILLs every process of this user that names one of the directories on its
# command line or holds a file in one (Ray's gcs_server, raylet, and its agents, which rename
# themselves "ray::DashboardAgent" but keep their log files open; the children of those), round
# after round until none is left, then removes the directories.
_JANITOR = f"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent, paths = int(sys.argv[1]), [p.rstrip("/") for p in sys.argv[2:]]
while os.getppid() == parent:
    time.sleep({WATCH_S})
def inside(text):
    return any(text == p or text.startswith(p + "/") for p in paths)
def holders():
    found, children = set(), {{}}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            with open(f"/proc/{{pid}}/stat", "rb") as f:
                ppid = int(f.read().rpartition(b")")[2].split()[1])
            children.setdefault(ppid, []).append(pid)
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\\0")
            fds = [os.readlink(f"/proc/{{pid}}/fd/{{fd}}") for fd in os.listdir(f"/proc/{{pid}}/fd")]
        except (OSError, ValueError, IndexError):
            continue
        if any(p in a for a in args for p in paths) or any(map(inside, fds)):
            found.add(pid)
    todo = list(found)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found
for _ in range({JANITOR_ROUNDS}):
    found = holders()
    if not found:
        break
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep({WATCH_S})
for path in paths:
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


def process_stopped(pid: int | None) -> str:
    """How process `pid` is stopped ("" when it is not, or when /proc cannot tell: not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return ""
    return {
        b"T": "is stopped (SIGSTOP, SIGTSTP or a debugger)",
        b"t": "is stopped by a debugger (ptrace)",
    }.get(state, "")


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


def process_main(parent: int, name: str, args: str, report: str, secret: bytes | None) -> None:
    """A local engine process: follow the driver, run `child_main` on the entry point and arguments
    pickled in file `args` (written by the driver in its private run directory), then exit at once
    with its code."""
    follow_parent(parent)
    code = child_main(name, _run_args, {"path": args}, report, secret)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)


def _run_args(path: str) -> None:
    with open(path, "rb") as f:
        target, kwargs = pickle.load(f)
    os.unlink(path)
    target(**kwargs)


def check_main_guard() -> None:
    """Refuse (RuntimeError, one sentence) a run started from the top level of a script that
    spawned processes will import again, i.e. outside `if __name__ == "__main__":`: each of them
    would run the call again (multiprocessing then fails in every process, in many lines)."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return  # `python -m package`: multiprocessing does not import a package's __main__ again
    if not path or not os.path.isfile(path):
        return  # interactive, `python -c`, `python - < script`: nothing is imported again
    frame, top = sys._getframe(1), None
    while frame is not None:  # the main module's own frame, where it is now
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            top = frame
        frame = frame.f_back
    if top is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return
    line = top.f_lineno
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            if not (isinstance(node, ast.If) and _is_main_test(node.test)):
                raise RuntimeError(
                    f'{path}, line {line}: training started outside `if __name__ == "__main__":`; '
                    "hetps starts its trainers and servers as new Python processes that import this "
                    "script again, so put the script's top-level code under that guard (see the "
                    "README's tour)"
                )
            return


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
        isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
    )


@contextlib.contextmanager
def _main_path_checked() -> Iterator[None]:
    """Start processes without a main-module path that names no file: `python - < script.py` sets
    `__main__.__file__` to "<stdin>", which every spawned child would try, and fail, to run."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    hide = (
        path is not None
        and getattr(getattr(main, "__spec__", None), "name", None) is None
        and not os.path.isfile(path)
    )
    if hide:
        del main.__file__
    try:
        yield
    finally:
        if hide:
            main.__file__ = path


class LocalEngine(Engine):
    def __init__(self) -> None:
        self.secret = os.urandom(32)  # every message of the run is signed, also on this machine
        self.tmp: str | None = None  # made on first use, removed by stop
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.janitor: subprocess.Popen | None = None

    def endpoint(self, name: str) -> str:
        if self.tmp is None:
            self.tmp = tempfile.mkdtemp(prefix="hetps-run-")
            self._make_shm_dir()
            self.janitor = start_janitor(self._run_paths())
        return f"ipc://{self.tmp}/{name.replace(':', '-')}"

    def _run_paths(self) -> list[str]:
        """The run directory and its shared-memory twin (same-host tensors; runtime.transport.channels)."""
        return [self.tmp, shm_dir_for(self.tmp)]

    def _make_shm_dir(self) -> None:
        """The run's private directory in /dev/shm; without it tensors go as ZeroMQ frames."""
        try:
            os.mkdir(shm_dir_for(self.tmp), 0o700)  # fails when the name exists: never reuse one
        except OSError as e:
            log.debug("no shared-memory directory for %s (%s): tensors go through ZeroMQ", self.tmp, e)

    def start(
        self,
        name: str,
        target: Callable[..., Any],
        kwargs: dict[str, Any],
        *,
        report: str,
        secret: bytes | None = None,
        resources: dict[str, float] | None = None,
    ) -> None:
        if name in self.procs:
            raise ValueError(f"a process named {name!r} was already started")
        if not self.procs:
            check_main_guard()
        # The entry point and its arguments (a reader's data may be large) go through a file in the
        # private run directory, not multiprocessing's pipe: a child that dies while starting would
        # leave the parent blocked for ever writing more than a pipe holds into that pipe.
        self.endpoint(name)  # makes the run directory
        args = os.path.join(self.tmp, f"{name.replace(':', '-')}.args")
        with open(os.open(args, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(ForkingPickler.dumps((target, kwargs)))
        p = self.ctx.Process(
            target=process_main,
            args=(os.getpid(), name, args, report, secret),
            name=f"hetps-{name}",
            daemon=True,
        )
        with _main_path_checked():
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
            if p.exitcode is None and (how := process_stopped(p.pid)):
                out[name] = how
        return out

    def pids(self) -> dict[str, int | None]:
        return {name: p.pid for name, p in self.procs.items()}

    def reset(self) -> None:
        self.stop()
        self.procs = {}

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
            for path in self._run_paths():
                shutil.rmtree(path, ignore_errors=True)
            self.tmp = None
        if self.janitor is not None:
            self.janitor.kill()
            self.janitor.wait()
            self.janitor = None


def start_janitor(paths: list[str]) -> subprocess.Popen | None:
    """The process that, once this one has died, kills what holds files in `paths` and removes them
    (`_JANITOR`; the local and the Ray engine start one per run)."""
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _JANITOR, str(os.getpid()), *paths],
            stdin=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
        )
    except OSError as e:
        log.warning("no janitor for %s (%s): if this process is killed, remove them by hand", paths, e)
        return None
