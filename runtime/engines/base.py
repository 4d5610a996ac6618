"""The Engine interface, and the wrapper every engine runs its entry points in."""

from __future__ import annotations

import signal
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DELIVER_S = 65.0  # the most a process waits, when it ends, for its last messages to go out (to a
# stopped driver: channels.PATIENT_LINGER_S; to other peers a socket lingers 2 s)
HEAP_ARRAYS = 256 << 20  # arrays up to this size come from the heap, not from a fresh mmap
HEAP_KEEP = 512 << 20  # freed memory at the heap's top kept for reuse up to this size


@dataclass
class ProcessFailure:
    """A process of the run that ended while it was still needed."""

    name: str
    pid: int | None
    how: str  # "exited with code 1", "was killed by signal SIGKILL", ...

    def __str__(self) -> str:
        return f"{self.name} (pid {self.pid}) {self.how}"


class Engine(ABC):
    """Starts named entry points, tells their addresses, reports the dead, tears down.

    `start(name, target, kwargs)` runs `child_main(name, target, kwargs, report, secret)`, so a
    failing entry point sends its traceback to the driver's inbox at `report` before it exits,
    signed with `secret`: the key of its link to the driver (`wire.link_key(master, name, "driver")`).
    """

    secret: bytes | None = None  # the run's random master key of its links (train's default; driver only)

    def place(self, needs: dict[str, dict[str, float]]) -> None:  # noqa: B027 (optional hook)
        """Decide where every process of the run goes, before any `endpoint` is asked for:
        `needs` maps each process name to its resource hints (e.g. {"gpu": 1}). The local engine
        has nothing to decide; a cluster engine places (and may start) its workers here."""

    @abstractmethod
    def endpoint(self, name: str) -> str:
        """The address process `name` binds (its inbox, or a server's socket)."""

    @abstractmethod
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
        """Start `target(**kwargs)` as process `name`; `resources` are hints (e.g. {"gpu": 1})."""

    @abstractmethod
    def ended(self) -> dict[str, ProcessFailure | None]:
        """Processes that have ended: None for a clean exit, else how they failed."""

    def stalled(self) -> dict[str, str]:
        """Processes that are alive but cannot run, with how (e.g. "is stopped (SIGSTOP)"), where
        the engine can tell; the driver names one that stays so for a second, instead of waiting
        for the others to time out on it. The base engine cannot tell: {}."""
        return {}

    def fits(self, needs: dict[str, dict[str, float]]) -> bool:
        """Whether the processes of `needs` (as for `place`) can be placed now; a restart asks this
        (runtime/driver/restart.py) and goes on with fewer trainers when not. The base engine,
        whose machine does not shrink: True."""
        return True

    def reset(self) -> None:  # noqa: B027 (optional hook)
        """Forget the processes of the last run (after `stop`), so the same names can be placed and
        started again: a restart runs its next attempt on the same engine."""

    @abstractmethod
    def pids(self) -> dict[str, int | None]:
        """{name: process id} of every started process (None where the engine cannot tell)."""

    @abstractmethod
    def stop(self, timeout: float = 3.0) -> None:
        """End every process (politely, then by force after `timeout` s) and free the addresses."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def reuse_freed_memory() -> bool:
    """Make glibc's malloc reuse freed memory for the next step's arrays instead of unmapping it.

    By default an array over glibc's (adaptive, <= 32 MiB) mmap threshold is a fresh mapping, and
    freed memory at the heap's top above 128 KiB goes back to the kernel: every step then pays a
    page fault (and the kernel's zeroing) per 4 KiB of every large temporary. A sync gpu trainer
    took ~450 faults per micro-batch and 2.6 ms of CPU for a backward segment that takes 1.55 ms in
    async. Raising both thresholds keeps those pages (the resident size stays at its peak, as with
    jemalloc or tcmalloc). False where this is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_ARRAYS)) and bool(mallopt(M_TRIM_THRESHOLD, HEAP_KEEP))


def child_main(
    name: str, target: Callable[..., Any], kwargs: dict[str, Any], report: str, secret: bytes | None = None
) -> int:
    """Run one entry point in its own process and return its exit code: BLAS pinned to one thread
    (processes share the cores, and two BLAS threads per process on 2 cores ran 4x slower), freed
    memory reused (`reuse_freed_memory`), Ctrl-C
    left to the driver (which tears the run down), an exception's traceback sent to the driver
    (code 1), and, either way, the messages the process queued delivered before it returns
    (`channels.deliver_pending`; the caller ends the process with `os._exit` when that fails)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from threadpoolctl import threadpool_limits

    from runtime.transport.channels import Links, Outbox, deliver_pending
    from runtime.transport.messages import Failed, header

    threadpool_limits(1)
    reuse_freed_memory()
    code = 0
    try:
        target(**kwargs)
    except BaseException:
        code, text = 1, traceback.format_exc()
        try:
            links = None if secret is None else Links(name, {report: secret}, {})
            out = Outbox(links, patient=[report])
            out.send(report, header(Failed(name, text)))
            out.close()
        except Exception:  # the driver cannot be told (e.g. it is gone): its engine sees the exit code
            pass
    deliver_pending(DELIVER_S)
    return code
