"""The trainer process: one trainer of one type runs its sub-program over pipelined micro-batches.

Work is cut into *items*: micro-batch m of step t read by reader trainer o, keyed (t, o, m) in every
message. Reader trainers (those of the type that owns the data ops) take their rows of each global
batch (`sources.share`; a sharded dataset hands each reader its own rows: `sources.reader_batches`),
split them into `micro_batches` items, and announce each step's items to
every trainer of the other types; an item's tensors go to the trainer of the destination type that
`route` picks, and its gradients come back the same way. A trainer's sub-program is cut at its recv
ops (`transpiler.schedule.segments`); it runs (item, segment) pairs as soon as the segment's messages
have arrived, oldest item first, with at most `micro_batches` of its own items in flight on a reader
— so a CPU trainer computes item k+1's embeddings while the GPU trainer runs item k's MLP. With
nothing runnable it blocks on its inbox (a ZeroMQ poll), giving up after `stall_timeout` seconds
without any message with an error saying what it waits for: a run never hangs silently.

Parameter-server access, per step:
- dense tables are pulled once per step, all at once, by a background thread as soon as the step is
  known (announced) or the previous one pushed, whichever comes first (prefetch; in sync mode the
  reply waits until the server has applied the previous step, in async mode it does not, so a
  step may miss the previous step's updates);
  sparse rows are pulled for the item's unique ids: a reader pulls the rows of all of a step's items
  (the union of their ids) in one background round trip when it announces the step, when a
  lookup's ids come straight from a feed, as embedding lookups' do; other pulls happen per item
  when their op runs;
- gradients are accumulated over all of the step's items and pushed once per step and table — zeros
  when the trainer got no item — so a sync server sees exactly one push per trainer per step; the
  background thread pushes them, so the trainer goes on with the next step's work meanwhile;
- the seed of the loss gradient (`fill_constant` into loss@GRAD) is scaled by item size / global
  batch size (for a mean loss; 1 for a `reduce_sum` loss), so the accumulated gradients equal the
  gradient of the loss on the whole global batch.
In sync mode the server applies step t once every trainer pushed it, and a pull for step t+1 waits
for that; so a trainer starts step t+1 only after pushing step t (a pull of step t+1 must never wait
on its own push). Sync training then equals single-process training on the global batches. In
async mode pulls do not wait and a reader may start the next step while the previous one finishes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ops_registry import SparseRows
from transpiler.inference import score_names
from transpiler.ir import Program
from transpiler.schedule import segment_programs

from . import sources
from .channels import Inbox, Outbox, pack_tensors, unpack_tensors
from .comm_ops import comm_handlers, seeded_fill
from .device import array_module
from .device import to_host as _host
from .executor import Executor
from .messages import (
    TO_TRAINER,
    Announce,
    Done,
    End,
    Losses,
    Message,
    ProtocolError,
    Ready,
    StepReport,
    Tensors,
    header,
    parse,
)
from .ps import PSClient
from .settings import TrainerSpec
from .telemetry import Recorder, pack_spans


def route(counts: dict[str, int], reader: str, dst_type: str, origin: int, mb: int,
          micro_batches: int) -> int:
    """Index of the trainer of type `dst_type` that handles micro-batch `mb` of reader `origin`:
    the reader itself for the reader type, else round robin over (origin, mb)."""
    if dst_type == reader:
        return origin
    return (origin * micro_batches + mb) % counts[dst_type]


@dataclass
class Item:
    step: int
    origin: int
    mb: int
    size: int
    global_size: int
    feed: dict[str, np.ndarray] | None = None
    seg: int = 0
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.step, self.origin, self.mb)


@dataclass
class StepState:
    items: int = 0                       # items of this step on this trainer (known so far)
    done: int = 0
    announced: set[int] = field(default_factory=set)   # readers whose announcement arrived
    dense: dict[str, Any] = field(default_factory=dict)           # pulled dense tables
    grads: dict[str, Any] = field(default_factory=dict)           # accumulated dense gradients
    rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)  # sparse
    reports: list[tuple[int, float, list]] = field(default_factory=list)  # (size, loss, [score, label])


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


def _pull_dense(client: PSClient, tables: list[str], step: int | None) -> dict[str, np.ndarray]:
    return dict(zip(tables, client.pull_many([(t, None) for t in tables], step=step), strict=True))


class Trainer:
    """One trainer; `spec` is built by `runtime.train` (see `train._trainer_spec`)."""

    def __init__(self, spec: TrainerSpec) -> None:
        self.spec = spec
        self.name, self.type, self.index = spec.name, spec.type, spec.index
        self.reader, self.counts = spec.reader, spec.counts
        self.is_reader = spec.is_reader
        self.mb_count, self.mode = spec.micro_batches, spec.mode
        self.stall_timeout = spec.stall_timeout
        self.xp, _ = array_module(self.type, spec.device_map, spec.allow_emulation, announce=False)
        self.program = Program.from_json(spec.program)
        self.segs = segment_programs(self.program)
        self.seg_recvs = [[op.attrs["tensor"] for op in seg.ops if op.type == "recv"] for seg in self.segs]
        self.feeds = self.program.attrs.get("feeds", [])
        self.loss = spec.loss if spec.loss in self.program.vars else None
        self.score = score_names(self.program) if self.loss else None  # reported for the AUC
        self.seg_outs = _kept_outputs(self.segs, [self.loss, *(self.score or [])])
        self.loss_scale = spec.loss_reduction == "mean"
        self.seed_id = next((op.id for op in self.program.ops if op.type == "fill_constant"
                             and op.outputs.get("Out") == [f"{self.loss}@GRAD"]), None)
        self.pushed = {op.attrs["table"]: op.type for op in self.program.ops
                       if op.type in ("push_dense", "push_sparse")}
        self.dense_tables = list(dict.fromkeys(op.attrs["table"] for op in self.program.ops
                                               if op.type == "pull_dense"))
        self.prefetch: dict[int, Future] = {}
        self.pushing: list[tuple[Future, list[tuple[str, np.ndarray]]]] = []  # pushes in flight + buffers
        self.free_bufs: dict[str, list[np.ndarray]] = {}
        made = {n: op for op in self.program.ops for n in op.output_names()}
        self.sparse_feeds = [(op.attrs["table"], u, made[u].inputs["Ids"][0]) for op in self.program.ops
                             if op.type == "pull_sparse" and (u := op.inputs["Ids"][0]) in made
                             and made[u].type == "unique_ids" and made[u].outputs["Unique"] == [u]
                             and made[u].inputs["Ids"][0] in self.feeds]
        self.rows_prefetch: dict[tuple, tuple[Future, int, np.ndarray]] = {}
        self.tables = {t["name"]: t for t in spec.tables}
        self.peers = [t for t in self.counts if t != self.reader]
        seed = self.seed_id if self.loss_scale else None  # a mean loss: scaled by item / global batch
        fill = seeded_fill(self.xp, seed, lambda it, v: v * it.size / it.global_size)
        self.exe = Executor(self.xp, handlers={**comm_handlers(self), "fill_constant": fill})
        # state
        self.items: dict[tuple[int, int, int], Item] = {}
        self.arrived: dict[tuple[int, int, int], dict[str, Any]] = {}
        self.steps: dict[int, StepState] = {}
        self.flushed = spec.start  # steps < flushed are pushed (a resumed run starts later)
        self.end: int | None = None    # no step >= end runs
        self.ends: dict[int, int] = {}  # reader index -> its end step (non-readers)
        self.outgoing: list[tuple[str, str, Any]] = []
        self.stats = {"busy_s": 0.0, "ps_s": 0.0, "wait_s": 0.0, "send_s": 0.0, "items": 0}
        self.rec = Recorder(spec.trace)  # timeline spans (runtime.telemetry), when asked
        self.peer_of = {ep: name for name, ep in spec.endpoints.items()}
        # reader state
        self.batches: Iterator | None = None
        self.next_step = self.flushed
        self.grant = spec.grant  # None: no limit from the driver; else steps < grant may start
        self.grant_final = False

    # -- wiring ---------------------------------------------------------------------------------
    def _connect(self) -> None:
        s = self.spec
        self.inbox = Inbox(s.endpoints[self.name], s.secret)
        self.out = Outbox(s.secret)

        def client() -> PSClient:
            return PSClient(s.ps, secret=s.secret, timeout=self.stall_timeout, pusher=self.name)

        self.client = client()
        self.bg = Background(client)
        self._prefetch(self.flushed)
        if self.is_reader:
            self.batches = sources.reader_batches(s.data, s.batch_size, s.epochs, self.index,
                                                  self.counts[self.type], start=self.flushed)

    def _report(self, msg: Message, arrays: list = ()) -> None:
        self.out.send(self.spec.driver, header(msg), arrays)

    def _endpoint(self, dst_type: str, item: Item) -> str:
        idx = route(self.counts, self.reader, dst_type, item.origin, item.mb, self.mb_count)
        return self.spec.endpoints[f"{dst_type}:{idx}"]

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self._connect()
        parent = os.getppid()
        start = last = time.perf_counter()
        cpu0 = time.process_time()
        self._report(Ready(self.name))
        try:
            while not self._finished():
                self.bg.check()
                self._drain()
                if self.is_reader:
                    self._announce()
                job = self._runnable()
                if job is not None:
                    self._run_segment(job)
                    continue
                t0 = time.perf_counter()
                msg = self.inbox.recv(timeout_ms=1000)
                t1 = time.perf_counter()
                self.stats["wait_s"] += t1 - t0
                if self.rec.on:
                    self.rec.span("wait", "wait", t0, t1)
                if msg is not None:
                    self._handle(*msg)
                    last = time.perf_counter()
                elif os.getppid() != parent:
                    raise SystemExit(f"{self.name}: the driver process is gone")
                elif time.perf_counter() - last > self.stall_timeout:
                    raise RuntimeError(f"{self.name}: no message for {self.stall_timeout} s; "
                                       + self._waiting_for())
            self.bg.close()
            self.stats["wall_s"] = time.perf_counter() - start
            self.stats["cpu_s"] = time.process_time() - cpu0
            spans = [pack_spans(self.rec.take())] if self.rec.on else []
            self._report(Done(self.name, self.stats), spans)
        finally:
            self.out.close()
            self.client.close()
            self.inbox.close()

    def _finished(self) -> bool:
        if self.is_reader:
            return self.end is not None and self.flushed >= self.end
        if len(self.ends) < self.counts[self.reader]:
            return False
        ends = set(self.ends.values())
        if len(ends) != 1:
            raise RuntimeError(f"{self.name}: reader trainers disagree on the last step: {self.ends}")
        return self.flushed >= ends.pop()

    def _waiting_for(self) -> str:
        waits = [f"item {it.key} segment {it.seg} waits for "
                 f"{[n for n in self.seg_recvs[it.seg] if n not in self.arrived.get(it.key, {})]}"
                 for it in self.items.values()]
        if not self.is_reader:
            told = {t: sorted(s.announced) for t, s in self.steps.items()}
            waits.append(f"readers that announced each step: {told}; end steps from readers: {self.ends}")
        return "; ".join(waits) or f"no item in progress (pushed {self.flushed} steps)"

    def _drain(self) -> None:
        while (msg := self.inbox.recv(0)) is not None:
            self._handle(*msg)

    def _handle(self, h: dict, arrays: list) -> None:
        try:
            msg = parse(h, TO_TRAINER)
        except ProtocolError as e:
            raise RuntimeError(f"{self.name}: {e}") from None
        if isinstance(msg, Tensors):
            t0 = time.perf_counter()
            key = (msg.step, msg.origin, msg.mb)
            self.arrived.setdefault(key, {}).update(unpack_tensors(msg.descs, arrays))
            if self.rec.on:
                self.rec.span("recv", "comm", t0, time.perf_counter(), step=msg.step, reader=msg.origin,
                              mb=msg.mb, tensors=[d[0] for d in msg.descs],
                              bytes=sum(a.nbytes for a in arrays))
        elif isinstance(msg, Announce):  # a reader announces its items of a step (non-readers only)
            st = self._step(msg.step)
            st.announced.add(msg.origin)
            for m, size in msg.items:
                self.items[(msg.step, msg.origin, m)] = Item(msg.step, msg.origin, m, size, msg.global_size)
                st.items += 1
            self._prefetch(msg.step)
            self._maybe_flush()
        elif isinstance(msg, End):
            self.ends[msg.origin] = msg.step
            self._maybe_flush()
        else:
            self.grant, self.grant_final = msg.upto, msg.final

    def _step(self, t: int) -> StepState:
        st = self.steps.get(t)
        if st is None:
            st = self.steps[t] = StepState()
        return st

    # -- readers: steps and items ---------------------------------------------------------------
    def _announce(self) -> None:
        """Start the next step when the previous one's items have all started (sync: were pushed)."""
        if self.end is not None or any(it.seg == 0 for it in self.items.values()):
            return
        t = self.next_step
        if self.mode == "sync" and self.flushed < t:
            return
        limit = self.spec.steps
        if self.grant is not None and t >= self.grant:
            if not self.grant_final:
                return
            limit = t if limit is None else min(limit, t)
        got = None if limit is not None and t >= limit else next(self.batches, None)
        if got is None:
            self._finish_at(t)
            return
        batch, n, lo, hi = got  # rows [lo, hi) of batch are this reader's share of a global batch of n
        parts = sources.split(lo, hi, self.mb_count)
        st = self._step(t)
        per_dst: dict[str, list] = {}
        made = []
        for m, (a, b) in enumerate(parts):
            it = Item(t, self.index, m, b - a, n, sources.rows(batch, self.feeds, a, b))
            self.items[it.key] = it
            made.append(it)
            st.items += 1
            for dst in self.peers:
                per_dst.setdefault(self._endpoint(dst, it), []).append([m, b - a])
        self._prefetch_rows(t, made)
        self._prefetch(t)
        for dst in self.peers:
            for k in range(self.counts[dst]):
                ep = self.spec.endpoints[f"{dst}:{k}"]
                self.out.send(ep, header(Announce(t, self.index, n, per_dst.get(ep, []))))
        self._report(StepReport(self.name, t, len(parts), hi - lo, n))
        self.next_step = t + 1
        self._maybe_flush()

    def _prefetch_rows(self, t: int, items: list[Item]) -> None:
        """Pull the sparse rows the new items will look up, in one background round trip: for each
        lookup of `unique_ids(feed)`, the rows of the union of the items' ids (each item then takes
        its unique ids' rows from them), so ids shared by micro-batches travel once."""
        if not self.sparse_feeds or not items:
            return
        union = {x: np.unique(np.concatenate([np.ravel(it.feed[x]) for it in items]))
                 for x in {x for _, _, x in self.sparse_feeds}}
        fut = self.bg.submit(lambda c, r, step: c.pull_many(r, step=step),
                             [(table, union[x]) for table, _, x in self.sparse_feeds], self._ps_step(t))
        for it in items:
            for i, (table, u, x) in enumerate(self.sparse_feeds):
                self.rows_prefetch[(it.key, table, u)] = (fut, i, union[x])

    def _finish_at(self, t: int) -> None:
        self.end = t
        for dst in self.peers:
            for k in range(self.counts[dst]):
                self.out.send(self.spec.endpoints[f"{dst}:{k}"], header(End(t, self.index)))
        self._report(End(t, self.index, self.name))

    # -- scheduling -----------------------------------------------------------------------------
    def _runnable(self) -> Item | None:
        """The oldest item whose next segment has every message it receives."""
        in_flight = sum(1 for it in self.items.values() if it.seg > 0) if self.is_reader else 0
        best = None
        for it in self.items.values():
            if best is not None and (it.step, it.mb, it.origin) >= (best.step, best.mb, best.origin):
                continue
            if self.mode == "sync" and it.step > self.flushed:
                continue
            if it.seg == 0 and self.is_reader and in_flight >= self.mb_count:
                continue
            got = self.arrived.get(it.key, {})
            if all(n in got for n in self.seg_recvs[it.seg]):
                best = it
        return best

    def _run_segment(self, it: Item) -> None:
        t0, ps0, send0 = time.perf_counter(), self.stats["ps_s"], self.stats["send_s"]
        seg, outs = self.segs[it.seg], self.seg_outs[it.seg]
        got = self.exe.run(seg, feed=it.feed, fetch_list=outs, return_numpy=False, scope=it.env, ctx=it)
        it.env.update(zip(outs, got, strict=True))
        self._flush_sends(it)
        if self.rec.on:
            self.rec.span(f"segment {it.seg}", "compute", t0, time.perf_counter(), step=it.step,
                          reader=it.origin, mb=it.mb)
        it.seg += 1
        if it.seg == len(self.segs):
            self._item_done(it)
        spent = time.perf_counter() - t0
        self.stats["busy_s"] += spent - (self.stats["ps_s"] - ps0) - (self.stats["send_s"] - send0)

    def _flush_sends(self, it: Item) -> None:
        if not self.outgoing:
            return
        t0 = time.perf_counter()
        by_ep: dict[str, list] = {}
        for dst, name, value in self.outgoing:
            by_ep.setdefault(self._endpoint(dst, it), []).append((name, _host(value)))
        self.outgoing = []
        for ep, values in by_ep.items():
            t1 = time.perf_counter()
            descs, arrays = pack_tensors(values)
            self.out.send(ep, header(Tensors(it.step, it.origin, it.mb, descs)), arrays)
            if self.rec.on:
                self.rec.span("send", "comm", t1, time.perf_counter(), step=it.step, reader=it.origin,
                              mb=it.mb, to=self.peer_of[ep], tensors=[d[0] for d in descs],
                              bytes=sum(a.nbytes for a in arrays))
        self.stats["send_s"] += time.perf_counter() - t0

    def _item_done(self, it: Item) -> None:
        del self.items[it.key]
        self.arrived.pop(it.key, None)
        self.stats["items"] += 1
        st = self._step(it.step)
        if self.loss is not None:
            scores = [_host(it.env[n]).reshape(-1).astype(np.float32) for n in self.score or ()]
            st.reports.append((it.size, _host(it.env[self.loss]).item(), scores))
        st.done += 1
        self._maybe_flush()

    def _report_losses(self, t: int, reports: list) -> None:
        """The loss (and scores, labels) of each of a step's items, in one message to the driver."""
        arrays = []
        if self.score is not None:
            arrays = [np.concatenate([r[2][0] for r in reports]), np.concatenate([r[2][1] for r in reports])]
        self._report(Losses(self.name, t, [[n, loss] for n, loss, _ in reports]), arrays)

    def _complete(self, t: int) -> bool:
        st = self.steps.get(t)
        if self.is_reader:
            return st is not None and st.done == st.items and t < self.next_step
        if st is None:
            return False
        return len(st.announced) == self.counts[self.reader] and st.done == st.items

    def _maybe_flush(self) -> None:
        """Push the gradients of every completed step, in step order (on the background thread)."""
        while self._complete(self.flushed):
            st = self.steps.pop(self.flushed)
            self.prefetch.pop(self.flushed, None)
            grads = []
            for table, kind in self.pushed.items():
                spec = self.tables[table]
                if kind == "push_dense":
                    grad = st.grads.get(table)
                    grads.append((table, np.zeros(spec["shape"], spec["dtype"]) if grad is None else grad,
                                  None))
                    continue
                parts = st.rows.get(table, [])
                ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
                rows = (np.concatenate([p[1] for p in parts]) if parts
                        else np.zeros((0, spec["shape"][1]), spec["dtype"]))
                grads.append((table, rows, ids))
            if grads:
                fut = self.bg.submit(self._push_step, grads, self._ps_step(self.flushed))
                self.pushing.append((fut, list(st.grads.items())))
            if st.reports:
                self._report_losses(self.flushed, st.reports)
            self.flushed += 1
            self._prefetch(self.flushed)

    def _push_step(self, client: PSClient, grads: list, step: int | None) -> None:
        """A step's gradients, pushed on the background thread (its span lands on lane 1)."""
        t0 = time.perf_counter()
        client.push_many(grads, step=step)
        if self.rec.on:
            self.rec.span("push", "ps", t0, time.perf_counter(), step=step, tables=[g[0] for g in grads])

    def _ps_step(self, t: int) -> int | None:
        """The step number a PS request carries: sync servers order by it; async ones ignore it."""
        return t if self.mode == "sync" else None

    def _prefetch(self, t: int) -> None:
        """Pull step t's dense tables in the background (once). In sync mode only after step t-1 is
        pushed: the pull waits for that push, which must not queue behind it on the same thread."""
        if self.dense_tables and t not in self.prefetch and (self.mode != "sync" or t <= self.flushed):
            self.prefetch[t] = self.bg.submit(_pull_dense, self.dense_tables, self._ps_step(t))

    # -- op handlers ----------------------------------------------------------------------------
    def send(self, it: Item, dst: str, name: str, value: Any) -> None:
        self.outgoing.append((dst, name, value))

    def recv(self, it: Item, name: str) -> Any:
        v = self.arrived[it.key].pop(name)
        return v if self.xp is np else _device(self.xp, v)

    def pull_dense(self, it: Item, table: str) -> Any:
        st = self._step(it.step)
        if not st.dense:
            t0 = time.perf_counter()
            self._prefetch(it.step)
            got = self.prefetch[it.step].result()
            st.dense = got if self.xp is np else {k: self.xp.asarray(v) for k, v in got.items()}
            t1 = time.perf_counter()
            self.stats["ps_s"] += t1 - t0
            if self.rec.on:
                self.rec.span("pull dense", "ps", t0, t1, step=it.step, tables=list(got))
        return st.dense[table]

    def pull_sparse(self, it: Item, table: str, ids_name: str, ids: Any) -> Any:
        t0 = time.perf_counter()
        ids = _host(ids)
        fetched = self.rows_prefetch.pop((it.key, table, ids_name), None)
        if fetched is not None:
            fut, i, union = fetched
            rows = fut.result()[i].take(np.searchsorted(union, ids), axis=0)
        else:
            if self.mode == "sync":  # it waits for the previous step: first see that our push went in
                self.bg.settle()
            rows = self.client.pull(table, ids, step=self._ps_step(it.step))
        t1 = time.perf_counter()
        self.stats["ps_s"] += t1 - t0
        if self.rec.on:
            self.rec.span("pull sparse", "ps", t0, t1, step=it.step, reader=it.origin,
                          mb=it.mb, table=table, rows=len(rows))
        return rows if self.xp is np else self.xp.asarray(rows)

    def push_dense(self, it: Item, table: str, grad: Any) -> None:
        grad = _host(grad.to_dense(self.xp) if isinstance(grad, SparseRows) else grad)
        st = self._step(it.step)
        acc = st.grads.get(table)
        if acc is None:
            st.grads[table] = self._buffer(table, grad)
        else:
            acc += grad

    def _buffer(self, table: str, grad: np.ndarray) -> np.ndarray:
        """A copy of `grad` in a reused buffer: a step's dense gradients are summed in place into
        buffers that go back to a free list once their push has been answered (zmq no longer
        reads them), so steady training allocates no fresh multi-MB arrays (first-touch page
        faults cost more than the copy)."""
        done = [p for p in self.pushing if p[0].done()]
        for p in done:
            self.pushing.remove(p)
            for name, buf in p[1]:
                self.free_bufs.setdefault(name, []).append(buf)
        free = self.free_bufs.get(table)
        buf = free.pop() if free else np.empty_like(grad)
        np.copyto(buf, grad)
        return buf

    def push_sparse(self, it: Item, table: str, ids: Any, grad: Any) -> None:
        """Keep the row gradients for the step's push. A SparseRows over positions in Ids stays one
        row per lookup (ids repeat): the push merges the step's rows once, with a sort, instead of
        a scatter-add per micro-batch."""
        ids = _host(ids)
        if isinstance(grad, SparseRows):
            ids, grad = ids[_host(grad.rows)], grad.values
        self._step(it.step).rows.setdefault(table, []).append((ids, _host(grad)))


def _kept_outputs(segs: list[Program], report: list[str | None]) -> list[list[str]]:
    """Per segment, the outputs a later segment reads or the trainer reports (what an item keeps)."""
    later: set[str] = {n for n in report if n}
    kept = []
    for seg in reversed(segs):
        outs = dict.fromkeys(n for op in seg.ops for n in op.output_names())
        kept.append([n for n in outs if n in later])
        later.update(n for op in seg.ops for n in op.input_names())
    return kept[::-1]


def _device(xp: Any, v: Any) -> Any:
    if isinstance(v, SparseRows):
        return SparseRows(xp.asarray(v.rows), xp.asarray(v.values), v.height)
    return xp.asarray(v)


def run_trainer(spec: dict[str, Any]) -> None:
    """Entry point of a trainer process (see `Trainer`): `spec` is a `TrainerSpec.to_dict()`."""
    Trainer(TrainerSpec.from_dict(spec)).run()
