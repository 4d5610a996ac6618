"""`evaluate` / `predict` with `workers=N`: the forward graph on N worker processes, the tables on
S parameter-server shards, for data too big for one process.

The driver (the calling process) checks the checkpoint, then starts, through an engine (the local
one by default, as `train`), S shards with per-run keys (`runtime.ps.launch.start_servers`, the
same start-up as `train`'s), loads the checkpoint into them (or the plan's values without one) and
starts the workers "eval:0".."eval:N-1". Each worker runs the forward graph (`evaluation.forward_fn`)
on its share of the data, reading rows with peek pulls (no row created, nothing updated), and
sends each batch's prediction, loss and labels to the driver (`messages.Scored`). The shares:

- a dataset of `runtime.data.open_dataset`: worker i reads its reader shard i of N (the driver plans
  the shards once, `Dataset.prepare`; each worker parses only its byte ranges / row groups), in
  local batches of share(batch_size, i, N) rows; shards follow the files' order, so worker-major
  order is the data's order (a shuffled dataset is refused by `predict`: no order to keep);
- any other finite data (a list of feed dicts, an `ArrayReader`): read by the driver, batch i to
  worker i % N.

The driver sorts the results into the data's order: `evaluate` combines them exactly as the
one-process path does (`evaluation.Tally`), `predict` concatenates the predictions. A worker or
shard that fails, dies, is stopped or sends nothing for `stall_timeout` s is named in an
`EvaluationError` (`driver.watch_processes`, as `train`); every process is stopped and the run
directory removed however the call ends (the engine's `stop`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.data.sources import batch_size_of, is_sharded
from runtime.driver.history import TrainingError
from runtime.driver.listener import watch_processes
from runtime.engines import Engine, make_engine
from runtime.evaluation.forward import (
    Tally,
    batches_of,
    checked_checkpoint,
    client_source,
    forward_fn,
    labels_of,
)
from runtime.ps import PSClient
from runtime.ps.launch import load_values, start_servers
from runtime.transport.channels import DRIVER, Inbox, Links, Outbox
from runtime.transport.messages import TO_EVALUATOR, Done, Failed, ProtocolError, Scored, header, parse
from runtime.transport.process_id import EVALUATOR, SERVER, process_names
from runtime.transport.wire import client_key
from transpiler.exporters.servable import ForwardGraph, forward_graph
from transpiler.plan import Plan


class EvaluationError(TrainingError):
    """A worker or shard of a parallel evaluate / predict failed (named, with its traceback or how
    it ended)."""


@dataclass
class WorkerSpec:
    """What evaluation worker `index` of `count` needs (built by the driver, sent to the process)."""

    name: str
    index: int
    count: int
    graph: ForwardGraph
    with_loss: bool
    data: Any  # [(batch index, feed dict)], or a sharded dataset (its shard `index` of `count`)
    ps: list[str]
    driver: str
    links: Links  # its link to the driver (channels.Links)
    ps_key: bytes  # its own key to the shards (wire.client_key)
    timeout: float


@dataclass
class _Result:
    order: list
    pred: np.ndarray
    loss: float | None
    label: np.ndarray | None


def run_worker(spec: WorkerSpec) -> None:
    """An evaluation worker's entry point (see the module docstring)."""
    out = Outbox(spec.links)
    client = PSClient(spec.ps, client_key=spec.ps_key, timeout=spec.timeout, pusher=spec.name)
    try:
        forward = forward_fn(spec.graph, client_source(client), spec.with_loss)
        for order, batch in _share(spec):
            pred, loss = forward(batch)
            label = labels_of(spec.graph, batch) if spec.with_loss else None
            arrays = [pred] + ([label] if label is not None else [])
            out.send(spec.driver, header(Scored(spec.name, order, loss)), arrays)
        out.send(spec.driver, header(Done(spec.name)))
    finally:
        client.close()
        out.close()


def _share(spec: WorkerSpec) -> Any:
    """(order, batch) of this worker's share of the data, empty local batches skipped."""
    if not is_sharded(spec.data):
        for i, batch in spec.data:
            yield [i, 0], batch
        return
    for t, (feed, _) in enumerate(spec.data.shard(spec.index, spec.count)):
        if batch_size_of(feed):
            yield [spec.index, t], feed


def evaluate_parallel(
    plan: Plan,
    data: Any,
    checkpoint: str | Path | None,
    output: str | None,
    workers: int | None,
    servers: int | None,
    engine: str | Engine,
    stall_timeout: float,
) -> dict[str, float]:
    """`evaluation.evaluate` on worker processes (see the module docstring)."""
    graph = forward_graph(plan, output)
    if not graph.loss:
        raise ValueError("the plan has no loss: evaluate needs one (use predict for predictions)")
    tally = Tally(plan.loss_reduction, [t.name for t in graph.tasks])
    for r in _run(plan, graph, data, checkpoint, workers, servers, engine, stall_timeout, True):
        tally.add(r.pred, r.loss, r.label)
    return tally.result()


def predict_parallel(
    plan: Plan,
    data: Any,
    checkpoint: str | Path | None,
    output: str | None,
    workers: int | None,
    servers: int | None,
    engine: str | Engine,
    stall_timeout: float,
) -> np.ndarray:
    """`evaluation.predict` on worker processes, in the data's order (see the module docstring)."""
    graph = forward_graph(plan, output)
    results = _run(plan, graph, data, checkpoint, workers, servers, engine, stall_timeout, False)
    if not results:
        raise ValueError("predict got no examples: data is empty")
    return np.concatenate([r.pred for r in results])


def _count(what: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what}={value!r}: expected a positive int")
    return value


def _shares(data: Any, workers: int, feeds: list[str], predicting: bool) -> list[Any]:
    """Each worker's `WorkerSpec.data`, checked before any process starts."""
    if is_sharded(data):
        if predicting and getattr(data, "shuffle", 0):
            raise ValueError(
                "predict with workers= on a shuffled dataset: the predictions would have no order "
                "to return them in; open the dataset with shuffle=0"
            )
        if data.batch_size < workers:
            raise ValueError(
                f"workers={workers} is more than the dataset's batch_size {data.batch_size}: each "
                "worker reads its share of every batch; give fewer workers or a larger batch_size"
            )
        data.prepare(workers)  # each shard's rows counted once, here
        data.check_feeds(dict.fromkeys(feeds))
        return [data] * workers
    batches = list(batches_of(data))
    if not batches:
        raise ValueError(f"{'predict' if predicting else 'evaluate'} got no examples: data is empty")
    missing = [f for f in feeds if f not in batches[0]]
    if missing:
        raise KeyError(f"a batch lacks the feeds {missing} the model reads; it has {sorted(batches[0])}")
    return [[(i, b) for i, b in enumerate(batches) if i % workers == w] for w in range(workers)]


def _run(
    plan: Plan,
    graph: ForwardGraph,
    data: Any,
    checkpoint: str | Path | None,
    workers: int | None,
    servers: int | None,
    engine: str | Engine,
    stall_timeout: float,
    with_loss: bool,
) -> list[_Result]:
    """Start the shards and workers, gather their results in the data's order, stop them all."""
    workers = _count("workers", workers if workers is not None else 1)
    servers = _count("servers", servers if servers is not None else plan.config.num_servers)
    path = checked_checkpoint(plan, checkpoint)  # a bad checkpoint is refused before any process starts
    feeds = graph.feeds + (graph.label_feeds if with_loss else [])
    shares = _shares(data, workers, feeds, not with_loss)
    eng = make_engine(engine)
    try:
        results = _start_and_gather(plan, graph, shares, path, servers, eng, stall_timeout, with_loss)
    except TrainingError as e:
        raise EvaluationError(e.who, e.detail) from None
    finally:
        eng.stop()
    return sorted(results, key=lambda r: r.order)


def _start_and_gather(
    plan: Plan,
    graph: ForwardGraph,
    shares: list[Any],
    path: Path | None,
    servers: int,
    eng: Engine,
    timeout: float,
    with_loss: bool,
) -> list[_Result]:
    names = process_names(EVALUATOR, len(shares))
    eng.place({n: {} for n in process_names(SERVER, servers) + names})
    secret = eng.secret or os.urandom(32)  # the links' master key: only this driver holds it
    ps_secret = os.urandom(32)  # the shards' master key: each worker gets its own key under it
    admin = os.urandom(32)  # load / assign: only this driver may
    shards = process_names(SERVER, servers)
    inbox = Inbox(eng.endpoint(DRIVER), Links.derive(secret, DRIVER, senders=[*shards, *names]))
    ps_eps = [eng.endpoint(n) for n in shards]
    try:
        start_servers(
            eng,
            plan.tables,
            ps_eps,
            mode="async",
            secret=secret,
            admin=admin,
            report=inbox.endpoint,
            ps_secret=ps_secret,
            roots=None if path is None else [path],
        )
        if path is not None:
            with PSClient(ps_eps, secret=ps_secret, timeout=timeout, admin_secret=admin) as client:
                client.load(path)
        elif plan.params:
            load_values(plan, ps_eps, ps_secret, admin)
        for w, name in enumerate(names):
            links = Links.derive(secret, name, {DRIVER: inbox.endpoint})
            key = client_key(ps_secret, name)
            spec = WorkerSpec(
                name, w, len(names), graph, with_loss, shares[w], ps_eps, inbox.endpoint, links, key, timeout
            )
            eng.start(
                name, run_worker, {"spec": spec}, report=inbox.endpoint, secret=links.send[inbox.endpoint]
            )
        return _Gather(eng, inbox, names, timeout).run()
    finally:
        inbox.close()


class _Gather:
    """The driver's loop: collect the workers' results until each is done; name a failed process."""

    def __init__(self, eng: Engine, inbox: Inbox, names: list[str], timeout: float) -> None:
        self.eng, self.inbox, self.names, self.timeout = eng, inbox, names, timeout
        self.done: set[str] = set()
        self.stopped: dict[str, float] = {}
        self.results: list[_Result] = []

    def run(self) -> list[_Result]:
        last = checked = time.perf_counter()
        while len(self.done) < len(self.names):
            got = self.recv(200)
            now = time.perf_counter()
            last = now if got else last
            if now - checked >= 0.2:
                checked = now
                self.stopped = watch_processes(self.eng, self.done, self.recv, self.stopped)
                if now - last > self.timeout:
                    raise TrainingError(
                        "the evaluation",
                        f"no result from any worker for {self.timeout} s (finished: {sorted(self.done)})",
                    )
        return self.results

    def recv(self, timeout_ms: float) -> bool:
        """Receive and handle one message; False when none came within `timeout_ms`."""
        msg = self.inbox.recv(timeout_ms)
        if msg is None:
            return False
        h, arrays = msg
        try:
            m = parse(h, TO_EVALUATOR)
        except ProtocolError as e:
            raise TrainingError(h.get("who", "?"), f"sent an unknown report: {e}") from None
        if isinstance(m, Failed):
            raise TrainingError(m.who, "\n" + m.traceback)
        if isinstance(m, Done):
            self.done.add(m.who)
        elif isinstance(m, Scored):
            label = arrays[1] if len(arrays) > 1 else None
            self.results.append(_Result(list(m.order), arrays[0], m.loss, label))
        return True
