"""The sparse kernels' one-sort helpers (ops_registry.base.RowMerge, the unique_ids kernel) against
numpy's own np.unique and np.add.at."""

import numpy as np
import pytest

from ops_registry import SparseRows, get_op
from ops_registry.base import RowMerge


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
