"""One id-range rule (`ops_registry.embedding.id_range_error`) for the lookup kernels, the
parameter server's tables and simulate's in-memory oracle."""

import re

import numpy as np
import pytest

from ops_registry import get_op
from ops_registry.embedding import id_range_error
from runtime.ps import PSError, make_table
from transpiler.tables import TableSpec


def _sparse(vocab: int) -> dict:
    return TableSpec(
        name="emb",
        kind="sparse",
        shape=[vocab, 3],
        dtype="float32",
        initializer={"type": "uniform", "low": -0.1, "high": 0.1, "seed": 7},
        optimizer={"type": "sgd", "lr": 0.5},
    )


@pytest.mark.parametrize("vocab", [5, -1])
def test_one_id_range_rule_for_kernels_tables_and_the_oracle(vocab):
    """The embedding kernels (and simulate's in-memory server, which calls their check) and a PS
    table refuse the same ids, naming the range and the first five ids outside [0, vocab); an
    unbounded table takes every 64-bit id (negative int64: the bits of uint64 ids >= 2^63)."""
    ids = np.array([0, 4, 5, -1, 7, 2**40, -2, -3, 6, 1], np.int64)
    table = make_table(_sparse(vocab))
    if vocab < 0:
        assert id_range_error(ids, vocab) is None
        assert table.check_ids(ids).tolist() == ids.tolist()
        assert table.check_ids(np.array([2**64 - 1], np.uint64)).tolist() == [-1]  # the same bits
        return
    outside = [int(i) for i in ids if i < 0 or i >= vocab]  # by hand
    assert outside[:5] == [5, -1, 7, 2**40, -2]
    want = re.escape(f"ids out of range [0, 5): [{', '.join(map(str, outside[:5]))}]") + "$"
    assert id_range_error(ids[[0, 1, 9]], vocab) is None
    with pytest.raises(PSError, match="table 'emb': " + want):
        table.check_ids(ids)
    assert table.check_ids(ids[[0, 1, 9]]).tolist() == [0, 4, 1]
    w = np.zeros((vocab, 3), np.float32)  # (a kernel's table always has a height)
    with pytest.raises(IndexError, match=want):
        get_op("embedding").kernel(np, {"W": w, "Ids": ids}, {"is_sparse": True})
