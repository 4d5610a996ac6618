"""The sparse kernels' one-sort helpers (ops_registry.base.RowMerge, the unique_ids kernel) against
numpy's own np.unique and np.add.at."""

import numpy as np
import pytest

from ops_registry import SparseRows, get_op
from ops_registry.base import COMPILED_FROM, RowMerge, scatter_add, stable_argsort


@pytest.mark.parametrize(
    "shape, high", [((128, 26), 100_000), ((1,), 5), ((7, 3), 2), ((0, 26), 10), ((64,), 1 << 40)]
)
def test_unique_ids_matches_np_unique(shape, high):
    ids = np.random.default_rng(0).integers(0, high, size=shape)
    got = get_op("unique_ids").kernel(np, {"Ids": ids}, {})
    uniq, inv = np.unique(ids, return_inverse=True)
    np.testing.assert_array_equal(got["Unique"], uniq)
    np.testing.assert_array_equal(got["Index"], inv.reshape(shape))
    assert got["Index"].shape == ids.shape


def test_row_merge_sums_repeated_rows_like_np_add_at_and_is_reused_across_tables():
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 50, size=300)
    merge = RowMerge.of(np, rows)
    np.testing.assert_array_equal(merge.unique_rows, np.unique(rows))
    for dim in (1, 16):  # two tables over the same ids, one sort
        values = rng.normal(size=(300, dim)).astype(np.float32)
        want = np.zeros((50, dim), np.float64)
        np.add.at(want, rows, values.astype(np.float64))
        np.testing.assert_allclose(merge.sum(np, values), want[np.unique(rows)], rtol=1e-5, atol=1e-5)
        merged = SparseRows(rows, values, 50).merged(np, merge)
        assert merged.unique and np.array_equal(merged.rows, np.unique(rows))
    np.testing.assert_array_equal(merge.unique_rows[merge.inverse(np)], rows)


@pytest.mark.parametrize("dim", [16, 1])  # (1: a wide table's rows, a loop of its own)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_merge_of_a_ctr_steps_rows_sums_in_float64_like_np_add_at(dtype, dim):
    # a CTR step's lookups (512 x 26 ids, skewed: ~3 600 distinct) take the compiled segmented sum
    # (>= 4 096 rows); it accumulates in float64, so it is within one float32 rounding of the exact
    # sum however many times a hot id repeats (np.add.at in float32 drifts by ~1e-4 here)
    rng = np.random.default_rng(2)
    rows = (rng.zipf(1.2, 512 * 26) % 100_000).astype(np.int64)
    values = rng.standard_normal((rows.size, dim)).astype(dtype)
    merge = RowMerge.of(np, rows)
    exact = np.zeros((100_000, dim), np.float64)
    np.add.at(exact, rows, values.astype(np.float64))
    got = merge.sum(np, values)
    assert got.dtype == dtype and got.shape == (np.unique(rows).size, dim)
    want = exact[np.unique(rows)].astype(dtype)
    np.testing.assert_allclose(got, want, rtol=np.finfo(dtype).eps, atol=np.finfo(dtype).tiny)
    # a non-contiguous view of the values sums the same
    wide = np.zeros((rows.size, 2 * dim), dtype)
    wide[:, ::2] = values
    np.testing.assert_array_equal(merge.sum(np, wide[:, ::2]), got)


def test_row_merge_part_equals_a_fresh_sort_of_the_slice():
    # one sort of a step's ids serves each micro-batch's unique ids: the part of rows[lo:hi] must be
    # exactly what sorting that slice alone gives (np.unique's values and inverse)
    rng = np.random.default_rng(3)
    rows = (rng.zipf(1.3, 4 * 500) % 1000).astype(np.int64)
    merge = RowMerge.of(np, rows)
    for lo, hi in [(0, 500), (500, 1000), (1500, 2000), (0, 2000), (7, 8), (3, 3)]:
        part = merge.part(np, rows, lo, hi)
        uniq, inv = np.unique(rows[lo:hi], return_inverse=True)
        np.testing.assert_array_equal(part.unique_rows, uniq)
        np.testing.assert_array_equal(part.inverse(np), inv)
        if hi > lo:
            np.testing.assert_array_equal(part.order, np.argsort(rows[lo:hi], kind="stable"))


@pytest.mark.parametrize(
    "make",
    [
        lambda r: r.zipf(1.2, 13_312) % 2_600_000,  # a CTR step's ids: skewed, repeated (the radix sort)
        lambda r: r.integers(0, 1 << 62, 5_000),  # hashed ids: every digit pass
        lambda r: np.zeros(4_096, np.int64),  # all equal: no pass, the identity
        lambda r: r.integers(0, 300, 9_000).astype(np.int32),
        lambda r: r.integers(0, 1 << 40, 6_000).astype(np.uint64),
        lambda r: r.integers(-50, 50, 5_000),  # negative: numpy's sort
        lambda r: r.integers(0, 10, 100),  # small: numpy's sort
    ],
)
def test_stable_argsort_equals_numpys_stable_argsort(make):
    rows = make(np.random.default_rng(3))
    got = stable_argsort(np, rows)
    np.testing.assert_array_equal(got, np.argsort(rows, kind="stable"))
    assert got.dtype == np.intp


@pytest.mark.parametrize("unique", [True, False])
@pytest.mark.parametrize("dtype, dim", [(np.float32, 16), (np.float64, 1)])
def test_scatter_add_of_many_rows_equals_np_add_at(unique, dtype, dim):
    # from COMPILED_FROM rows the compiled row loop: the same sums, in the same order, as np.add.at
    rng = np.random.default_rng(4)
    n = COMPILED_FROM + 1_000
    index = np.sort(rng.choice(50_000, n, replace=False)) if unique else rng.integers(-50_000, 50_000, n)
    values = rng.normal(size=(n, dim)).astype(dtype)
    target = rng.normal(size=(50_000, dim)).astype(dtype)
    want = target.copy()
    np.add.at(want, index, values)
    scatter_add(np, target, index, values, unique=unique)
    np.testing.assert_array_equal(target, want)


def test_scatter_add_of_many_rows_refuses_an_index_out_of_range():
    target = np.zeros((10, 2), np.float32)
    index = np.zeros(COMPILED_FROM, np.int64)
    index[-1] = 10
    with pytest.raises(IndexError):
        scatter_add(np, target, index, np.ones((COMPILED_FROM, 2), np.float32))
