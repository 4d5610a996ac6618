"""The Ray engine: every shard and trainer of a run is a Ray actor; tensors still go over ZeroMQ.

Ray does what it is good at — placement by resource requests, process lifecycle, failure detection
across machines — and stays off the data path: an actor call costs ~1 ms and a 4 MB tensor through
Ray's object store far more than the ~3 ms of a ZeroMQ tcp send (docs/design.md).

How a run goes:
1. `place(needs)` creates one actor per process with its resource request (a gpu trainer asks for
   `num_gpus`, or for a custom resource such as `gpu_trainer` on CPU-only clusters) and waits until
   Ray has placed them all. Each actor reserves a tcp port on its node and returns the address,
   so the addresses are exchanged through Ray before any process starts.
2. `start(name, target, kwargs)` runs the entry point inside its actor (`child_main`, as on the
   local engine: a failure's traceback goes to the driver's inbox).
3. `ended()` reads the actors' run calls without waiting: a returned call is an exit code, an
   `ActorDiedError` is a dead process (killed, out of memory, node lost), reported like a failed
   local process. A lost node takes all the run's processes on it: the report waits up to
   `LOST_NODE_WAIT` s for the others placed on the same node and names every one that died, with
   the node's address and whether Ray has marked the node dead.
4. `stalled()` names actors that are alive but stopped (SIGSTOP, Ctrl-Z, a debugger), so the
   driver blames the stopped process within a second or two rather than the trainer that timed out
   waiting for it (after `stall_timeout`, 60 s). It reads the kernel's own state of each actor's
   process (/proc/PID/stat, pids recorded at placement): directly for actors on the driver's node,
   and through a tiny probe task (no CPU reserved) pinned to each other node, at most one in flight
   per node, reissued every `PROBE_EVERY` s. Why not heartbeats from the actors or a ping call to
   them: an actor answering calls while `run` works must be a threaded actor, whose methods run off
   the main thread, where the entry points cannot install their signal handlers; a missing
   heartbeat cannot tell a stopped process from a slow one either, while the state can (a probe
   that cannot reach its node says nothing, and the lost node is reported by `ended()`). A process
   blocked forever without being stopped (a deadlock) still comes out as the stall timeout, which
   names what each trainer waits for.
5. `stop()` continues the stopped actors (SIGCONT: on the driver's node directly, elsewhere through
   a task on their node), then kills every actor; a Ray instance the engine started itself is shut
   down too. A stopped worker that is not continued lingers several seconds after `ray.kill`.

Without `address` and with no Ray running, the engine starts a private local Ray sized for the run
(its own temp dir `hetps-ray-*/ray`, inside a private `hetps-ray-*` that a janitor process removes,
with Ray's processes, if the driver is killed; a small object store, no dashboard, usage stats off,
and one `gpu_trainer` resource per gpu trainer on a machine without GPUs). `address="auto"` joins
the cluster of `ray start --head`; `"ray://host:10001"` connects through Ray Client (see docs/cluster.md).
`resources={"cpu": {"head": 1}}` adds custom resource requests per process kind (`ps`, or a
trainer type), so processes can be pinned to nodes that offer those resources.

Over tcp every message is signed: the engine makes a random master secret per run (`Engine.secret`),
which stays in the driver; each actor gets only its own link keys (channels.Links) through Ray.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from runtime.engines.base import Engine, ProcessFailure, child_main
from runtime.engines.local import process_stopped, start_janitor
from runtime.transport.process_id import ProcessId

GPU_RESOURCE = "gpu_trainer"  # the custom resource a CPU-only cluster offers for emulated gpu trainers
LOST_NODE_WAIT = 2.0  # seconds a death report waits for the other processes on the same node
PROBE_EVERY = 0.5  # seconds between two state probes of the actors on one node other than the driver's
CONTINUE_WAIT = 2.0  # seconds `stop` waits for the SIGCONT tasks on other nodes


class ProcessHost:
    """The actor class: reserves its address, then runs one entry point."""

    def where(self) -> tuple[str, int, str]:
        """(tcp address on this node with a free port, pid, Ray node id)."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
        return f"tcp://{ip}:{_free_port(ip)}", os.getpid(), node

    def run(
        self, name: str, target: Callable[..., Any], kwargs: dict[str, Any], report: str, secret: bytes | None
    ) -> int:
        """The entry point's exit code (1 after child_main reported a failure to the driver)."""
        return child_main(name, target, kwargs, report, secret)


def _states_here(pids: dict[str, int]) -> dict[str, str]:
    """Run on a node: {name: how it is stopped} for those of `pids` that are stopped there."""
    return {name: how for name, pid in pids.items() if (how := process_stopped(pid))}


def _continue_here(pids: list[int]) -> None:
    """Run on a node: SIGCONT to each of `pids` that still exists there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass


def _free_port(ip: str) -> int:
    """A port nobody listens on now (the process binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class RayEngine(Engine):
    """Processes as Ray actors. `gpu_resource`: the resource a gpu trainer asks for: None picks
    `GPU` (num_gpus) when the cluster has GPUs, else the custom resource `gpu_trainer` when the
    cluster offers it; `num_cpus`: CPUs each actor reserves; `resources`: extra custom resources
    each process of a kind asks for, by kind (`"ps"` or a trainer type, e.g. `{"cpu": {"head": 1}}`);
    `placement_timeout`: seconds to wait for Ray to place every actor; `init`: extra `ray.init`
    arguments for a locally started Ray."""

    def __init__(
        self,
        address: str | None = None,
        *,
        gpu_resource: str | None = None,
        num_cpus: float = 1,
        resources: dict[str, dict[str, float]] | None = None,
        placement_timeout: float = 60.0,
        init: dict[str, Any] | None = None,
    ) -> None:
        if address is None and "ray" not in sys.modules:
            # A private local Ray stays on loopback: on Linux Ray otherwise advertises (and its
            # actors bind) the host's network address; this switch makes it use 127.0.0.1.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ImportError("the ray engine needs Ray: pip install 'hetps[ray]'") from None
        self.address, self.gpu_resource, self.num_cpus = address, gpu_resource, num_cpus
        self.resources = {kind: dict(res) for kind, res in (resources or {}).items()}
        self.placement_timeout, self.init_kwargs = placement_timeout, dict(init or {})
        self.secret = os.urandom(32)
        self.owns_ray, self.tmp = False, None
        self.janitor: subprocess.Popen | None = None
        self.actors: dict[str, Any] = {}
        self.addresses: dict[str, str] = {}
        self.pid_of: dict[str, int] = {}
        self.node_of: dict[str, str] = {}  # process -> Ray node id
        self.runs: dict[str, Any] = {}
        self.results: dict[str, ProcessFailure | None] = {}
        self.stopped: dict[str, str] = {}  # process -> how it is stopped, as last seen
        self.probes: dict[str, tuple[Any, float]] = {}  # node id -> (probe in flight, issued at)
        self.seen_on: dict[str, dict[str, str]] = {}  # node id -> what its last probe found
        self.tasks: dict[Callable[..., Any], Any] = {}  # the Ray tasks of _on_node, made once

    # -- Ray itself ---------------------------------------------------------------------------------
    def _connect(self, needs: dict[str, dict[str, float]]) -> None:
        import ray

        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if self.address is not None:
            ray.init(address=self.address, **self.init_kwargs)
            return
        gpus = sum(r.get("gpu", 0) for r in needs.values())
        # hetps's own directory (0700); Ray makes its temp dir inside it and opens that one to all
        # (0777): Ray's modes never reach hetps's files. The janitor (local.start_janitor) kills Ray's
        # processes and removes both if this process dies without `stop` (SIGKILL).
        self.tmp = tempfile.mkdtemp(prefix="hetps-ray-")
        self.janitor = start_janitor([self.tmp])
        kw = dict(
            num_cpus=max(os.cpu_count() or 1, int(len(needs) * self.num_cpus + 0.999)),
            resources={GPU_RESOURCE: gpus} if gpus else {},
            object_store_memory=256 << 20,
            include_dashboard=False,
            _temp_dir=os.path.join(self.tmp, "ray"),
        )
        ray.init(**{**kw, **self.init_kwargs})
        self.owns_ray = True

    def _gpu_option(self, n: float) -> dict[str, Any]:
        import ray

        have = ray.cluster_resources()
        name = self.gpu_resource or ("GPU" if have.get("GPU") else GPU_RESOURCE)
        if not have.get(name):
            raise RuntimeError(
                f"a gpu trainer asks Ray for resource {name!r}, which this cluster lacks (it has "
                f"{sorted(have)}); start nodes with GPUs, or on CPU-only machines give them a custom "
                f"resource (ray start --resources='{{\"{GPU_RESOURCE}\": 1}}') and run with allow_emulation"
            )
        return {"num_gpus": n} if name == "GPU" else {"resources": {name: n}}

    # -- the Engine interface -----------------------------------------------------------------------
    def place(self, needs: dict[str, dict[str, float]]) -> None:
        import ray

        self._connect(needs)
        host = ray.remote(max_restarts=0)(ProcessHost)
        for name in needs:
            if name in self.actors:
                raise ValueError(f"a process named {name!r} was already placed")
        wanted, opts_of = self._requests(needs)
        short = self._short(wanted)
        if short:
            raise RuntimeError(
                f"the run cannot fit on this Ray cluster: {short}; processes ask for {wanted} "
                "(fewer trainers, RayEngine(num_cpus=...), or more nodes)"
            )
        for name in wanted:
            self.actors[name] = host.options(**opts_of[name]).remote()
        refs = {name: a.where.remote() for name, a in self.actors.items() if name not in self.addresses}
        ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.placement_timeout)
        if pending:
            late = [n for n, r in refs.items() if r in pending]
            raise RuntimeError(
                f"Ray did not place or start {late} within {self.placement_timeout} s; they ask for "
                f"{ {n: wanted[n] for n in late} }, the cluster has {ray.available_resources()} free"
            )
        for name, ref in refs.items():
            self.addresses[name], self.pid_of[name], self.node_of[name] = ray.get(ref)

    def _requests(self, needs: dict[str, dict[str, float]]) -> tuple[dict, dict]:
        """Per process: the resources it asks Ray for, and its actor options."""
        wanted: dict[str, dict[str, float]] = {}
        opts_of: dict[str, dict[str, Any]] = {}
        for name, res in needs.items():
            opts = {"num_cpus": self.num_cpus, **(self._gpu_option(res["gpu"]) if res.get("gpu") else {})}
            pid = ProcessId.maybe(name)  # (resources by kind: "ps", "cpu", "gpu", ...)
            extra = self.resources.get(pid.kind, {}) if pid is not None else {}
            if extra:
                opts["resources"] = {**opts.get("resources", {}), **extra}
            wanted[name] = {
                "CPU": self.num_cpus,
                **opts.get("resources", {}),
                **({"GPU": opts["num_gpus"]} if "num_gpus" in opts else {}),
            }
            opts_of[name] = opts
        return wanted, opts_of

    @staticmethod
    def _short(wanted: dict[str, dict[str, float]]) -> dict[str, str]:
        """The resources the cluster's live nodes lack for `wanted`, with how much."""
        import ray

        total: dict[str, float] = {}
        for res in wanted.values():
            for k, v in res.items():
                total[k] = total.get(k, 0) + v
        have: dict[str, float] = {}
        for node in ray.nodes():
            if node.get("Alive"):
                for k, v in node.get("Resources", {}).items():
                    have[k] = have.get(k, 0) + v
        short = {k: (v, have.get(k, 0)) for k, v in total.items() if v > have.get(k, 0)}
        return {k: f"{v:g} asked, {h:g} in the cluster" for k, (v, h) in short.items()}

    def fits(self, needs: dict[str, dict[str, float]]) -> bool:
        import ray

        if not ray.is_initialized():
            return True  # a Ray this engine starts is sized for the run
        try:
            return not self._short(self._requests(needs)[0])
        except RuntimeError:  # e.g. the gpu trainers' resource is gone with its node
            return False

    def reset(self) -> None:
        self.stop()
        self.addresses, self.pid_of, self.node_of, self.results = {}, {}, {}, {}

    def endpoint(self, name: str) -> str:
        if name == "driver":  # bound by the driver itself, any free port
            return f"tcp://{_driver_ip()}:*"
        if name not in self.addresses:
            raise KeyError(f"process {name!r} has not been placed; call place() with every process first")
        return self.addresses[name]

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
        if name in self.runs:
            raise ValueError(f"a process named {name!r} was already started")
        if name not in self.actors:
            raise KeyError(f"process {name!r} has not been placed; call place() with every process first")
        self.runs[name] = self.actors[name].run.remote(name, target, kwargs, report, secret)

    def ended(self) -> dict[str, ProcessFailure | None]:
        import ray
        from ray.exceptions import RayActorError

        lost: list[tuple[str, RayActorError]] = []
        for name in self._ready(0):
            try:
                code = ray.get(self.runs[name])
                self.results[name] = (
                    None
                    if code == 0
                    else ProcessFailure(name, self.pid_of.get(name), f"exited with code {code}")
                )
            except RayActorError as e:
                lost.append((name, e))
            except Exception as e:  # the run call itself failed in Ray
                how = f"failed in Ray: {type(e).__name__}: {_first_line(e)}"
                self.results[name] = ProcessFailure(name, self.pid_of.get(name), how)
        for name, e in lost:
            if name not in self.results:
                self._report_lost(name, e)
        return dict(self.results)

    def _ready(self, timeout: float, names: list[str] | None = None) -> list[str]:
        """The processes (of `names`, default all) whose run call has ended and is not yet read."""
        import ray

        open_runs = {
            self.runs[n]: n
            for n in (self.runs if names is None else names)
            if n in self.runs and n not in self.results
        }
        if not open_runs:
            return []
        ready, _ = ray.wait(list(open_runs), num_returns=len(open_runs), timeout=timeout)
        return [open_runs[ref] for ref in ready]

    def _report_lost(self, name: str, error: BaseException) -> None:
        """A lost actor, and every other process of the run lost with its node (they die together):
        each gets one report that names them all, the node's address, and whether Ray has marked
        the node dead. Waits up to LOST_NODE_WAIT s for the others on the node to be reported."""
        import ray
        from ray.exceptions import RayActorError

        node = self.node_of.get(name)
        peers = [p for p, n in self.node_of.items() if n == node and p != name]
        self._ready(LOST_NODE_WAIT, peers)  # returns as soon as all of them have ended
        lost = [name]
        for p in self._ready(0, peers):
            try:
                ray.get(self.runs[p])
            except RayActorError:
                lost.append(p)
            except Exception:  # a failure of its own: ended() reads it on its next call
                continue
        info = next((n for n in ray.nodes() if n["NodeID"] == node), None)
        where = f"Ray node {info['NodeManagerAddress']} (id {node[:8]})" if info else f"Ray node {node}"
        state = "marked dead by Ray" if info and not info.get("Alive") else "still listed alive by Ray"
        how = (
            f"died (its Ray actor is lost: {_first_line(error)}); processes of this run lost on {where}, "
            f"{state}: {', '.join(sorted(lost))}"
        )
        for p in lost:
            self.results[p] = ProcessFailure(p, self.pid_of.get(p), how)

    def stalled(self) -> dict[str, str]:
        """Actors whose process is stopped (see the module docstring): those on the driver's node
        as of now, those on other nodes as of their node's last probe (at most ~PROBE_EVERY s old)."""
        import ray

        if not self.runs or not ray.is_initialized():
            return {}
        here = self._driver_node()
        running = {n: self.node_of[n] for n in self.runs if n not in self.results and n in self.node_of}
        out = {
            n: how for n, node in running.items() if node == here and (how := process_stopped(self.pid_of[n]))
        }
        for node in {node for node in running.values() if node != here}:
            self._probe(node, {n: self.pid_of[n] for n, nd in running.items() if nd == node})
            seen = {n: how for n, how in self.seen_on.get(node, {}).items() if n in running}
            if seen:
                where = _node_address(node)
                out.update({n: f"{how} on Ray node {where}" for n, how in seen.items()})
        self.stopped = out
        return out

    def _probe(self, node: str, pids: dict[str, int]) -> None:
        """Read the result of `node`'s probe if it has come back, and start the next one when due."""
        import ray

        ref, issued = self.probes.get(node, (None, 0.0))
        if ref is not None and ray.wait([ref], timeout=0)[0]:
            try:
                self.seen_on[node] = ray.get(ref)
            except Exception:  # the node is gone or the task failed: it tells nothing
                self.seen_on.pop(node, None)
            ref = None
        if ref is None and time.monotonic() - issued >= PROBE_EVERY:
            ref, issued = self._on_node(_states_here, node).remote(pids), time.monotonic()
        self.probes[node] = (ref, issued)

    def _on_node(self, fn: Callable[..., Any], node: str) -> Any:
        """`fn` as a Ray task (no CPU reserved, no retry) that runs on `node` only."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if fn not in self.tasks:  # made once: each new remote function is exported to the cluster again
            self.tasks[fn] = ray.remote(num_cpus=0, max_retries=0)(fn)
        return self.tasks[fn].options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))

    def _driver_node(self) -> str | None:
        """The Ray node id of the driver's own machine; None under Ray Client (it is on none)."""
        import ray

        if ray.util.client.ray.is_connected():
            return None
        return ray.get_runtime_context().get_node_id()

    def pids(self) -> dict[str, int | None]:
        return dict(self.pid_of)  # kept after stop, so callers can check that nothing survived

    def _continue_stopped(self) -> None:
        """SIGCONT the actors that may be stopped, so that they act on being killed at once: every
        actor on the driver's node (cheap), and on other nodes those the last probes saw stopped."""
        import ray

        here = self._driver_node()
        _continue_here([p for n, p in self.pid_of.items() if n in self.actors and self.node_of[n] == here])
        elsewhere: dict[str, list[int]] = {}
        for n in self.stopped:
            if self.node_of.get(n) != here and n in self.pid_of:
                elsewhere.setdefault(self.node_of[n], []).append(self.pid_of[n])
        refs = [self._on_node(_continue_here, node).remote(p) for node, p in elsewhere.items()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=CONTINUE_WAIT)

    def stop(self, timeout: float = 3.0) -> None:
        import ray

        if ray.is_initialized():
            self._continue_stopped()
            for actor in self.actors.values():
                ray.kill(actor, no_restart=True)
            deadline = time.monotonic() + timeout
            for ref in self.runs.values():  # wait (bounded) until Ray has ended them
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                ray.wait([ref], timeout=left)
        self.actors, self.runs, self.probes, self.seen_on, self.stopped = {}, {}, {}, {}, {}
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self.janitor is not None:
            self.janitor.kill()
            self.janitor.wait()
            self.janitor = None


def _driver_ip() -> str:
    """The address the cluster reaches this process at: its Ray node's, or (Ray Client) this host's."""
    import ray

    if ray.util.client.ray.is_connected():
        return ray.util.get_node_ip_address()
    return _node_address(ray.get_runtime_context().get_node_id())


def _node_address(node: str) -> str:
    """The address of Ray node `node` (its id when Ray no longer lists it)."""
    import ray

    return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node), node)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
