"""A reader trainer's step push of sparse row gradients (runtime.trainer.ps_access.PSAccess.push_step).

The step's gradient of a table is checked against numpy by hand: for each distinct id of the step,
the sum of the rows of every lookup of it, over all of the step's micro-batches. The push reuses the
sort the reader made of the step's ids for its row prefetch when each micro-batch's gradient covers
exactly its feed's lookups; any other gradient takes the general path, which must agree."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from ops_registry import SparseRows
from ops_registry.base import RowMerge
from runtime.telemetry.outputs import Recorder
from runtime.trainer.mail import Item
from runtime.trainer.ps_access import PSAccess
from runtime.trainer.steps import StepBook
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep

VOCAB, DIM = 50, 4


class FakeBackground:
    """Records what PSAccess hands its background thread instead of calling servers."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple]] = []

    def submit(self, fn, *args) -> Future:
        self.calls.append((fn, args))
        f: Future = Future()
        f.set_result(None)
        return f


def reader_access() -> tuple[PSAccess, FakeBackground]:
    plan = transpile(wide_deep(vocab=VOCAB, dim=DIM, optimizer=nn.SGD(lr=0.1)).main)
    ps = PSAccess(
        plan.programs["cpu"], plan.tables, "async", np, StepBook("cpu:0", True, 1), {}, Recorder(on=False)
    )
    ps.bg = FakeBackground()
    return ps, ps.bg


def items_of_step(t: int, rng: np.random.Generator, sizes=(3, 5, 4)) -> list[Item]:
    return [
        Item(t, 0, m, n, sum(sizes), {"sparse": rng.zipf(1.5, (n, 6)) % VOCAB}) for m, n in enumerate(sizes)
    ]


def pushed_sparse(ps: PSAccess, bg: FakeBackground, t: int) -> dict[str, tuple]:
    """Per sparse table of step t's push: (ids, rows) as pushed, and the distinct ids with their
    rows summed (float64) by hand, which is what the client's merge must make of them."""
    ps.push_step(t, ps.book.step(t))
    assert ps.deferred is not None and ps.deferred[0] == t  # (async: kept for the next row pull)
    ps.send_deferred()  # (the trainer is about to wait: alone)
    (grads, _step) = bg.calls[-1][1]
    out = {}
    for table, rows, ids in grads:
        if ids is None:
            continue
        uniq, inv = np.unique(ids, return_inverse=True)
        acc = np.zeros((uniq.size, rows.shape[1]))
        np.add.at(acc, inv, rows)
        out[table] = (np.asarray(ids), rows, uniq, acc)
    return out


def by_hand(items: list[Item], grads: dict[tuple, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ids of the items' feeds and, per id, the float64 sum of its lookups' rows."""
    ids = np.concatenate([np.ravel(it.feed["sparse"]) for it in items])
    rows = np.concatenate([grads[it.key] for it in items]).astype(np.float64)
    uniq, inv = np.unique(ids, return_inverse=True)
    want = np.zeros((uniq.size, rows.shape[1]))
    np.add.at(want, inv, rows)
    return uniq, want


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]])
def test_step_push_sums_every_lookup_of_the_step_per_distinct_id(order):
    ps, bg = reader_access()
    rng = np.random.default_rng(0)
    items = items_of_step(7, rng)
    ps.prefetch_rows(7, items)
    grads = {}
    for it in [items[i] for i in order]:  # micro-batches may finish in any order
        ids = it.feed["sparse"]
        uniq, index = np.unique(ids, return_inverse=True)  # what unique_ids gives the lookup
        for table, dim in (("deep_emb.w_0", DIM), ("wide_emb.w_0", 1)):
            g = rng.normal(size=(ids.size, dim)).astype(np.float32)
            grads[(table, it.key)] = g
            ps.push_sparse(it, table, uniq, SparseRows(index.reshape(-1), g, uniq.size))
    got = pushed_sparse(ps, bg, 7)
    for table in ("deep_emb.w_0", "wide_emb.w_0"):
        uniq, want = by_hand(items, {it.key: grads[(table, it.key)] for it in items})
        ids, rows, _, _ = got[table]
        np.testing.assert_array_equal(ids, uniq)  # already merged: distinct ids, sorted
        np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-6)
    assert not ps.step_sorts  # the step's sorts are dropped once it is pushed


def test_a_gradient_not_over_the_feeds_lookups_takes_the_general_path():
    """One micro-batch pushes rows for other ids than its feed's (e.g. a gradient computed
    elsewhere): the push keeps every row with its id and the client merges them."""
    ps, bg = reader_access()
    rng = np.random.default_rng(1)
    items = items_of_step(3, rng)
    ps.prefetch_rows(3, items)
    grads = {}
    for it in items:
        ids = np.ravel(it.feed["sparse"]).copy()
        if it.mb == 1:
            ids = (ids + 1) % VOCAB
        g = rng.normal(size=(ids.size, DIM)).astype(np.float32)
        grads[it.key] = (ids, g)
        ps.push_sparse(it, "deep_emb.w_0", ids, g)
    _, _, merged_ids, merged = pushed_sparse(ps, bg, 3)["deep_emb.w_0"]
    all_ids = np.concatenate([grads[it.key][0] for it in items])
    all_rows = np.concatenate([grads[it.key][1] for it in items]).astype(np.float64)
    uniq, inv = np.unique(all_ids, return_inverse=True)
    want = np.zeros((uniq.size, DIM))
    np.add.at(want, inv, all_rows)
    np.testing.assert_array_equal(merged_ids, uniq)
    np.testing.assert_allclose(merged, want, rtol=1e-5, atol=1e-6)


def test_two_gradients_of_one_table_from_one_micro_batch_both_count():
    """A table whose rows one micro-batch pushes twice (e.g. looked up twice for its feed): the step's
    push sums both gradients; neither replaces the other."""
    ps, bg = reader_access()
    rng = np.random.default_rng(2)
    items = items_of_step(5, rng)
    ps.prefetch_rows(5, items)
    all_ids, all_rows = [], []
    for it in items:
        ids = np.ravel(it.feed["sparse"])
        for _ in range(2 if it.mb == 0 else 1):
            g = rng.normal(size=(ids.size, DIM)).astype(np.float32)
            ps.push_sparse(it, "deep_emb.w_0", ids, g)
            all_ids.append(ids)
            all_rows.append(g)
    _, _, merged_ids, merged = pushed_sparse(ps, bg, 5)["deep_emb.w_0"]
    uniq, inv = np.unique(np.concatenate(all_ids), return_inverse=True)
    want = np.zeros((uniq.size, DIM))
    np.add.at(want, inv, np.concatenate(all_rows).astype(np.float64))
    np.testing.assert_array_equal(merged_ids, uniq)
    np.testing.assert_allclose(merged, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes", [(3, 5, 4), (12,)])
def test_unique_ids_of_a_prefetched_feed_equal_np_unique_of_the_items_own_ids(sizes, monkeypatch):
    # a reader answers each item's unique_ids from its step's one sort (RowMerge.part): values and
    # inverse must be np.unique's of the item's own ids, whatever the item's place in the step
    ps, _ = reader_access()
    items = items_of_step(0, np.random.default_rng(5), sizes)
    ps.sort_rows(0, items)
    sorts = []
    monkeypatch.setattr(RowMerge, "of", staticmethod(lambda xp, rows: sorts.append(rows)))
    for it in items:
        ids = it.feed["sparse"]
        got = ps.unique_ids(it, "sparse", ids)
        assert sorts == []  # no sort of its own: the step's sort served it
        uniq, inv = np.unique(ids, return_inverse=True)
        np.testing.assert_array_equal(got["Unique"], uniq)
        np.testing.assert_array_equal(got["Index"], inv.reshape(ids.shape))
    # ids that are not the item's feed (or a step without a sort) take the registry's kernel
    monkeypatch.undo()
    other = (items[0].feed["sparse"] + 1) % VOCAB
    got = ps.unique_ids(items[0], "sparse", other)
    np.testing.assert_array_equal(got["Unique"], np.unique(other))
    later = items_of_step(1, np.random.default_rng(6), sizes)[0]
    np.testing.assert_array_equal(
        ps.unique_ids(later, "sparse", later.feed["sparse"])["Unique"], np.unique(later.feed["sparse"])
    )


def test_an_async_readers_push_goes_with_its_next_row_pull_in_one_request():
    ps, bg = reader_access()
    rng = np.random.default_rng(1)
    items = items_of_step(0, rng, sizes=(4,))
    ps.prefetch_rows(0, items)
    it = items[0]
    uniq, index = np.unique(it.feed["sparse"], return_inverse=True)
    g = rng.normal(size=(index.size, DIM)).astype(np.float32)
    ps.push_sparse(it, "deep_emb.w_0", uniq, SparseRows(index.reshape(-1), g, uniq.size))
    calls = len(bg.calls)
    ps.push_step(0, ps.book.step(0))
    assert len(bg.calls) == calls  # kept...
    later = items_of_step(1, rng, sizes=(4,))
    ps.prefetch_rows(1, later)  # ...until step 1's rows are pulled: one request for both
    assert len(bg.calls) == calls + 1 and ps.deferred is None
    fn, (grads, pulls, step) = bg.calls[-1]
    assert fn == ps._push_and_pull and step == 0
    assert [t for t, _, _ in grads] == ["deep_emb.w_0", "wide_emb.w_0"]  # (zeros for the wide one)
    np.testing.assert_array_equal(grads[0][2], uniq)
    want = np.zeros((uniq.size, DIM))
    np.add.at(want, index.reshape(-1), g)
    np.testing.assert_allclose(grads[0][1], want, rtol=1e-6)
    step1 = np.unique(later[0].feed["sparse"])
    assert sorted(t for t, _ in pulls) == ["deep_emb.w_0", "wide_emb.w_0"]
    for _, ids in pulls:
        np.testing.assert_array_equal(ids, step1)
