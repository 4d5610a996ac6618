"""`make_table`: the table a spec asks for — dense, sparse in RAM, or sparse on disk under a RAM tier."""

from __future__ import annotations

from runtime.ps.table import DenseTable, SparseTable
from runtime.ps.table_specs import check_spec
from runtime.ps.tiered import TieredSparseTable
from runtime.ps.types import Table
from transpiler.tables import TableSpec


def make_table(spec: TableSpec, check_finite: bool = True, shard: str | None = None) -> Table:
    """A `DenseTable`, a `SparseTable`, or (`storage="disk"`) a `TieredSparseTable` for `spec`
    (`shard`, e.g. "1 of 4", named in a tiered table's errors)."""
    spec = check_spec(spec)
    if spec.storage == "disk":
        return TieredSparseTable(spec, check_finite, shard=shard)
    return (SparseTable if spec.kind == "sparse" else DenseTable)(spec, check_finite)
