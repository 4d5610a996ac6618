"""Parameter-server tables: a dense array or a sparse id -> row map, with its server-side optimizer.

A table is described by a `transpiler.tables.TableSpec` (what the transpiler records in its Plan;
`TableSpec.from_dict` makes one from plain data): its name, kind ("dense" | "sparse"), shape
([vocab or -1, dim] for a sparse table), dtype, initializer (an `init_rows` spec) and optimizer
(an `OptimizerSpec`: type, hyper-parameters (lr...), optional state start values; or None).

`initializer: None` means the values come from elsewhere (imported weights): they must be set with
`assign` before they are read. `optimizer: None` is a frozen table that refuses pushes. The Plan's
`sharding` is ignored here.

Updates call the registry's optimizer kernels (`ops_registry.get_op(type).kernel`) with the same
attrs and state the builder's optimizer ops get, so a server step is the trainer-side step bit for
bit. Optimizer state lives beside the rows: per-row state (Adagrad's Moment, Adam's moments) in
arrays parallel to the rows, scalar state (Adam's Beta1Pow/Beta2Pow) once per table. A state slot
starts at the spec's `state[slot]["init"]` when given, else at the builder optimizer's value.

Sparse rows are stored compactly in order of first touch and created then from the initializer,
seeded per id (`ops_registry.init_rows`), so a row's first value never depends on shard count or
arrival order. Storage grows by 1.25x; pages past the used rows are never touched, so resident
memory tracks the rows in use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ops_registry import SparseRows, get_op, init_rows, scatter_add
from ops_registry.base import RowMerge
from ops_registry.embedding import id_range_error
from ops_registry.optimizer import state_init, state_slots
from runtime.ps.changes import ChangedRows, Changes
from runtime.ps.entry import ENTRY_CLOCK, ENTRY_LAST, WAITING, Entry
from runtime.ps.index import DIRECT_MAX, make_index, strictly_increasing
from runtime.ps.lifecycle import LIFE, check_lifecycle, counts, shrink
from runtime.ps.table_specs import check_spec, optimizer_attrs
from runtime.ps.types import PSError, Table, check_ids_given
from transpiler.tables import TableSpec

__all__ = ["DenseTable", "PSError", "SparseTable", "Table", "check_spec"]


def _count_distinct(ids: np.ndarray) -> int:
    """len(np.unique(ids)), by a sort: numpy 2.4's hash-based unique is ~15x slower on 1M int64."""
    s = np.sort(ids)
    return int(np.count_nonzero(s[1:] != s[:-1])) + 1 if s.size else 0


class _Base:
    """What dense and sparse tables share: the spec, the optimizer kernel and its scalar state."""

    unbounded = False

    def __init__(self, spec: TableSpec, check_finite: bool = True) -> None:
        self.spec = check_spec(spec)
        self.name, self.dtype = self.spec.name, np.dtype(self.spec.dtype)
        self.shape = tuple(self.spec.shape)
        self.check_finite = check_finite
        self.kernel, self.attrs, self.out_slot, self.state_init = None, {}, {}, {}
        slots: list = []
        if self.spec.optimizer is not None:
            self.attrs = optimizer_attrs(self.name, self.spec.optimizer)
            self.kernel = get_op(self.spec.optimizer.type).kernel
            slots = list(state_slots(self.spec.optimizer.type, self.attrs))
            given = self.spec.optimizer.state or {}
            self.state_init = {
                s.name: float(given[s.name].init) if s.name in given else state_init(s, self.attrs)
                for s in slots
            }
            self.out_slot = {s.name: s.out for s in slots}
        self.state_slots = [s.name for s in slots if not s.scalar]
        self.scalars = {s.name: np.full((1,), self.state_init[s.name], self.dtype) for s in slots if s.scalar}

    def check_grad(self, grad: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
        grad = np.asarray(grad)
        if grad.dtype.kind != "f":
            raise PSError(f"table {self.name!r}: {what} has dtype {grad.dtype}, expected a float type")
        if grad.shape != shape:
            raise PSError(
                f"table {self.name!r} (shape {list(self.shape)}): {what} has shape "
                f"{list(grad.shape)}, expected {list(shape)}"
            )
        if grad.dtype != self.dtype:
            with np.errstate(over="ignore"):  # a finite float64 beyond float32's range becomes inf here...
                grad = grad.astype(self.dtype)
        if self.check_finite and not np.isfinite(grad).all():  # ...and is refused here
            raise PSError(
                f"table {self.name!r}: {what} contains NaN or Inf; rejected (checked as "
                f"{self.dtype}, the table's dtype; start the server with check_finite=False "
                "to apply non-finite values)"
            )
        return grad

    def _apply(self, param: np.ndarray, grad: Any, state: dict[str, np.ndarray]) -> None:
        """One optimizer step through the registry kernel; row state is updated in place."""
        if self.kernel is None:
            raise PSError(f"table {self.name!r} has no optimizer (frozen): pushes are refused")
        res = self.kernel(np, {"Param": param, "Grad": grad, **state, **self.scalars}, self.attrs)
        for slot in self.scalars:
            self.scalars[slot] = res[self.out_slot[slot]]

    def _ids(self, ids: Any, what: str) -> None:
        check_ids_given(self.spec.kind, self.name, ids, what)

    def peek(self, ids: np.ndarray | None = None, *, copy: bool = True) -> np.ndarray:
        return self.pull(ids, copy=copy)


class DenseTable(_Base):
    def __init__(self, spec: TableSpec, check_finite: bool = True) -> None:
        super().__init__(spec, check_finite)
        init = self.spec.initializer
        self.param = (
            np.zeros(self.shape, self.dtype) if init is None else init_rows(init, self.shape, self.dtype.name)
        )
        self.has_value = init is not None
        self.state = {s: np.full(self.shape, self.state_init[s], self.dtype) for s in self.state_slots}

    def _value(self) -> np.ndarray:
        if not self.has_value:
            raise PSError(
                f"table {self.name!r} has no initializer and no value yet: assign its value "
                "(PSClient.assign) before reading or updating it"
            )
        return self.param

    def __len__(self) -> int:
        return self.shape[0]

    def pull(self, ids: None = None, *, copy: bool = True) -> np.ndarray:
        """The parameter: a copy, or (`copy=False`) a read-only view of the table's own array, which
        later pushes change in place (for a caller that copies it at once, e.g. into a reply)."""
        self._ids(ids, "pull")
        if copy:
            return self._value().copy()
        view = self._value().view()
        view.flags.writeable = False
        return view

    def memory_bytes(self) -> int:
        return self.param.nbytes + sum(a.nbytes for a in self.state.values())

    def push(self, grad: np.ndarray, ids: None = None, *, checked: bool = False) -> None:
        """One optimizer step with `grad` (`checked`: already through `check_push`)."""
        if not checked:
            grad, _ = self.check_push(grad, ids)
        self._apply(self._value(), grad, self.state)

    def check_push(self, grad: np.ndarray, ids: None) -> tuple[np.ndarray, None]:
        self._ids(ids, "push")
        return self.check_grad(grad, self.shape, "gradient"), None

    def sum_parts(self, parts: list[tuple[np.ndarray, None]], merge: bool = False) -> tuple[np.ndarray, None]:
        """The sum, accumulated in place into one fresh array (no stacked copy)."""
        out = np.array(parts[0][0], dtype=self.dtype)
        for g, _ in parts[1:]:
            out += g
        return out, None

    def new_rows(self, ids: None) -> int:
        return 0

    def add(self, delta: np.ndarray, ids: None = None) -> None:
        """param += delta (GEO merge)."""
        self._ids(ids, "add")
        self._value()[...] += self.check_grad(delta, self.shape, "delta")

    def assign(self, values: np.ndarray, ids: None = None) -> None:
        """param = values (optimizer state untouched)."""
        self._ids(ids, "assign")
        self.param[...] = self.check_grad(values, self.shape, "values")
        self.has_value = True

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"Param": self._value(), **self.state, **self.scalars}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        for key, target in (("Param", self.param), *self.state.items(), *self.scalars.items()):
            target[...] = arrays[key]
        self.has_value = True

    def state_shapes(self, arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        return {
            **{s: (1,) for s in self.scalars},
            "Param": self.shape,
            **{s: self.shape for s in self.state_slots},
        }

    def select_rows(
        self, arrays: dict[str, np.ndarray], keep: Callable[[np.ndarray], np.ndarray]
    ) -> dict[str, np.ndarray]:
        return arrays


class SparseTable(_Base):
    direct_max = DIRECT_MAX  # the largest vocab given a direct id index (`make_index`)

    def __init__(self, spec: TableSpec, check_finite: bool = True) -> None:
        super().__init__(spec, check_finite)
        self.vocab, self.dim = self.shape
        self.unbounded = self.vocab < 0
        self.index = make_index(self.vocab, self.direct_max)
        self.rows = np.empty((0, self.dim), self.dtype)
        self.row_state = {s: np.empty((0, self.dim), self.dtype) for s in self.state_slots}
        # feature lifecycle (runtime/ps/lifecycle.py): per-row Show, Click, Unseen beside the state
        self.life = check_lifecycle(self.name, self.spec.lifecycle) if self.spec.lifecycle else None
        self.life_slots = list(LIFE) if self.life is not None else []
        self.row_state.update({f: np.empty(0, np.float32) for f in self.life_slots})
        self.state_init.update(dict.fromkeys(self.life_slots, 0.0))
        self.counts = {"admitted": 0, "evicted": 0}  # rows created; rows removed by their lifecycle
        streaming = self.spec.entry is not None or self.spec.evict_after is not None
        self.entry = Entry(self.spec, self.vocab) if streaming else None  # admission / eviction
        self.changes = Changes()  # rows changed since each mark (runtime/ps/changes.py)

    def __len__(self) -> int:
        return len(self.index)

    def new_rows(self, ids: np.ndarray) -> int:
        """The distinct ids of `ids` without a row."""
        ids = self.check_ids(ids)
        return _count_distinct(ids[self.index.find(ids) < 0])

    def check_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise PSError(
                f"table {self.name!r}: ids must be a 1-D integer array, got "
                f"{ids.dtype} of shape {list(ids.shape)}"
            )
        if self.unbounded:  # any 64-bit pattern is an id: uint64 ids keep their bits as int64
            return ids.view(np.int64) if ids.dtype == np.uint64 else ids.astype(np.int64, copy=False)
        error = id_range_error(ids, self.vocab)  # (on the ids as given: 2^64 - 1 is not -1)
        if error:
            raise PSError(f"table {self.name!r}: {error}")
        return ids.astype(np.int64, copy=False)

    def shown(self, ids: np.ndarray) -> list[int]:
        """Ids as a user wrote them, for messages and exports: an unbounded table's ids are 64-bit
        patterns, read as uint64 (a hash64 id of 2^64 - 1 is shown so, not as -1)."""
        return (ids.view(np.uint64) if self.unbounded else ids).tolist()

    def _reserve(self, n: int, used: int) -> None:
        """Room for `n` rows, keeping the first `used`."""
        cap = self.rows.shape[0]
        if n <= cap:
            return
        cap = max(n, cap + cap // 4 + 1024)
        if self.vocab > 0:
            cap = min(cap, self.vocab)

        def grow(a: np.ndarray) -> np.ndarray:
            out = np.empty((cap, *a.shape[1:]), a.dtype)
            out[:used] = a[:used]
            return out

        self.rows = grow(self.rows)
        self.row_state = {s: grow(a) for s, a in self.row_state.items()}

    def slots(self, ids: np.ndarray, init: bool = True) -> np.ndarray:
        """Row slots of `ids`, creating missing rows: from the initializer (seeded per id), or
        left for the caller to fill when `init` is False."""
        if init and self.spec.initializer is None:
            missing = ids[self.index.find(ids) < 0]
            if missing.size:
                raise PSError(
                    f"table {self.name!r} has no initializer and rows {self.shown(missing[:5])} "
                    "were never assigned (PSClient.assign)"
                )
        old = len(self.index)
        if self.changes.marks:
            self.changes.changed(ids)
        slots, new_ids, _ = self.index.find_or_add(ids)
        if new_ids.size:
            self.counts["admitted"] += new_ids.size
            new = len(self.index)
            self._reserve(new, old)
            if init:
                self.rows[old:new] = init_rows(self.spec.initializer, self.shape, self.dtype.name, new_ids)
            for s, arr in self.row_state.items():
                arr[old:new] = self.state_init[s]
        return slots

    def pull(self, ids: np.ndarray | None = None, *, copy: bool = True) -> np.ndarray:
        """Rows of `ids` ([len(ids), dim], a copy); zeros for ids not admitted (runtime/ps/entry.py)."""
        self._ids(ids, "pull")
        ids = self.check_ids(ids)
        if self.entry is not None and self.entry.waiting is not None:
            found = self.index.find(ids)
            have = found >= 0
            out = np.zeros((ids.size, self.dim), self.dtype)
            out[have] = self.rows.take(found[have], axis=0)
            self.entry.touch(found[have], len(self.index))
            if self.changes.marks:
                self.changes.changed(ids[have])
            return out
        slots = self.slots(ids)
        if self.entry is not None:
            self.entry.touch(slots, len(self.index))
        return self.rows.take(slots, axis=0)

    def peek(self, ids: np.ndarray | None = None, *, copy: bool = True) -> np.ndarray:
        """Rows of `ids` as a pull would return them, creating nothing and touching no admission or
        eviction counters (evaluation): missing rows are the initializer's values for those ids
        (zeros while admission is on), which is what a later pull would create."""
        self._ids(ids, "pull")
        ids = self.check_ids(ids)
        found = self.index.find(ids)
        have = found >= 0
        out = np.zeros((ids.size, self.dim), self.dtype)
        out[have] = self.rows.take(found[have], axis=0)
        missing = ids[~have]
        if missing.size and not (self.entry is not None and self.entry.waiting is not None):
            if self.spec.initializer is None:
                raise PSError(
                    f"table {self.name!r} has no initializer and rows {self.shown(missing[:5])} "
                    "were never assigned (PSClient.assign)"
                )
            out[~have] = init_rows(self.spec.initializer, self.shape, self.dtype.name, missing)
        return out

    def check_push(self, grad: np.ndarray, ids: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        self._ids(ids, "push")
        ids = self.check_ids(ids)
        return self.check_grad(grad, (ids.size, self.dim), "gradient"), ids

    def sum_parts(
        self, parts: list[tuple[np.ndarray, np.ndarray]], merge: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        if len(parts) == 1 and not merge:
            return parts[0]
        ids = np.concatenate([i for _, i in parts])
        grad = np.concatenate([g for g, _ in parts])
        if merge and ids.size:
            rows = RowMerge.of(np, ids)
            ids, grad = rows.unique_rows, rows.sum(np, grad)
        return grad, ids

    def push(self, grad: np.ndarray, ids: np.ndarray | None = None, *, checked: bool = False) -> None:
        """One optimizer step with the row-sparse gradient (`ids` may repeat; their rows are summed).
        `checked`: ids and grad already went through `check_push` (sync mode checks a push on
        arrival and applies it later, once every pusher's part is in)."""
        if not checked:
            grad, ids = self.check_push(grad, ids)
        if self.entry is not None and self.entry.waiting is not None:  # admission
            uniq, inv = np.unique(ids, return_inverse=True)
            ok = self.entry.admitted(self.index.find(uniq) >= 0, uniq)[inv.ravel()]
            ids, grad = ids[ok], grad[ok]
        slots = self.slots(ids)
        n = len(self.index)
        state = {s: self.row_state[s][:n] for s in self.state_slots}
        # distinct ids have distinct slots: the kernel may skip merging and scatter with a plain add
        self._apply(self.rows[:n], SparseRows(slots, grad, n, strictly_increasing(ids)), state)
        if self.life is not None:
            self.row_state["Unseen"][slots] = 0  # seen in this pass
        if self.entry is not None:
            self.entry.touch(slots, n)
            keep = self.entry.expired(n)
            if keep is not None:
                self._drop(keep)

    def _drop(self, keep: np.ndarray) -> None:
        """Remove the rows whose slot is unset in `keep` (lifecycle eviction), recorded as changes."""
        if self.changes.marks:
            self.changes.removed(self.index.ids_by_slot()[: keep.size][~keep])
        self.counts["evicted"] += int(keep.size - np.count_nonzero(keep))
        self._keep(keep)

    def _keep(self, keep: np.ndarray, room: int = 0) -> None:
        """Drop the rows (and optimizer state) whose slot is unset in `keep`; room for `room` more."""
        ids, old = self.index.ids_by_slot()[keep], np.flatnonzero(keep)
        self.index = make_index(self.vocab, self.direct_max)
        slots, _, _ = self.index.find_or_add(ids)

        def moved(a: np.ndarray) -> np.ndarray:
            out = np.empty((ids.size + room, *a.shape[1:]), a.dtype)
            out[slots] = a[old]
            return out

        self.rows, self.row_state = moved(self.rows), {s: moved(a) for s, a in self.row_state.items()}
        if self.entry is not None:  # (a tiered table's eviction: runtime/ps/tiered.py)
            self.entry.kept(keep, slots)

    def memory_bytes(self) -> int:
        """Bytes held: rows and optimizer state (allocated capacity), the id index, admission and
        eviction bookkeeping."""
        return (
            self.rows.nbytes
            + sum(a.nbytes for a in self.row_state.values())
            + self.index.nbytes()
            + (self.entry.nbytes() if self.entry is not None else 0)
        )

    def add(self, delta: np.ndarray, ids: np.ndarray | None = None) -> None:
        """rows[ids] += delta (GEO merge; repeated ids accumulate)."""
        self._ids(ids, "add")
        ids = self.check_ids(ids)
        delta = self.check_grad(delta, (ids.size, self.dim), "delta")
        slots = self.slots(ids)  # before reading self.rows: creating rows may reallocate it
        scatter_add(np, self.rows, slots, delta)

    def assign(self, values: np.ndarray, ids: np.ndarray | None = None) -> None:
        """rows[ids] = values (optimizer state untouched)."""
        self._ids(ids, "assign")
        ids = self.check_ids(ids)
        values = self.check_grad(values, (ids.size, self.dim), "values")
        slots = self.slots(ids, init=False)
        self.rows[slots] = values

    def state_dict(self) -> dict[str, np.ndarray]:
        n = len(self.index)
        return {
            "ids": self.index.ids_by_slot(),
            "Param": self.rows[:n],
            **{s: a[:n] for s, a in self.row_state.items()},
            **self.scalars,
            **(self.entry.state_dict(n) if self.entry is not None else {}),
        }

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Set rows `arrays["ids"]` (with their optimizer state) and the scalar state."""
        slots = self.slots(self.check_ids(arrays["ids"]), init=False)
        self.rows[slots] = arrays["Param"]
        for s, a in self.row_state.items():
            a[slots] = arrays[s]
        for s in self.scalars:
            self.scalars[s][...] = arrays[s]
        if self.entry is not None and ENTRY_CLOCK in arrays:
            self.entry.load_state(slots, len(self.index), arrays)

    def state_shapes(self, arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        n = arrays["ids"].shape[0] if "ids" in arrays else 0
        want = {s: (1,) for s in self.scalars}
        want.update({"ids": (n,), "Param": (n, self.dim), **{s: (n, self.dim) for s in self.state_slots}})
        want.update({f: (n,) for f in self.life_slots})
        if self.entry is not None and ENTRY_CLOCK in arrays:  # (older checkpoints lack it)
            want.update({ENTRY_CLOCK: (1,), ENTRY_LAST: (n,)})
            if self.entry.waiting is not None:
                w = arrays[WAITING[0]].shape[0] if WAITING[0] in arrays else 0
                want.update(dict.fromkeys(WAITING, (w,)))
        return want

    def select_rows(
        self, arrays: dict[str, np.ndarray], keep: Callable[[np.ndarray], np.ndarray]
    ) -> dict[str, np.ndarray]:
        mine = keep(arrays["ids"])
        per_row = {"ids", "Param", ENTRY_LAST, *self.state_slots, *self.life_slots}
        arrays = {k: (a[mine] if k in per_row else a) for k, a in arrays.items()}
        if WAITING[0] in arrays:  # ids waiting for admission: the kept ones
            wait = keep(arrays[WAITING[0]])
            arrays.update({k: arrays[k][wait] for k in WAITING})
        return arrays

    # -- rows changed since a mark (runtime/ps/changes.py), delta checkpoints (runtime/ps/delta.py) --
    def mark(self, name: str, replay_shrinks: bool = False) -> None:
        """Start (or restart) collecting the rows changed under mark `name` (`replay_shrinks`: count
        pass ends instead of listing the rows they change, runtime/ps/changes.py)."""
        self.changes.mark(name, replay_shrinks)

    def changed_since(self, name: str) -> ChangedRows:
        """The rows changed, and the ids removed, since `mark(name)` (runtime/ps/changes.py)."""
        return self.changes.since(name, self.exists)

    def ids(self) -> np.ndarray:
        """The ids of every row held (in no particular order)."""
        return self.index.ids_by_slot()

    def exists(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` have a row."""
        return self.index.find(np.asarray(ids, np.int64)) >= 0

    def rows_of(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """The `state_dict` of the existing rows `ids` only (with their admission / eviction state)."""
        slots = self.index.find(np.asarray(ids, np.int64))
        if (slots < 0).any():
            raise PSError(f"table {self.name!r}: rows_of ids {self.shown(ids[slots < 0][:5])} have no row")
        out = {
            "ids": np.asarray(ids, np.int64),
            "Param": self.rows[slots],
            **{s: a[slots] for s, a in self.row_state.items()},
            **self.scalars,
        }
        if self.entry is not None:
            state = self.entry.state_dict(len(self.index))
            out.update(
                {k: v for k, v in state.items() if k != ENTRY_LAST}, **{ENTRY_LAST: state[ENTRY_LAST][slots]}
            )
        return out

    def remove(self, ids: np.ndarray) -> None:
        """Drop the rows of `ids` (those that exist) with their optimizer state."""
        found = self.index.find(np.asarray(ids, np.int64))
        if (found >= 0).any():
            keep = np.ones(len(self.index), bool)
            keep[found[found >= 0]] = False
            self._drop(keep)

    def apply_delta(self, arrays: dict[str, np.ndarray], origin: Callable[[np.ndarray], np.ndarray]) -> None:
        """Apply one delta of `runtime.ps.delta` (this shard's part): drop its `Deleted` ids, then set
        its rows as `load_state` does. Its waiting ids (admission) replace those of the shard that
        wrote it (`origin(ids)`: which ids that shard held)."""
        self.remove(arrays["Deleted"])
        rows = {k: a for k, a in arrays.items() if k != "Deleted"}
        if self.entry is not None and self.entry.waiting is not None and WAITING[0] in rows:
            w = self.entry.waiting
            n = len(w)
            w.keep(~origin(w.index.ids_by_slot()) if n else np.zeros(0, bool))
        self.load_state(rows)

    # -- feature lifecycle (runtime/ps/lifecycle.py) -------------------------------------------------
    def show_click(self, ids: np.ndarray, labels: np.ndarray) -> None:
        """Count a batch's shows and clicks: per existing row of `ids`, show += its occurrences,
        click += the sum of their `labels` (one per id; 1 = click). PSError without a lifecycle."""
        if self.life is None:
            raise PSError(f"table {self.name!r} has no lifecycle: show/click statistics are not kept")
        ids = self.check_ids(np.asarray(ids).reshape(-1))
        labels = np.asarray(labels, np.float64).reshape(-1)
        if labels.shape != ids.shape:
            raise PSError(f"table {self.name!r}: show_click got {ids.size} ids and {labels.size} labels")
        self.add_show_click(*counts(ids, labels))

    def add_show_click(self, ids: np.ndarray, shows: np.ndarray, clicks: np.ndarray) -> None:
        """Per existing row of `ids` (distinct): show += `shows`, click += `clicks` (the sums of a
        batch's occurrences, Paddle's push_show / push_click). PSError without a lifecycle."""
        if self.life is None:
            raise PSError(f"table {self.name!r} has no lifecycle: show/click statistics are not kept")
        have = self.exists(ids)
        slots = self.slots(ids[have], init=False)
        self.row_state["Show"][slots] += shows[have]
        self.row_state["Click"][slots] += clicks[have]
        if self.changes.marks:
            self.changes.changed(ids[have])

    def shrink(self, which: Callable[[np.ndarray], np.ndarray] | None = None) -> int:
        """A pass end: decay show/click, remove the rows whose score or unseen passes say so, count
        one more unseen pass for the others (runtime/ps/lifecycle.py); the rows removed. `which(ids)`:
        only those rows (a delta's replay on the rows of the shard that wrote it)."""
        if self.life is None:
            return 0
        n = len(self.index)
        if which is None:
            keep = shrink(self.life, *(self.row_state[f][:n] for f in LIFE))
        else:
            keep = self._shrink_some(which(self.index.ids_by_slot()), n)
        if self.changes.marks:  # (every row's show, click and unseen passes changed)
            self.changes.pass_end()
            self.changes.shrunk(self.index.ids_by_slot()[keep])
        gone = n - int(np.count_nonzero(keep))
        if gone:
            self._drop(keep)
        return gone

    def _shrink_some(self, sel: np.ndarray, n: int) -> np.ndarray:
        """`shrink` of the rows in slots `sel` (a mask over the `n` slots): the keep mask."""
        fields = [self.row_state[f][:n] for f in LIFE]
        part = [f[sel] for f in fields]
        keep = np.ones(n, bool)
        keep[sel] = shrink(self.life, *part)
        for f, p in zip(fields, part, strict=True):
            f[sel] = p
        return keep

    def table_counts(self) -> dict[str, int]:
        """Rows held, rows admitted (created) and evicted (by their lifecycle) since the table was
        made, rows spilled to disk (a tiered table's)."""
        return {"rows": len(self), **self.counts, "spilled": 0}
