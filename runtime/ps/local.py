"""`Servers`: parameter-server shards (`runtime.ps.server.serve`) as local processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from runtime.ps.server import serve
from runtime.ps.shard import Limits
from runtime.ps.table import PSError
from runtime.transport.shm import shm_dir_for
from transpiler.tables import TableSpec, tables_to_dicts

if TYPE_CHECKING:
    from runtime.ps.client import PSClient


class Servers:
    """Parameter-server shards as local processes; a context manager.

    Processes come from multiprocessing's forkserver (a clean process that imported this module
    once and forks each shard from it; spawn where forkserver does not exist), never from a fork
    of the caller, which may hold threads and sockets.

    `endpoints[k]` is shard k's address. Requests are signed: `secret` (the shards' master key) and
    `admin_secret` default to random keys made here; `client()` is a `PSClient` holding both. Give
    other processes, e.g. trainers, their own key: `PSClient(endpoints, pusher=name,
    client_key=wire.client_key(servers.secret, name))` pulls and pushes as `name` only and cannot
    assign, save, load or shut down (a client given `secret=servers.secret` can derive any name's
    key). Save and load work only inside `checkpoint_root`. With `log_dir`, shard k writes its log
    and stderr to `log_dir/ps-shard{k}.log`; otherwise to the forkserver's stderr. `limits`: see
    `shard.Limits`; `holders`: table -> the client name that may hold it (None: any client; `train`
    passes the plan's). With `transport="ipc"` the endpoints lie in a private run directory whose
    /dev/shm twin carries same-host clients' large arrays (runtime.transport.channels).
    """

    def __init__(
        self,
        specs: list[TableSpec],
        num_shards: int = 1,
        *,
        mode: str = "async",
        transport: str = "tcp",
        host: str = "127.0.0.1",
        pushes_per_step: int | dict = 1,
        check_finite: bool = True,
        secret: bytes | None = None,
        admin_secret: bytes | None = None,
        checkpoint_root: str | os.PathLike | None = None,
        limits: Limits | None = None,
        log_dir: str | os.PathLike | None = None,
        start_timeout: float = 60.0,
        holders: dict[str, str] | None = None,
    ) -> None:
        if transport not in ("tcp", "ipc"):
            raise PSError(f"transport {transport!r} is not 'tcp' or 'ipc'")
        self.secret = secret if secret is not None else os.urandom(32)
        self.admin_secret = admin_secret if admin_secret is not None else os.urandom(32)
        root = None if checkpoint_root is None else os.fspath(checkpoint_root)
        self._tmp = tempfile.mkdtemp(prefix="hetps-run-") if transport == "ipc" else None
        if self._tmp:  # its shared-memory twin: same-host clients' arrays go through it
            with contextlib.suppress(OSError):
                os.mkdir(shm_dir_for(self._tmp), 0o700)
        ctx = _start_context()
        self.processes, self.endpoints, pipes = [], [], []
        try:
            for k in range(num_shards):
                addr = f"ipc://{self._tmp}/shard{k}" if self._tmp else f"tcp://{host}:*"
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=serve,
                    args=(addr, tables_to_dicts(specs)),
                    name=f"hetps-ps-{k}",
                    daemon=True,
                    kwargs=dict(
                        shard=k,
                        num_shards=num_shards,
                        mode=mode,
                        secret=self.secret,
                        admin_secret=self.admin_secret,
                        checkpoint_root=root,
                        limits=limits,
                        pushes_per_step=pushes_per_step,
                        check_finite=check_finite,
                        holders=holders,
                        ready=send,
                        log_file=log_dir and os.path.join(log_dir, f"ps-shard{k}.log"),
                    ),
                )
                p.start()
                send.close()
                self.processes.append(p)
                pipes.append(recv)
            self.endpoints = _ready_endpoints(pipes, start_timeout, self.endpoints)
        except EOFError:
            self.stop()
            raise PSError(
                f"parameter server shard {len(self.endpoints)} exited before it was ready (see its stderr)"
            ) from None
        except BaseException:
            self.stop()
            raise

    def client(self, **kwargs: Any) -> PSClient:
        """A PSClient of these servers with both keys (the driver's client); `kwargs` go to PSClient."""
        from runtime.ps.client import PSClient

        return PSClient(self.endpoints, secret=self.secret, admin_secret=self.admin_secret, **kwargs)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every shard (SIGTERM, then SIGKILL after `timeout` s) and remove ipc sockets."""
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            shutil.rmtree(shm_dir_for(self._tmp), ignore_errors=True)

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _start_context() -> Any:
    """forkserver where there is one (imports once, then each shard forks fast), else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return mp.get_context("spawn")


def _ready_endpoints(pipes: list, start_timeout: float, endpoints: list[str]) -> list[str]:
    """Each shard's endpoint, as it reports it once ready (appended to `endpoints` as they come, so a
    failure names the first shard that did not report); a shard's start error is raised."""
    for k, recv in enumerate(pipes):
        late = ("error", f"not ready within {start_timeout} s")
        msg = recv.recv() if recv.poll(start_timeout) else late
        if isinstance(msg, tuple):
            raise PSError(f"parameter server shard {k} failed to start: {msg[1]}")
        endpoints.append(msg)
    return endpoints
