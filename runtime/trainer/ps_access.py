"""A trainer's parameter-server access: prefetches, per-item pulls, gradient buffers, step pushes.

Per step (see `runtime.trainer.process` for the whole picture; a dense table the trainer holds, ps/hold.py:
its own copy, to which `push_step` applies the step):
- dense tables are pulled once per step, all at once, by a background thread as soon as the step is
  known (announced) or the previous one pushed, whichever comes first (prefetch; in sync mode the
  reply waits until the server has applied the previous step, in async mode it may miss it);
- sparse rows are pulled for the item's unique ids: a reader pulls the rows of all of a step's items
  (the union of their ids) in one background round trip when it announces the step, when a
  lookup's ids come straight from a feed, as embedding lookups' do; other pulls happen per item
  when their op runs;
- gradients are accumulated over all of the step's items and pushed once per step and table — zeros
  when the trainer got no item — so a sync server sees exactly one push per trainer per step; the
  background thread pushes them, so the trainer goes on with the next step's work meanwhile;
- in sync mode step t's push and step t + 1's pulls are one request (`PSClient.push_pull`; the
  server answers once step t is applied): the dense tables and, when a reader has already made
  step t + 1's items (it reads ahead while step t runs elsewhere), their rows — so a sync step
  boundary costs one round trip; in async mode a reader keeps step t's push until it pulls the
  rows of its next step (`send_deferred`: at once when it is about to wait), one request too;
- with gradient clipping by global norm (tables with `clip_norm`), the run's first trainer then
  asks the servers for the step's norm and has them apply the scaled gradients (runtime/ps/clip.py).
`PSAccess` implements the parameter-server methods of a `comm_ops.CommBackend` (ctx = the item).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from ops_registry import SparseRows, get_op
from runtime.exec.device import to_device
from runtime.exec.device import to_host as _host
from runtime.ps import PSClient
from runtime.ps.held_tables import HeldTables
from runtime.telemetry.outputs import Recorder, timed
from runtime.trainer.background import Background, Prefetch, pull_task
from runtime.trainer.step_sort import StepSort, feed_of_table, sparse_feeds
from runtime.trainer.steps import StepBook, StepState
from transpiler.ir import Program
from transpiler.show_click import ShowClick, show_click_of
from transpiler.tables import TableSpec


class PSAccess:
    """The parameter-server side of one trainer (see the module docstring)."""

    def __init__(
        self,
        program: Program,
        tables: list[TableSpec],
        mode: str,
        xp: Any,
        book: StepBook,
        stats: dict[str, float],
        rec: Recorder,
        held: list[str] = (),
        graphs: bool = False,
    ) -> None:
        self.xp, self.mode, self.book, self.stats, self.rec = xp, mode, book, stats, rec
        self.graphs = graphs and xp is not np  # the held tables' step as a CUDA graph
        self.tables = {t.name: t for t in tables}
        self.held, self.kept = list(held), None  # dense tables this trainer keeps (ps/hold.py)
        self.pushed = {
            op.attrs["table"]: op.type
            for op in program.ops
            if op.type in ("push_dense", "push_sparse") and op.attrs["table"] not in self.held
        }
        self.dense_tables = list(
            dict.fromkeys(
                op.attrs["table"]
                for op in program.ops
                if op.type == "pull_dense" and op.attrs["table"] not in self.held
            )
        )
        self.sparse_feeds = sparse_feeds(program, program.attrs.get("feeds", []))
        self.prefetch: dict[int, Prefetch] = {}  # step -> its dense tables' pull
        self.rows_prefetch: dict[tuple, tuple[Prefetch, np.ndarray]] = {}  # (item, table, ids) -> pull
        self.feed_of = feed_of_table(self.sparse_feeds)
        self.step_sorts: dict[tuple[int, str], StepSort] = {}  # (step, feed) -> its ids' one sort
        self.pushing: list[tuple[Future, list[tuple[str, np.ndarray]]]] = []  # pushes in flight + buffers
        self.free_bufs: dict[str, list[np.ndarray]] = {}
        # an async reader's step push, kept to go with its next row pull: (step, grads, buffers)
        self.deferred: tuple[int, list, list] | None = None
        self.defer_push = mode == "async" and bool(self.sparse_feeds)
        self.client: PSClient | None = None
        self.bg: Background | None = None
        clipped = [t for t in tables if t.clip_norm is not None]
        self.clip = (float(clipped[0].clip_norm), clipped[0].dtype) if clipped else None
        self.clip_lead = False  # the run's first trainer clips each step (PSClient.clip_step)
        self.show_click = show_click_of(program)  # tables whose pushes carry (show, click) per id

    def connect(self, make_client: Callable[[], PSClient]) -> None:
        self.client = make_client()
        self.bg = Background(make_client)
        if self.held:
            sync = self.mode == "sync"
            self.kept = HeldTables(self.client, self.held, self.book.flushed, sync, self.xp, self.graphs)

    def write_back(self, before: int | None = None) -> None:
        """Write the held tables back once the steps < `before` are pushed (a pause, which the driver
        waits for); None: now and for good (the run's end: after the background thread's last push)."""
        self.send_deferred()
        if before is None:
            self.bg.close()
        if self.kept is not None:
            self.kept.due = (self.book.flushed if before is None else before, before is None)
            self.kept.write_back_due(self.client, self.book.flushed, self.rec)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def ps_step(self, t: int) -> int | None:
        """The step number a PS request carries: sync servers order by it; async ones ignore it."""
        return t if self.mode == "sync" else None

    # -- prefetches -----------------------------------------------------------------------------
    def prefetch_dense(self, t: int) -> None:
        """Pull step t's dense tables in the background (once). In sync mode only after step t-1 is
        pushed: the pull waits for that push, which must not queue behind it on the same thread
        (`push_step` fuses the two into one request)."""
        if self.dense_tables and t not in self.prefetch and (self.mode != "sync" or t <= self.book.flushed):
            self.prefetch[t] = Prefetch(self.bg.submit(pull_task, self._dense_pulls(), self.ps_step(t)))

    def _dense_pulls(self) -> list[tuple[str, None]]:
        return [(table, None) for table in self.dense_tables]

    def sort_rows(self, t: int, items: list[Any]) -> None:
        """The one sort of step t's ids of each prefetched feed (a `StepSort`), made once: for the
        rows the items will look up and, later, to merge the step's row gradients for the push."""
        for x in {x for _, _, x in self.sparse_feeds}:
            if (t, x) not in self.step_sorts:
                self.step_sorts[(t, x)] = StepSort.of(items, x)

    def _row_pulls(self, t: int) -> list[tuple[str, np.ndarray]]:
        """For each lookup of `unique_ids(feed)`: its table and the union of step t's ids of the feed."""
        return [(table, self.step_sorts[(t, x)].merge.unique_rows) for table, _, x in self.sparse_feeds]

    def _expect_rows(
        self, items: list[Any], pulls: list[tuple[str, np.ndarray]], fut: Future, at: int
    ) -> None:
        """The items' lookups take their rows from `pulls`, the arrays of `fut` from `at` on."""
        for i, (table, u, _) in enumerate(self.sparse_feeds):
            for it in items:
                self.rows_prefetch[(it.key, table, u)] = (Prefetch(fut, at + i), pulls[i][1])

    def prefetch_rows(self, t: int, items: list[Any]) -> None:
        """Pull the sparse rows the new items will look up, in one background round trip: for each
        lookup of `unique_ids(feed)`, the rows of the union of the items' ids (each item then takes
        its unique ids' rows from them), so ids shared by micro-batches travel once. Nothing when
        `push_step` has already asked for them (with the previous step's push)."""
        if not self.sparse_feeds or not items or self._rows_asked(items):
            return
        self.sort_rows(t, items)
        pulls = self._row_pulls(t)
        if self.deferred is not None:  # async: the last step's push and these rows, one request
            step, grads, bufs = self.deferred
            self.deferred = None
            fut = self.bg.submit(self._push_and_pull, grads, pulls, step)
            self.pushing.append((fut, bufs))
        else:
            fut = self.bg.submit(pull_task, pulls, self.ps_step(t))
        self._expect_rows(items, pulls, fut, 0)

    def send_deferred(self) -> None:
        """Push the step kept for the next row pull now (the trainer is about to wait, or ends)."""
        if self.deferred is not None:
            _, grads, bufs = self.deferred
            self.deferred = None
            self.pushing.append((self.bg.submit(self._push, grads, None), bufs))

    def _rows_asked(self, items: list[Any]) -> bool:
        table, u, _ = self.sparse_feeds[0]
        return (items[0].key, table, u) in self.rows_prefetch

    # -- op handlers (comm_ops.CommBackend) -----------------------------------------------------
    def unique_ids(self, it: Any, ids_name: str, ids: Any) -> dict[str, Any]:
        """`unique_ids` of a prefetched feed: the item's part of its step's one sort
        (`RowMerge.part`: no sort of its own; with one item per step, the step's sort itself);
        anything else: the registry's kernel."""
        sort = self.step_sorts.get((it.step, ids_name)) if self.xp is np else None
        got = sort.unique_ids(it.key, ids) if sort is not None else None
        return got if got is not None else get_op("unique_ids").kernel(self.xp, {"Ids": ids}, {})

    def pull_dense(self, it: Any, table: str) -> Any:
        st = self.book.step(it.step)
        if table in st.dense:
            return st.dense[table]
        if table in self.held:  # this trainer's own copy, as it is after the steps it has pushed
            got = {table: self.kept.pull(table, it.step)}
        else:
            with timed("pull dense", "ps", rec=self.rec, stats=self.stats, key="ps_s", step=it.step) as t:
                self.prefetch_dense(it.step)
                tables = self.dense_tables
                got = dict(zip(tables, self.prefetch[it.step].arrays(len(tables)), strict=True))
                t.args["tables"] = list(got)
        st.dense.update(got if self.xp is np else {k: to_device(self.xp, v) for k, v in got.items()})
        return st.dense[table]

    def pull_sparse(self, it: Any, table: str, ids_name: str, ids: Any) -> Any:
        with timed(
            "pull sparse",
            "ps",
            rec=self.rec,
            stats=self.stats,
            key="ps_s",
            step=it.step,
            reader=it.origin,
            mb=it.mb,
            table=table,
        ) as t:
            ids = _host(ids)
            fetched = self.rows_prefetch.pop((it.key, table, ids_name), None)
            if fetched is not None:
                pulled, union = fetched
                rows = pulled.arrays(1)[0]
                if ids is not union:  # the item's unique ids are a subset of the step's
                    rows = rows.take(np.searchsorted(union, ids), axis=0)
            else:
                if self.mode == "sync":  # it waits for the previous step: first see that our push went in
                    self.bg.settle()
                rows = self.client.pull(table, ids, step=self.ps_step(it.step))
            t.args["rows"] = len(rows)
        return to_device(self.xp, rows)

    def push_dense(self, it: Any, table: str, grad: Any) -> None:
        """Accumulate the step's gradient of `table`: on the host for the servers, where it was made
        (the device, on a gpu trainer) for a table this trainer holds."""
        grad = grad.to_dense(self.xp) if isinstance(grad, SparseRows) else grad
        if table not in self.held:
            grad = _host(grad)
        st = self.book.step(it.step)
        acc = st.grads.get(table)
        if acc is None:  # the op's own output (or its graph's buffer, lent until the push): no copy
            st.grads[table] = grad
        elif table not in st.summed:  # a second one: sum in a buffer of ours
            st.grads[table] = self._buffer(table, acc)
            st.grads[table] += grad
            st.summed.add(table)
        else:
            acc += grad

    def push_sparse(self, it: Any, table: str, ids: Any, grad: Any) -> None:
        """Keep the row gradients for the step's push. A SparseRows over positions in Ids stays one
        row per lookup (ids repeat): the push merges the step's rows once, with a sort, instead of
        a scatter-add per micro-batch."""
        ids = _host(ids)
        if isinstance(grad, SparseRows):
            ids, grad = ids[_host(grad.rows)], grad.values
        st, grad = self.book.step(it.step), _host(grad)
        if table in self.show_click and it.key not in st.shows.setdefault(table, {}):
            st.shows[table][it.key] = occurrences(self.show_click[table], it.feed)
        x = self.feed_of.get(table)
        fed = st.fed_rows.setdefault(table, {})
        if (
            (it.step, x) in self.step_sorts
            and it.key not in fed  # a second gradient of the table from this item: the general path
            and np.array_equal(ids, np.ravel(it.feed[x]))
        ):
            fed[it.key] = (ids, grad)  # a row per lookup of the feed
        else:
            st.rows.setdefault(table, []).append((ids, grad))

    @staticmethod
    def _buffers(st: StepState) -> list[tuple[str, np.ndarray]]:
        """The step's gradient buffers of ours (sums), reusable once its push is answered."""
        return [(name, st.grads[name]) for name in st.summed if name in st.grads]

    def _buffer(self, table: str, grad: np.ndarray) -> np.ndarray:
        """A copy of `grad` in a reused buffer: a step's dense gradients of a table from several
        items are summed in place into a buffer that goes back to a free list once its push has
        been answered (zmq no longer reads it), so steady training allocates no fresh multi-MB
        arrays (first-touch page faults cost more than the copy). One item's gradient is pushed
        (or applied, when held) as its op made it."""
        done = [p for p in self.pushing if p[0].done()]
        for p in done:
            self.pushing.remove(p)
            for name, buf in p[1]:
                self.free_bufs.setdefault(name, []).append(buf)
        free = self.free_bufs.get(table)
        xp = self.xp if table in self.held else np
        buf = free.pop() if free else xp.empty_like(grad)
        xp.copyto(buf, grad)
        return buf

    # -- the step's push ------------------------------------------------------------------------
    def push_step(self, t: int, st: StepState, ahead: list[Any] = ()) -> None:
        """Push step t's gradients (zeros for a table the trainer got no gradient of) in the
        background; forget its dense prefetch. In sync mode the push carries the pulls of step
        t + 1 (`PSClient.push_pull`: one request, answered once step t is applied): the dense tables
        and, for a reader that has made step t + 1's items (`ahead`), their rows."""
        self.prefetch.pop(t, None)
        if self.kept is not None:  # the held tables' step, here and now
            with timed("apply", "compute", rec=self.rec, step=t):  # (busy: the trainer's own work)
                self.kept.apply(st.grads, t)
            self.kept.write_back_due(self.client, t + 1, self.rec)  # (a pause after step t)
            for name in self.held:
                if (buf := st.grads.pop(name, None)) is not None and name in st.summed:
                    self.free_bufs.setdefault(name, []).append(buf)  # (a buffer of ours: reuse it)
        sorts = {
            x: self.step_sorts.pop((t, x))
            for x in {x for _, _, x in self.sparse_feeds}
            if (t, x) in self.step_sorts
        }
        grads = []
        for table, kind in self.pushed.items():
            spec = self.tables[table]
            if kind == "push_dense":
                grad = st.grads.get(table)
                grads.append((table, np.zeros(spec.shape, spec.dtype) if grad is None else grad, None))
                continue
            fed, parts = st.fed_rows.get(table, {}), st.rows.get(table, [])
            sort = sorts.get(self.feed_of.get(table))
            shows = st.shows.get(table, {})
            if fed and not parts and sort is not None and set(fed) == set(sort.spans):
                # every lookup of the step's feed: sum with the sort made for its prefetch
                parts = [fed[k][1] for k in sort.spans]  # (one item per step: no copy)
                rows = sort.merge.sum(np, parts[0] if len(parts) == 1 else np.concatenate(parts))
                grads.append((table, rows, sort.merge.unique_rows, *merged_shows(sort, shows, table)))
                continue
            parts = list(fed.values()) + parts
            grads.append(general_push(table, spec, parts, list(shows.values()), table in self.show_click))
        if grads and self.mode == "sync" and not self.leads_clip():
            fut = self._push_pull(t, grads, list(ahead))
        elif grads and self.defer_push:  # with the next step's row pull (`prefetch_rows`)
            self.send_deferred()
            self.deferred = (t, grads, self._buffers(st))
            return
        elif grads or self.leads_clip():
            fut = self.bg.submit(self._push, grads, self.ps_step(t))
        else:
            return
        self.pushing.append((fut, self._buffers(st)))

    def _push_pull(self, t: int, grads: list, ahead: list[Any]) -> Future:
        """Sync: step t's push and step t + 1's pulls (dense tables; rows of the `ahead` items) in one
        background request; the pulls become step t + 1's prefetches."""
        dense = self._dense_pulls() if t + 1 not in self.prefetch else []
        rows: list[tuple[str, np.ndarray]] = []
        if self.sparse_feeds and ahead and not self._rows_asked(ahead):
            self.sort_rows(t + 1, ahead)
            rows = self._row_pulls(t + 1)
        fut = self.bg.submit(self._push_and_pull, grads, dense + rows, t)
        if dense:
            self.prefetch[t + 1] = Prefetch(fut)
        if rows:
            self._expect_rows(ahead, rows, fut, len(dense))
        return fut

    def _push_and_pull(self, client: PSClient, grads: list, pulls: list, step: int) -> list[np.ndarray]:
        """Step `step`'s push and pulls, fused (on the background thread): in sync mode of step
        + 1, answered once step `step` is applied; in async mode the rows of a later step. Its span
        is the step's push, with the pulled tables in `pulls`."""
        with timed(
            "push", "ps", rec=self.rec, step=step, tables=[g[0] for g in grads], pulls=[p[0] for p in pulls]
        ):
            s = self.ps_step(step)
            return client.push_pull(grads, pulls, step=s) if pulls else client.push_many(grads, step=s)

    def _push(self, client: PSClient, grads: list, step: int | None) -> None:
        """A step's gradients, pushed on the background thread (its span lands on lane 1)."""
        if grads:
            with timed("push", "ps", rec=self.rec, step=step, tables=[g[0] for g in grads]):
                client.push_many(grads, step=step)
        if self.leads_clip() and step is not None:
            with timed("clip", "ps", rec=self.rec, step=step) as span:
                span.args["norm"] = client.clip_step(step, *self.clip)

    def leads_clip(self) -> bool:
        """This trainer clips each sync step by global norm once its own push is in."""
        return self.clip is not None and self.clip_lead and self.mode == "sync"


# -- show/click from training (transpiler/show_click.py) -------------------------------------------
def occurrences(sc: ShowClick, feed: dict[str, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
    """An item's id occurrences in `sc`'s id feeds and a (1, label) per occurrence: show 1, click its
    sample's label (Paddle's PushSparseVarsWithLabelAsync). ValueError when a feed is missing or an
    id feed's rows are not the label's samples."""
    if feed is None or sc.label not in feed or any(x not in feed for x in sc.ids):
        raise ValueError(
            f"table {sc.table!r} counts show/click from feeds {[*sc.ids, sc.label]}: the item lacks them"
        )
    label = np.asarray(feed[sc.label], np.float32).reshape(-1)
    ids, shows = [], []
    for x in sc.ids:
        got = np.asarray(feed[x])
        if got.ndim == 0 or got.shape[0] != label.size:
            raise ValueError(
                f"table {sc.table!r}: feed {x!r} of shape {list(got.shape)} has no row per sample of "
                f"label {sc.label!r} ({label.size}): its ids cannot be paired with labels"
            )
        per = got.size // label.size if label.size else 0
        ids.append(got.reshape(-1))
        shows.append(np.stack([np.ones(got.size, np.float32), np.repeat(label, per)], axis=1))
    return np.concatenate(ids), np.concatenate(shows)


def merged_shows(sort: StepSort, shows: dict[tuple, tuple], table: str) -> list[np.ndarray]:
    """[the step's (show, click) per unique row of `sort`] when every item of the sort sent the
    occurrences of its one feed (in the sort's order, as its row gradients), else []."""
    if not shows:
        return []
    occ = [shows[k][1] for k in sort.spans]
    return [sort.merge.sum(np, occ[0] if len(occ) == 1 else np.concatenate(occ))]


def general_push(table: str, spec: TableSpec, parts: list, shows: list, counted: bool) -> tuple:
    """(table, rows, ids[, show/click]) of a step's row gradients `parts` ((ids, rows) each) and,
    for a `counted` table, its items' occurrences `shows`: appended as zero-gradient rows with their
    (1, label) beside zero (show, click) for the gradients' rows (the client sums repeated ids)."""
    ids = [p[0] for p in parts] + [o[0] for o in shows]
    rows = [p[1] for p in parts] + [np.zeros((o[0].size, spec.shape[1]), spec.dtype) for o in shows]
    ids = np.concatenate(ids).astype(np.int64, copy=False) if ids else np.zeros(0, np.int64)
    rows = np.concatenate(rows) if rows else np.zeros((0, spec.shape[1]), spec.dtype)
    if not counted:
        return table, rows, ids
    sc = [np.zeros((p[0].size, 2), np.float32) for p in parts] + [o[1] for o in shows]
    return table, rows, ids, (np.concatenate(sc) if sc else np.zeros((0, 2), np.float32))
