"""The parameter server's shared interfaces and records (a leaf: imports nothing of runtime.ps).

`Table` is what a shard needs of a table, whatever its storage: dense (one array), sparse (an
id -> row map in memory), later a tiered on-disk sparse table. Ids come in batches (1-D integer
arrays; None for a dense table), rows and values go out as arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ops_registry.errors import HetpsError
from transpiler.tables import TableSpec

CLIP = "@clip"  # the key sync `norm` requests wait under (no table name starts with "@"): clip.py


class PSError(HetpsError, ValueError):
    """A request the parameter server refuses; the message says what was expected."""


class NotReady(Exception):  # noqa: N818 (a signal, not an error)
    """A sync-mode request for a step whose predecessor has not been applied yet: (table, step)."""


def check_ids_given(kind: str, table: str, ids: Any, what: str) -> None:
    """PSError unless ids come with a sparse table and only with one (`what`: pull, push, assign);
    the clients check before sending, the tables again on receipt."""
    if (ids is None) == (kind == "sparse"):
        need = "needs ids" if ids is None else "takes no ids"
        raise PSError(f"{what} of {kind} table {table!r} {need}")


@dataclass
class Held:
    """A clipped table's summed gradient of one sync step, waiting for its scale (clip.py)."""

    grad: np.ndarray
    ids: np.ndarray | None  # a sparse table's rows (unique); None for a dense table
    parts: int  # the pushes summed
    shows: list = field(default_factory=list)  # (ids, [n, 2] show/click) of its pushes that had them


@runtime_checkable
class Table(Protocol):
    """A parameter-server table with its server-side optimizer. `ids` is None for a dense table and
    a 1-D integer array for a sparse one (`check_ids_given` refuses the other); every method
    refuses bad input with a PSError naming the table."""

    spec: TableSpec
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    kernel: Callable | None  # the optimizer kernel; None: a frozen table, which refuses pushes
    unbounded: bool  # rows are created on first touch without a bound (a sparse table of vocab -1)
    state_slots: list[str]  # per-row (or parameter-shaped) optimizer state
    scalars: dict[str, np.ndarray]  # scalar optimizer state, once per table

    def __len__(self) -> int:
        """Rows held."""
        ...

    def pull(self, ids: np.ndarray | None = None, *, copy: bool = True) -> np.ndarray:
        """The parameter, or rows of `ids` [len(ids), dim]. `copy=False`: a dense parameter as a
        read-only view (sparse rows are always fresh arrays)."""
        ...

    def peek(self, ids: np.ndarray | None = None, *, copy: bool = True) -> np.ndarray:
        """What `pull` returns, creating no rows and touching no admission / eviction counters."""
        ...

    def push(self, grad: np.ndarray, ids: np.ndarray | None = None, *, checked: bool = False) -> None:
        """One optimizer step (`checked`: grad and ids already through `check_push`)."""
        ...

    def check_push(self, grad: np.ndarray, ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(grad, ids) of a push, checked and converted to the table's dtypes."""
        ...

    def sum_parts(
        self, parts: list[tuple[np.ndarray, np.ndarray | None]], merge: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The sum of checked pushes (grad, ids) as one push; `merge`: rows of repeated ids summed
        (else a sparse sum is their concatenation, which the optimizer kernel merges)."""
        ...

    def new_rows(self, ids: np.ndarray) -> int:
        """How many rows a pull or push of `ids` would create."""
        ...

    def add(self, delta: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Values += delta (a GEO merge; repeated ids accumulate)."""
        ...

    def assign(self, values: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Values = values (imported weights; optimizer state untouched)."""
        ...

    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything a checkpoint holds of the table, by name."""
        ...

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Set the table from `arrays` (a `state_dict`, possibly a subset of a sparse table's rows)."""
        ...

    def state_shapes(self, arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        """The shapes a checkpoint file's `arrays` must have to be this table's state."""
        ...

    def select_rows(
        self, arrays: dict[str, np.ndarray], keep: Callable[[np.ndarray], np.ndarray]
    ) -> dict[str, np.ndarray]:
        """A state's rows whose ids `keep(ids)` marks (a shard's part of a checkpoint)."""
        ...

    def memory_bytes(self) -> int:
        """Bytes the table holds (rows, optimizer state, indexes)."""
        ...
