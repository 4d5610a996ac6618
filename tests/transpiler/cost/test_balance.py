"""One shard balancer for dense tables, by bytes, shared by the transpiler and the PS runtime:
the shard a plan names for each table is the one the runtime would pick on its own."""

from __future__ import annotations

from dataclasses import replace

from transpiler import Program
from transpiler.config import TranspileConfig
from transpiler.models import wide_deep
from transpiler.passes import insert_ps


def three_tables() -> Program:
    """x @ a, x @ b, x @ c with a float64[4, 25] (800 B), b float32[4, 40] (640 B), c float32[4, 10]
    (160 B): by bytes a is the largest, by elements b is."""
    p = Program()
    blk = p.global_block()
    blk.create_var("x", shape=(-1, 4), dtype="float64")
    for name, cols, dtype in (("a", 25, "float64"), ("b", 40, "float32"), ("c", 10, "float32")):
        blk.create_var(name, shape=(4, cols), dtype=dtype, persistable=True, is_parameter=True)
        blk.create_var(f"h_{name}", shape=(-1, cols), dtype=dtype)
    p.append_op("data", {}, {"Out": "x"}, {"shape": [-1, 4], "dtype": "float64", "op_device": "cpu"})
    for name in "abc":
        p.append_op("matmul", {"A": "x", "B": name}, {"Y": f"h_{name}"}, {"op_device": "cpu"})
    return p


def test_dense_tables_are_balanced_by_bytes():
    """By hand: a (800 B) -> shard 0; b (640 B) -> the empty shard 1; c (160 B) -> shard 1 (640 <
    800). Balanced by elements, b (160) would go first, to shard 0."""
    tables = insert_ps(three_tables(), TranspileConfig(num_servers=2))
    shards = {t.name: t.sharding.shard for t in tables.specs}
    assert shards == {"a": 0, "b": 1, "c": 1}


def test_runtime_places_tables_where_the_plan_does():
    from runtime.ps import place_dense
    from transpiler import transpile

    plan = transpile(wide_deep(vocab=100).main, TranspileConfig(num_servers=3))
    dense = [t for t in plan.tables if t.kind == "dense"]
    assert len({t.sharding.shard for t in dense}) == 3
    unplaced = [replace(t, sharding=None) for t in plan.tables]
    assert place_dense(unplaced, 3) == {t.name: t.sharding.shard for t in dense}
