"""Dense and sparse tables behind one interface (runtime/ps/types.py `Table`), checked against
numpy by hand through that interface only."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.ps import PSError, Table, make_table
from transpiler.tables import TableSpec

LR = 0.5


def _dense() -> Table:
    return make_table(
        TableSpec.from_dict(
            {
                "name": "w",
                "kind": "dense",
                "shape": [3, 2],
                "dtype": "float32",
                "initializer": {"type": "constant", "value": 1.0},
                "optimizer": {"type": "sgd", "lr": LR},
            }
        )
    )


def _sparse(vocab: int = -1, opt: dict | None = None) -> Table:
    return make_table(
        TableSpec.from_dict(
            {
                "name": "emb",
                "kind": "sparse",
                "shape": [vocab, 2],
                "dtype": "float32",
                "initializer": {"type": "constant", "value": 2.0},
                "optimizer": opt or {"type": "sgd", "lr": LR},
            }
        )
    )


@pytest.mark.parametrize("make", [_dense, _sparse])
def test_dense_and_sparse_tables_satisfy_the_protocol(make):
    t = make()
    assert isinstance(t, Table)
    for name in Table.__annotations__:
        assert hasattr(t, name), name


def test_a_dense_table_through_the_protocol_matches_numpy():
    t, want = _dense(), np.ones((3, 2), np.float32)
    np.testing.assert_array_equal(t.pull(None), want)
    g = np.arange(6, dtype=np.float32).reshape(3, 2)
    t.push(g, None)
    want -= LR * g
    np.testing.assert_array_equal(t.pull(), want)
    parts = [t.check_push(g, None), t.check_push(2 * g, None)]
    t.push(*t.sum_parts(parts), checked=True)
    want -= LR * (g + 2 * g)
    np.testing.assert_array_equal(t.pull(), want)
    t.add(np.ones((3, 2), np.float32), None)
    np.testing.assert_array_equal(t.peek(None), want + 1)
    view = t.pull(copy=False)
    assert not view.flags.writeable
    assert len(t) == 3 and t.new_rows(None) == 0 and not t.unbounded
    assert t.memory_bytes() == want.nbytes
    assert t.state_shapes(t.state_dict()) == {"Param": (3, 2)}
    with pytest.raises(PSError, match="pull of dense table 'w' takes no ids"):
        t.pull(np.array([0]))


def test_a_sparse_table_through_the_protocol_matches_numpy():
    t = _sparse()
    assert t.unbounded and len(t) == 0
    ids = np.array([5, 9, 5], np.int64)
    assert t.new_rows(ids) == 2
    np.testing.assert_array_equal(t.peek(ids), np.full((3, 2), 2.0, np.float32))
    assert len(t) == 0  # a peek creates nothing
    g = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    t.push(g, ids)  # repeated ids: their rows summed
    want = {5: 2.0 - LR * (g[0] + g[2]), 9: 2.0 - LR * g[1]}
    np.testing.assert_allclose(t.pull(np.array([9, 5])), np.stack([want[9], want[5]]), rtol=1e-6)
    assert len(t) == 2 and t.new_rows(np.array([5, 11, 11, 12])) == 2

    a, b = t.check_push(g[:2], np.array([5, 12])), t.check_push(g[2:], np.array([5]))
    grad, merged = t.sum_parts([a, b], merge=True)
    np.testing.assert_array_equal(merged, [5, 12])
    np.testing.assert_array_equal(grad, [g[0] + g[2], g[1]])
    grad, cat = t.sum_parts([a, b])
    np.testing.assert_array_equal(cat, [5, 12, 5])

    t.assign(np.zeros((1, 2), np.float32), np.array([9]))
    np.testing.assert_array_equal(t.pull(np.array([9])), [[0, 0]])
    state = t.state_dict()
    assert t.state_shapes(state) == {"ids": (2,), "Param": (2, 2)}
    odd = t.select_rows(state, lambda i: i % 2 == 1)
    np.testing.assert_array_equal(odd["ids"], [5, 9])
    even = t.select_rows(state, lambda i: i % 2 == 0)
    assert even["ids"].size == 0 and even["Param"].shape == (0, 2)
    with pytest.raises(PSError, match="pull of sparse table 'emb' needs ids"):
        t.pull(None)


def test_optimizer_state_comes_from_the_registry_rules():
    t = _sparse(opt={"type": "adam", "lr": 0.1, "beta1": 0.5})
    assert t.state_slots == ["Moment1", "Moment2"] and sorted(t.scalars) == ["Beta1Pow", "Beta2Pow"]
    assert float(t.scalars["Beta1Pow"][0]) == 0.5 and t.attrs["lazy_mode"] == 0
    with pytest.raises(PSError, match="bad adam hyper-parameters .* unknown hyper-parameters \\['beta3'\\]"):
        _sparse(opt={"type": "adam", "lr": 0.1, "beta3": 1.0})
