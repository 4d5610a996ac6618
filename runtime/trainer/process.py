"""The trainer process: one trainer of one type runs its sub-program over pipelined micro-batches.

Work is cut into *items*: micro-batch m of step t read by reader trainer o, keyed (t, o, m) in every
message. Reader trainers (those of the type that owns the data ops) take their rows of each global batch
(`sources.share`; a sharded dataset hands each reader its own rows: `sources.reader_batches`), split them
into `micro_batches` items, and announce each step's items to every trainer of the other types; an item's
tensors go to the trainer of the destination type that `route` picks, and its gradients come back the same
way. A trainer's sub-program runs as the segments the plan stores in it (`schedule.segments`: cut at
its recv ops and after what its sends need, by the segment-order pass — a backward segment's weight
gradients and pushes wait until its sends are out); it runs (item, segment) pairs as soon as the segment's
messages have arrived, oldest item first, with at most `micro_batches` of its own items in flight on a reader
(twice that in async mode: the next step's items too, `transpiler.config.items_in_flight`) — so a CPU trainer
computes item k+1's embeddings while the GPU trainer runs item k's MLP. With nothing runnable it blocks on its
inbox (a ZeroMQ poll), giving up after `stall_timeout` seconds without any message with an error saying what
it waits for: a run never hangs silently.

Units, each told what happens and keeping its own state: `steps.StepBook` (which steps exist, are granted,
complete, pushed, when the run ends), `ps_access.PSAccess` (prefetches, pulls, gradient buffers, one push
per step and table: see there for how parameter-server access goes), `Mail` (tensors between trainers;
`ipc.DeviceLinks` for those between two gpu trainers on one device, device to device), and
the one handler table of `runtime.exec.comm_ops` over those two, to which the Executor hands the item being
run as its ctx. Messages go to one handler per class.

The seed of the loss gradient (`fill_constant` into loss@GRAD) is scaled by item size / global batch size
(for a mean loss; 1 for a `reduce_sum` loss), so the accumulated gradients equal the gradient of the loss on
the whole global batch. In sync mode the server applies step t once every trainer pushed it, and a pull for
step t+1 waits for that; so a trainer starts step t+1 only after pushing step t (a pull of step t+1 must
never wait on its own push). Sync training then equals single-process training on the global batches. While
step t runs elsewhere, a sync reader with nothing to run reads step t + 1's batch, makes its items and sorts
its ids (`Ahead`), so that step t's push carries step t + 1's row pull (`PSAccess.push_step`) and the step
boundary costs one round trip to the servers. In async mode pulls do not wait and a reader may start the
next step while the previous one finishes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

from ops_registry import parallel
from runtime.data import sources
from runtime.driver.settings import TrainerSpec
from runtime.exec.comm_ops import comm_handlers, seeded_fill
from runtime.exec.device import CROSSINGS, array_module
from runtime.exec.device import to_host as _host
from runtime.exec.executor import Executor
from runtime.exec.graphs import DeviceGraphs
from runtime.ps import PSClient
from runtime.telemetry.outputs import Recorder, pack_spans, timed
from runtime.trainer.ipc import DeviceLinks
from runtime.trainer.mail import Item, Mail, route
from runtime.trainer.ps_access import PSAccess
from runtime.trainer.step_sort import id_bit_feeds
from runtime.trainer.steps import Ahead, StepBook
from runtime.transport.channels import Inbox, Outbox, pack_tensors, unpack_tensors
from runtime.transport.messages import (
    TO_TRAINER,
    Announce,
    DeviceOf,
    Done,
    End,
    Grant,
    ProtocolError,
    Ready,
    Released,
    StepReport,
    Tensors,
    WriteBack,
    header,
    parse,
)
from runtime.transport.process_id import by_kind
from runtime.transport.reports import ReportQueue
from transpiler.config import items_in_flight, kind_of
from transpiler.exporters.forward import score_names
from transpiler.ir import Program
from transpiler.passes.schedule import kept_outputs, segment_programs

__all__ = ["Item", "Trainer", "route", "run_trainer"]


class Trainer:
    """One trainer; `spec` is built by the driver (`runtime.driver.train`)."""

    def __init__(self, spec: TrainerSpec) -> None:
        self.spec, self.name, self.index = spec, spec.name, spec.index
        self.counts, self.is_reader, self.mb_count = spec.counts, spec.is_reader, spec.micro_batches
        self.in_flight_max = items_in_flight(spec.mode, spec.micro_batches)
        self.xp, _ = array_module(spec.type, spec.device_map, spec.allow_emulation, announce=False)
        self.program = Program.from_json(spec.program)
        self.segs = segment_programs(self.program)  # its stored run segments (passes/segment_order.py)
        self.seg_recvs = [[op.attrs["tensor"] for op in seg.ops if op.type == "recv"] for seg in self.segs]
        self.feeds = self.program.attrs.get("feeds", [])
        self.id_bits = id_bit_feeds(self.program, spec.tables)  # uint64 ids >= 2^63 allowed (unbounded)
        self.loss = spec.loss if spec.loss in self.program.vars else None
        self.score = score_names(self.program) if self.loss else None  # reported for the AUC
        self.seg_outs = kept_outputs(self.segs, [self.loss, *(self.score or [])])
        self.peers = [t for t in self.counts if t != spec.reader]
        self.peer_of = {ep: name for name, ep in spec.endpoints.items()}
        self.endpoints_of = by_kind(spec.endpoints)  # type -> its trainers' inboxes, by index
        self.peer_eps = [ep for t in self.peers for ep in self.endpoints_of[t]]  # (in type, index order)
        self.stats = {"busy_s": 0.0, "ps_s": 0.0, "wait_s": 0.0, "send_s": 0.0, "items": 0}
        self.rec = Recorder(spec.trace)  # timeline spans (runtime.telemetry.outputs), when asked
        self.book = StepBook(
            self.name, self.is_reader, self.counts[spec.reader], spec.start, spec.grant, spec.steps
        )
        self.ps = PSAccess(
            self.program,
            spec.tables,
            spec.mode,
            self.xp,
            self.book,
            self.stats,
            self.rec,
            spec.held,
            spec.device_graphs,
        )
        self.ps.clip_lead = self.name == next(iter(spec.endpoints))
        self.mail = Mail(self.xp)
        # the gpu trainers of the other types; those on this device get tensors device to device
        # (runtime/trainer/ipc.py)
        self.gpu_peers = self._gpu_peers()
        copies = self.mail.copies
        self.links = DeviceLinks(self.xp, copies.stream, self.name) if copies and self.gpu_peers else None
        self.later: list = []  # messages read while waiting for a device buffer back, handled next
        handlers = {**comm_handlers(self.mail), **comm_handlers(self.ps)}
        graphs = DeviceGraphs(self.xp) if self.xp is not np and spec.device_graphs else None
        self.exe = Executor(
            self.xp, handlers={**handlers, "fill_constant": self._seed_fill(spec)}, graphs=graphs
        )
        parallel.set_threads(spec.kernel_threads)  # its large matrix products over this many threads
        self.items: dict[tuple[int, int, int], Item] = {}
        self.batches: Iterator | None = None  # a reader's share of the data
        self.ahead: Ahead | None = None  # sync reader: the next step, read while this one runs
        self.inbox: Inbox | None = None
        self.out: Outbox | None = None

    def _seed_fill(self, spec: TrainerSpec) -> Any:
        """`fill_constant`: for a mean loss, the loss gradient's seed scaled by item / global batch."""
        out = [f"{self.loss}@GRAD"]
        seeds = [
            op.id for op in self.program.ops if op.type == "fill_constant" and op.outputs.get("Out") == out
        ]
        seed = seeds[0] if seeds and spec.loss_reduction == "mean" else None
        return seeded_fill(self.xp, seed, lambda it, v: v * it.size / it.global_size)

    # -- wiring ---------------------------------------------------------------------------------
    def _connect(self) -> None:
        s = self.spec
        self.inbox = Inbox(s.endpoints[self.name], s.links)
        self.out = Outbox(s.links, patient=[s.driver])  # (a stopped driver still gets the last reports)
        self.reports = ReportQueue(self.out, s.driver, self.name, s.report_s)
        self.ps.connect(
            lambda: PSClient(s.ps, client_key=s.ps_key, timeout=s.stall_timeout, pusher=self.name)
        )
        self.ps.prefetch_dense(self.book.flushed)
        self._meet_gpu_peers()
        if self.is_reader:
            self.batches = sources.reader_batches(
                s.data, s.batch_size, s.epochs, self.index, self.counts[s.type], start=self.book.flushed
            )

    def _gpu_peers(self) -> list[str]:
        """A gpu trainer's gpu peers of the other types (none for a cpu trainer)."""
        s = self.spec
        if kind_of(s.type, s.device_map) != "gpu":
            return []
        return [
            self.peer_of[ep]
            for t, eps in self.endpoints_of.items()
            if t != s.type and kind_of(t, s.device_map) == "gpu"
            for ep in eps
        ]

    def _meet_gpu_peers(self) -> None:
        """A gpu trainer tells the gpu trainers of the other types which device it is on (`DeviceOf`;
        "" for none, or no CUDA IPC) and, with a device, waits until each told it theirs: tensors
        between two on one device then go device to device from the first (runtime/trainer/ipc.py)."""
        s, peers = self.spec, self.gpu_peers
        for name in peers:
            self.out.send(
                s.endpoints[name], header(DeviceOf(self.name, self.links.key if self.links else ""))
            )
        deadline = time.monotonic() + s.stall_timeout
        while self.links is not None and (missing := [n for n in peers if n not in self.links.peer_keys]):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"{self.name}: gpu trainer(s) {missing} did not say which device they are on in "
                    f"{s.stall_timeout:g} s (each gpu trainer tells the others at its start)"
                )
            got = self.inbox.recv_leased(timeout_ms=min(left, 1.0) * 1000)
            if got is not None and got[0].get("k") == DeviceOf.KIND:
                self._handle(*got)
            elif got is not None:
                self.later.append(got)  # (handled once the run starts: `_drain`)

    def _endpoint(self, dst_type: str, item: Item) -> str:
        idx = route(self.counts, self.spec.reader, dst_type, item.origin, item.mb, self.mb_count)
        return self.endpoints_of[dst_type][idx]

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self._connect()
        start, cpu0 = time.perf_counter(), time.process_time()
        self.reports.now(Ready(self.name))
        try:
            self._loop()
            self.ps.write_back()  # (closes the background thread first)
            self.stats["wall_s"] = time.perf_counter() - start
            self.stats["cpu_s"] = time.process_time() - cpu0
            self.stats["ring_full"] = self.out.ring_full()  # (messages that found no room in shared memory)
            self.stats["kernel_threads"] = parallel.threads()
            self.stats["refused_messages"] = self.inbox.refused  # (unsigned or replayed: skipped)
            self.stats["refused_connections"] = self.inbox.refused_connections  # (no link key)
            if self.xp is not np:  # host <-> device copies (runtime.exec.device.Crossings)
                self.stats.update(CROSSINGS.as_dict())
            if self.links is not None:  # device-to-device tensors (runtime/trainer/ipc.py)
                self.stats.update(self.links.stats())
            if self.exe.graphs is not None:  # (runtime.exec.graphs.GraphStats)
                self.stats.update(self.exe.graphs.stats.as_dict())
            if self.ps.kept is not None and self.ps.kept.graphed is not None:
                self.stats.update(self.ps.kept.graphed.stats.as_dict("held_"))
            spans = [pack_spans(self.rec.take())] if self.rec.on else []
            self.reports.now(Done(self.name, self.stats), spans)
        finally:
            if self.links is not None:
                self.links.receiver.close()
            self.out.close()
            self.ps.close()
            self.inbox.close()

    def _loop(self) -> None:
        parent, last = os.getppid(), time.perf_counter()
        while not self.book.finished():
            self.ps.bg.check()
            self._drain()
            if self.is_reader:
                self._announce()
            job = self._runnable()
            if job is not None:
                self._run_segment(job)
                continue
            if self._read_ahead() or self.book.finished():  # `_drain`/`_announce` may have ended the run
                continue
            self.ps.send_deferred()  # (a push kept for the next row pull: the trainer waits now)
            self._release_slots(block=True)  # (idle: a peer's device buffers go back now)
            due = self.reports.due_in()  # (idle with step reports kept: they go when due)
            with timed("wait", "wait", rec=self.rec, stats=self.stats, key="wait_s") as span:
                msg = self.inbox.recv_leased(timeout_ms=1000 if due is None else due * 1000)
                span.args["timed_out"] = msg is None and due is None
            if msg is not None:
                self._handle(*msg)
                last = time.perf_counter()
            elif due is not None:
                self.reports.flush()
            elif os.getppid() != parent:
                raise SystemExit(f"{self.name}: the driver process is gone")
            elif time.perf_counter() - last > self.spec.stall_timeout:
                raise RuntimeError(
                    f"{self.name}: no message for {self.spec.stall_timeout} s; " + self._waiting_for()
                )

    def _waiting_for(self) -> str:
        waits = [
            f"item {it.key} segment {it.seg} waits for {self.mail.missing(it, self.seg_recvs[it.seg])}"
            for it in self.items.values()
        ]
        if not self.is_reader:
            waits.append(self.book.describe())
        if self.inbox.refused:
            waits.append(f"{self.inbox.refused} message(s) refused, the last: {self.inbox.last_refused}")
        return "; ".join(waits) or f"no item in progress (pushed {self.book.flushed} steps)"

    def _drain(self) -> None:
        while self.later:
            self._handle(*self.later.pop(0))
        while (msg := self.inbox.recv_leased(0)) is not None:
            self._handle(*msg)

    def _handle(self, h: dict, arrays: list, release: Any = None) -> None:
        """Handle one message; `release` (of one read in place from shared memory) once it is read."""
        try:
            msg = parse(h, TO_TRAINER)
        except ProtocolError as e:
            raise RuntimeError(f"{self.name}: {e}") from None
        if type(msg) is Tensors:  # (its arrays are read in place until the step is pushed)
            self._on_tensors(msg, arrays, release)
            return
        handler = self._CONTROL.get(type(msg))
        if handler is None:
            known = sorted(c.__name__ for c in (Tensors, *self._CONTROL))
            raise ProtocolError(f"{self.name}: no handler for {type(msg).__name__}; it handles {known}")
        handler(self, msg)
        if release is not None:
            release()

    def _on_tensors(self, msg: Tensors, arrays: list, release: Any) -> None:
        """One item's tensors from a peer, kept for the item's recv ops."""
        if release is not None:
            self.book.lease(msg.step, release)
        with timed("recv", "comm", rec=self.rec, step=msg.step, reader=msg.origin, mb=msg.mb) as t:
            tensors = unpack_tensors(msg.descs, arrays)
            if msg.dev is not None:  # (a gpu peer's device buffers: copied out device to device)
                if self.links is None:
                    raise ProtocolError(f"{self.name}: device tensors reached a trainer without a device")
                tensors.update(self.links.receiver.take(msg.dev)[1])
            self.mail.deliver((msg.step, msg.origin, msg.mb), tensors)
            if msg.dev is not None:
                self._release_slots()
            if t.recording:
                t.args.update(tensors=[d[0] for d in msg.descs], bytes=sum(a.nbytes for a in arrays))

    def _on_announce(self, msg: Announce) -> None:
        """A reader announces its items of a step (to non-readers only)."""
        self.book.announce(msg.step, msg.origin, len(msg.items))
        for m, size in msg.items:
            self.items[(msg.step, msg.origin, m)] = Item(msg.step, msg.origin, m, size, msg.global_size)
        self.ps.prefetch_dense(msg.step)
        self._maybe_flush()

    def _on_end(self, msg: End) -> None:
        """A reader runs no step >= msg.step."""
        self.book.reader_ended(msg.origin, msg.step)
        self._maybe_flush()

    def _on_device_of(self, msg: DeviceOf) -> None:
        """A gpu peer says which device it is on (`runtime.trainer.ipc.device_key`)."""
        if self.links is not None:
            self.links.peer_keys[msg.who] = msg.key

    def _on_released(self, msg: Released) -> None:
        """A gpu peer copied out device buffers this trainer sent it."""
        if self.links is None or self.links.sender is None:
            raise ProtocolError(f"{self.name}: {msg.who} released device buffers this trainer has not")
        self.links.sender.release(msg.who, msg.slots)

    def _release_slots(self, block: bool = False) -> None:
        """Hand the peers' device buffers copied out (all of them with `block`) back to them."""
        if self.links is not None and self.links.receiver.pending:
            for sender, slots in self.links.receiver.releasable(block).items():
                ep = self.spec.endpoints.get(sender)
                if ep is None:
                    raise ProtocolError(
                        f"{self.name}: device tensors from {sender!r}, not a trainer of this run"
                    )
                self.out.send(ep, header(Released(self.name, slots)))

    def _await_release(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for a message while a device buffer a peer holds is needed: a
        `Released` or `Tensors` one is handled now (so two gpu trainers waiting for each other's
        buffers both go on), any other later (`_drain`)."""
        self._release_slots(block=True)
        got = self.inbox.recv_leased(timeout_ms=timeout_s * 1000)
        if got is None:
            return
        if got[0].get("k") in (Released.KIND, Tensors.KIND):
            self._handle(*got)
        else:
            self.later.append(got)

    # the handlers of the messages other than Tensors, by class (`_handle`)
    _CONTROL: ClassVar[dict[type, Callable[[Trainer, Any], None]]] = {
        DeviceOf: _on_device_of,
        Released: _on_released,
        Announce: _on_announce,
        End: _on_end,
        WriteBack: lambda self, msg: self.ps.write_back(msg.step),
        Grant: lambda self, msg: self.book.grant(msg.upto, msg.final),
    }

    # -- readers: steps and items ---------------------------------------------------------------
    def _announce(self) -> None:
        """Start the next step when the previous one's items have all started (sync: were pushed)."""
        book = self.book
        if book.end is not None or any(it.seg == 0 for it in self.items.values()):
            return
        t = book.next_step
        if self.spec.mode == "sync" and book.flushed < t:
            return
        ahead = self.ahead if self.ahead is not None and self.ahead.step == t else self._make_ahead(t)
        if ahead is None:  # not granted yet
            return
        self.ahead = None
        if ahead.got is None:
            self._finish_at(t)
            return
        _, n, lo, hi = ahead.got  # rows [lo, hi) of batch are this reader's share of a global batch of n
        made = ahead.items
        book.start(t, len(made))
        self.items.update((it.key, it) for it in made)
        self.ps.prefetch_rows(t, made)  # (nothing when the previous step's push asked for them)
        self.ps.prefetch_dense(t)
        per_dst: dict[str, list] = {}
        for it in made:
            for dst in self.peers:
                per_dst.setdefault(self._endpoint(dst, it), []).append([it.mb, it.size])
        for ep in self.peer_eps:
            self.out.send(ep, header(Announce(t, self.index, n, per_dst.get(ep, []))))
        self.reports.step(StepReport(self.name, t, len(made), hi - lo, n))
        self._maybe_flush()

    def _make_ahead(self, t: int) -> Ahead | None:
        """Step t's share of a global batch and its items; None while step t is not granted."""
        if not self.book.granted(t):
            return None
        got = None if self.book.ends_before(t) else next(self.batches, None)
        return Ahead(t, got, self._make_items(t, *got) if got is not None else [])

    def _read_ahead(self) -> bool:
        """Sync reader with nothing to run while its step runs elsewhere: read the next step's batch,
        make its items and sort its ids now, so the step boundary only pulls rows (with the push)."""
        book, t = self.book, self.book.next_step
        if not self.is_reader or self.spec.mode != "sync" or self.ahead is not None or book.end is not None:
            return False
        if book.flushed >= t:  # no step in progress: the next one starts now (`_announce`)
            return False
        with timed("read ahead", "compute", rec=self.rec, stats=self.stats, key="busy_s", step=t) as span:
            self.ahead = self._make_ahead(t)
            if self.ahead is None:
                span.skip()
            elif self.ahead.items:
                self.ps.sort_rows(t, self.ahead.items)
        return self.ahead is not None

    def _make_items(self, t: int, batch: dict, n: int, lo: int, hi: int) -> list[Item]:
        sources.check_values(batch, self.feeds, lo, hi, t, self.id_bits)
        return [
            Item(t, self.index, m, b - a, n, sources.rows(batch, self.feeds, a, b, self.id_bits))
            for m, (a, b) in enumerate(sources.split(lo, hi, self.mb_count))
        ]

    def _finish_at(self, t: int) -> None:
        self.book.end_at(t)
        for ep in self.peer_eps:
            self.out.send(ep, header(End(t, self.index)))
        self.reports.now(End(t, self.index, self.name))

    # -- scheduling -----------------------------------------------------------------------------
    def _runnable(self) -> Item | None:
        """The oldest item whose next segment has every message it receives."""
        in_flight = sum(1 for it in self.items.values() if it.seg > 0) if self.is_reader else 0
        sync, best = self.spec.mode == "sync", None
        for it in self.items.values():
            if best is not None and (it.step, it.mb, it.origin) >= (best.step, best.mb, best.origin):
                continue
            if sync and it.step > self.book.flushed:
                continue
            if it.seg == 0 and self.is_reader and in_flight >= self.in_flight_max:
                continue
            if not self.mail.missing(it, self.seg_recvs[it.seg]):
                best = it
        return best

    def _run_segment(self, it: Item) -> None:
        """Run the item's next segment; its time, less PS calls and sends, counts as busy."""
        ps0, send0 = self.stats["ps_s"], self.stats["send_s"]
        with timed(stats=self.stats, key="busy_s"):
            with timed(
                f"segment {it.seg}", "compute", rec=self.rec, step=it.step, reader=it.origin, mb=it.mb
            ):
                seg, outs = self.segs[it.seg], self.seg_outs[it.seg]
                got = self.exe.run(
                    seg, feed=it.feed, fetch_list=outs, return_numpy=False, scope=it.env, ctx=it
                )
                it.env.update(zip(outs, got, strict=True))
                self._flush_sends(it)
            it.seg += 1
            if it.seg == len(self.segs):
                self._item_done(it)
        self.stats["busy_s"] -= (self.stats["ps_s"] - ps0) + (self.stats["send_s"] - send0)

    def _flush_sends(self, it: Item) -> None:
        if not self.mail.outgoing:
            return
        with timed(stats=self.stats, key="send_s"):
            host: list[tuple[str, str, Any]] = []  # (endpoint, name, value)
            direct: dict[str, list] = {}  # to gpu peers on this device: device to device
            for dst, name, value in self.mail.take_outgoing():
                ep = self._endpoint(dst, it)
                if self.links is not None and self.links.direct(self.peer_of[ep], value):
                    direct.setdefault(ep, []).append((name, value))
                else:
                    host.append((ep, name, value))
            by_ep: dict[str, list] = {ep: [] for ep, *_ in host}
            for (ep, name, _), value in zip(host, self.mail.to_host_all([v for *_, v in host]), strict=True):
                by_ep[ep].append((name, value))
            for ep in {**by_ep, **direct}:
                self._send_tensors(it, ep, by_ep.get(ep, []), direct.get(ep))

    def _send_tensors(self, it: Item, ep: str, values: list, direct: list | None) -> None:
        """One message of item `it`'s tensors to `ep`: `values` on the host, `direct` (device
        arrays) through device buffers (runtime/trainer/ipc.py)."""
        where = {"step": it.step, "reader": it.origin, "mb": it.mb, "to": self.peer_of[ep]}
        with timed("send", "comm", rec=self.rec, **where) as t:
            dev = None
            if direct:
                dev = self.links.sender.send(
                    self.peer_of[ep], direct, self._await_release, self.spec.stall_timeout
                )
            descs, arrays = pack_tensors(values)
            self.out.send(ep, header(Tensors(it.step, it.origin, it.mb, descs, dev)), arrays)
            if t.recording:
                t.args.update(tensors=[d[0] for d in descs], bytes=sum(a.nbytes for a in arrays))
                if direct:
                    t.args.update(device_tensors=[n for n, _ in direct])

    def _item_done(self, it: Item) -> None:
        del self.items[it.key]
        self.mail.forget(it.key)
        self.stats["items"] += 1
        report = None
        if self.loss is not None:
            report = self._report(it)
        self.book.item_done(it.step, report)
        self._maybe_flush()

    def _report(self, it: Item) -> tuple[int, float, list]:
        """(size, loss, [scores, labels]) of a finished item; on a device, off it in one copy (the
        loss and the item's scores and labels as one array of the loss's dtype)."""
        loss, scores = it.env[self.loss], [it.env[n] for n in self.score or ()]
        if self.xp is np:
            return it.size, np.asarray(loss).item(), [np.ravel(v).astype(np.float32) for v in scores]
        xp = self.xp
        one = _host(xp.concatenate([xp.ravel(v).astype(loss.dtype) for v in (loss, *scores)]))
        parts = np.split(one, np.cumsum([loss.size, *(v.size for v in scores)])[:-1])
        return it.size, parts[0].item(), [v.astype(np.float32) for v in parts[1:]]

    def _maybe_flush(self) -> None:
        """Push the gradients of every completed step, in step order (on the background thread)."""
        book = self.book
        while (st := book.to_push()) is not None:
            t = book.flushed
            ahead = self.ahead.items if self.ahead and self.ahead.step == t + 1 else []
            self.ps.push_step(t, st, ahead)
            st.release_leases()  # (the push is made: nothing reads the step's messages now)
            self._release_lanes(t)
            if st.reports:
                self.reports.losses(t, st.reports)
            book.complete(t)
            self.ps.prefetch_dense(t + 1)

    def _release_lanes(self, t: int) -> None:
        """Step t is pushed (its held tables' step applied): nothing reads what its items' graphs
        handed out (the held tables' gradients among it) any more, so their lanes are free."""
        graphs = self.exe.graphs
        if graphs is not None:
            for key in [k for k in graphs.lanes if k[0] <= t]:  # (an Item's key: (step, origin, mb))
                graphs.release(key)


def run_trainer(spec: dict[str, Any]) -> None:
    """Entry point of a trainer process (see `Trainer`): `spec` is a `TrainerSpec.to_dict()`."""
    Trainer(TrainerSpec.from_dict(spec)).run()
