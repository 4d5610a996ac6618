"""OpDef, the registry, and the sparse-gradient value type.

An op type is described once here and used by every layer: the placement pass reads `category`,
the builder and verifier read `infer_shape`, the executor calls `kernel`, and the backward pass
asks `grad` to emit gradient ops. Nothing in this package imports `transpiler` or `runtime`.

Slot names follow ONNX's schema names where an ONNX op exists (Add: A, B -> C), so ONNX import is a
positional-to-named mapping. A kernel receives `ins` {slot: array | list of arrays for variadic
slots} and returns {slot: array | list}. A gradient rule receives a `GradEmitter` (any object with
the methods used below, supplied by the backward pass) and emits ops through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ops_registry import compiled
from ops_registry.compiled import COMPILED_FROM
from ops_registry.errors import HetpsError

CATEGORIES = ("io", "sparse", "dense", "light", "loss", "optimizer", "comm", "init")


class UnknownOpError(HetpsError, KeyError):
    """An op type that the registry does not know."""

    def __init__(self, op_type: str, where: str = "") -> None:
        self.op_type = op_type
        self.where = where
        at = f" (from {where})" if where else ""
        msg = f"unknown op type {op_type!r}{at}; supported op types: " + ", ".join(
            sorted(n for n in _REGISTRY if not n.endswith("_grad"))
        )
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return self.args[0]


@dataclass
class SparseRows:
    """A row-sparse gradient of a [height, dim] table (Paddle's SelectedRows).

    `rows` may repeat; the dense equivalent is the scatter-add of `values` into `rows`. `unique`
    says the rows are known not to repeat (e.g. `merged`'s output): then `merged` returns the rows
    as they are and an update is a plain indexed add instead of an unbuffered scatter (~4x faster).
    """

    rows: Any
    values: Any
    height: int
    unique: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.height, *self.values.shape[1:])

    @property
    def dtype(self):
        return self.values.dtype

    def merged(self, xp, merge: RowMerge | None = None) -> SparseRows:
        """Unique rows with their values summed (what a parameter server wants pushed). `merge`: the
        `RowMerge` of these rows when the caller has it (one sort serves several tables' rows)."""
        rows = self.rows.reshape(-1)
        if self.unique or rows.size == 0:
            return SparseRows(rows, self.values, self.height, unique=True)
        merge = merge if merge is not None else RowMerge.of(xp, rows)
        return SparseRows(merge.unique_rows, merge.sum(xp, self.values), self.height, unique=True)

    def to_dense(self, xp):
        out = xp.zeros(self.shape, self.values.dtype)
        scatter_add(xp, out, self.rows, self.values, unique=self.unique)
        return out


@dataclass(frozen=True)
class RowMerge:
    """One stable sort of a row index, reusable for every array of values over those rows: the
    sorted unique rows and the segmented sum that merges repeated rows' values."""

    order: Any  # positions of the rows in sorted order (stable)
    starts: Any  # where each unique row's run begins in that order
    unique_rows: Any  # the sorted unique rows

    @staticmethod
    def of(xp, rows) -> RowMerge:
        return RowMerge.sorted(xp, rows, stable_argsort(xp, rows))

    @staticmethod
    def sorted(xp, rows, order, lo: int = 0) -> RowMerge:
        """The RowMerge of `rows` taken in the stable sorted `order` (positions relative to `lo`)."""
        sorted_rows = rows[order]
        starts = xp.concatenate(
            [
                xp.zeros(min(1, order.size), dtype=order.dtype),
                xp.flatnonzero(sorted_rows[1:] != sorted_rows[:-1]) + 1,
            ]
        )
        return RowMerge(order - lo if lo else order, starts, sorted_rows[starts])

    def part(self, xp, rows, lo: int, hi: int) -> RowMerge:
        """The RowMerge of rows[lo:hi] alone (`rows`: what this one sorted), from this one's sort:
        one pass keeps, in sorted order, the positions inside [lo, hi), relative to lo."""
        if lo == 0 and hi == self.order.size:
            return self
        return RowMerge.sorted(xp, rows, self.order[(self.order >= lo) & (self.order < hi)], lo)

    def inverse(self, xp):
        """For each original row, the position of its value among `unique_rows`."""
        run = xp.zeros(self.order.size, dtype=self.order.dtype)
        run[self.starts[1:]] = 1
        inv = xp.empty_like(run)
        inv[self.order] = xp.cumsum(run)
        return inv

    def sum(self, xp, values):
        """values[i] summed per unique row (sorted order)."""
        if self.starts.size == self.order.size:  # already unique: nothing to sum
            return values[self.order]
        floats = xp.__name__ == "numpy" and values.ndim == 2 and values.dtype.kind == "f"
        if floats and len(values) >= COMPILED_FROM:
            return compiled.segment_sum()(self.order, self.starts, np.ascontiguousarray(values))
        # a segmented sum over the sorted rows: far cheaper than np.add.at's unbuffered scatter
        return xp.add.reduceat(values[self.order], self.starts, axis=0)


def stable_argsort(xp, rows):
    """`xp.argsort(rows, kind="stable")` of a 1-D index. On numpy, from `COMPILED_FROM` non-negative
    integer rows, a compiled LSD radix sort (11-bit digits, as many passes as the largest row needs): a
    CTR step's 13 312 ids sort in 73 µs against numpy's 570 (timsort, its stable sort of int64)."""
    if (
        xp.__name__ != "numpy"
        or rows.ndim != 1
        or rows.dtype.kind not in "iu"
        or rows.dtype.itemsize > 8
        or len(rows) < COMPILED_FROM
        or rows.min() < 0
        or (rows.dtype.kind == "u" and rows.max() > np.iinfo(np.int64).max)
    ):
        return xp.argsort(rows, kind="stable")
    return compiled.radix_argsort()(rows.astype(np.int64, copy=False))


def scatter_add(xp, target, index, values, unique: bool = False) -> None:
    """target[index] += values with repeated indices accumulated (np.add.at / cupyx.scatter_add).
    `unique`: the caller knows `index` does not repeat, so a plain indexed add is exact (and ~4x
    faster than numpy's unbuffered add.at). On numpy, rows of a 2-D float table from
    `COMPILED_FROM` rows on: one compiled pass in index order (`compiled.add_rows`), the same sums as
    np.add.at (5 900 rows of 16 into a 2.6M-row table: 44 µs against 218 for the indexed add)."""
    if (
        xp.__name__ == "numpy"
        and target.ndim == 2
        and target.dtype.kind == "f"
        and getattr(values, "dtype", None) == target.dtype
        and isinstance(index, np.ndarray)  # (not a tuple of index arrays)
        and index.ndim == 1
        and index.dtype.kind in "iu"
        and len(index) >= COMPILED_FROM
        and values.shape == (len(index), target.shape[1])
    ):
        compiled.add_rows()(target, index, values)
    elif unique:
        target[index] += values
    elif xp.__name__ == "numpy":
        xp.add.at(target, index, values)
    else:  # cupy
        cupyx_of(xp).scatter_add(target, index, values)


def cupyx_of(xp) -> Any:
    """The cupyx module that goes with array library `xp` (cupy); a stand-in for cupy (the tests'
    `fake_cupy`) carries its own as `xp.cupyx`."""
    own = getattr(xp, "cupyx", None)
    if own is not None:
        return own
    import cupyx

    return cupyx


class GradEmitter(Protocol):
    """What a gradient rule may call; implemented by `transpiler.passes.backward`."""

    def input(self, slot: str) -> list[str]: ...
    def output(self, slot: str) -> list[str]: ...
    def out_grad(self, slot: str) -> list[str | None]: ...
    def in_grad(self, slot: str) -> list[str | None]: ...
    def emit(self, type: str, inputs: dict, outputs: dict, attrs: dict | None = None) -> None: ...


Kernel = Callable[..., dict]


@dataclass
class OpDef:
    """Everything hetps knows about one op type.

    - `inputs` / `outputs`: slot names in order; a trailing `*` marks a variadic slot, a trailing
      `?` an optional one (both are stripped in `in_slots` / `out_slots`).
    - `kernel(xp, ins, attrs) -> outs`.
    - `vjp(xp, ins, outs, douts, attrs) -> {input slot: grad}`: the vector-Jacobian product; when
      given, a `<name>_grad` op is registered automatically and the default `grad` rule emits it.
      `douts[slot]` is None when that output gets no gradient.
    - `no_grad`: input slots that are never differentiable (indices, labels, shapes).
    - `infer_shape(in_shapes, attrs) -> {out slot: shape}`, shapes as tuples with -1 for unknown.
    - `onnx`: the ONNX op type this op implements (for import/export), if any.
    - `needs_rng`: the executor passes `attrs["_rng_step"]`, a counter that makes random kernels
      reproducible run to run and trainer to trainer.
    """

    name: str
    category: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    kernel: Kernel | None = None
    vjp: Callable[..., dict] | None = None
    no_grad: tuple[str, ...] = ()
    infer_shape: Callable[[dict, dict], dict] | None = None
    grad: Callable[[GradEmitter, Any], None] | None = None
    onnx: str | None = None
    needs_rng: bool = False
    attrs: dict[str, Any] = field(default_factory=dict)  # defaults, merged under the op's attrs
    doc: str = ""

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"op {self.name!r}: category {self.category!r} not in {CATEGORIES}")
        if self.grad is None and self.vjp is not None:
            self.grad = _default_grad
        if not self.doc and self.kernel is not None:
            self.doc = (self.kernel.__doc__ or "").strip()

    @property
    def in_slots(self) -> list[str]:
        return [s.rstrip("*?") for s in self.inputs]

    @property
    def out_slots(self) -> list[str]:
        return [s.rstrip("*?") for s in self.outputs]

    def is_variadic(self, slot: str) -> bool:
        return f"{slot}*" in self.inputs or f"{slot}*" in self.outputs

    @property
    def differentiable(self) -> bool:
        return self.grad is not None

    def diff_inputs(self) -> list[str]:
        return [s for s in self.in_slots if s not in self.no_grad]


def _default_grad(g: GradEmitter, op) -> None:
    """Emit one `<type>_grad` op: forward inputs, outputs and output grads in; input grads out."""
    opdef = get_op(op.type)
    inputs = {s: list(v) for s, v in op.inputs.items()}
    for s, names in op.outputs.items():
        inputs[f"{s}@OUT"] = list(names)
        grads = g.out_grad(s)
        if any(n is not None for n in grads):
            inputs[f"{s}@GRAD"] = [n or "" for n in grads]
    outputs = {}
    for s in opdef.diff_inputs():
        if s in op.inputs:
            grads = g.in_grad(s)
            if any(n is not None for n in grads):
                outputs[f"{s}@GRAD"] = [n or "" for n in grads]
    if outputs:
        g.emit(f"{op.type}_grad", inputs, outputs, dict(op.attrs))


def _grad_kernel_for(fwd: OpDef) -> Kernel:
    def kernel(xp, ins, attrs):
        fwd_ins = {s: ins[s] for s in fwd.in_slots if s in ins}
        outs = {s: ins[f"{s}@OUT"] for s in fwd.out_slots if f"{s}@OUT" in ins}
        douts = {s: ins.get(f"{s}@GRAD") for s in fwd.out_slots}
        grads = fwd.vjp(xp, fwd_ins, outs, douts, attrs)
        return {f"{s}@GRAD": g for s, g in grads.items()}

    kernel.__doc__ = f"Gradient of {fwd.name}: input grads from output grads (vector-Jacobian product)."
    return kernel


_REGISTRY: dict[str, OpDef] = {}
_BY_ONNX: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Add an op type (and its `_grad` op when it has a vjp). Re-registering a name is an error."""
    if opdef.name in _REGISTRY:
        raise ValueError(f"op type {opdef.name!r} registered twice")
    _REGISTRY[opdef.name] = opdef
    if opdef.onnx:
        _BY_ONNX[opdef.onnx] = opdef
    if opdef.vjp is not None:

        def mark(slot: str, suffix: str) -> str:  # keep variadic slots variadic, others optional
            return f"{slot}{suffix}" + ("*" if opdef.is_variadic(slot) else "?")

        grad_ins = tuple(opdef.inputs) + tuple(mark(s, "@OUT") for s in opdef.out_slots)
        grad_ins += tuple(mark(s, "@GRAD") for s in opdef.out_slots)
        register(
            OpDef(
                name=f"{opdef.name}_grad",
                category=opdef.category,
                inputs=grad_ins,
                outputs=tuple(mark(s, "@GRAD") for s in opdef.diff_inputs()),
                kernel=_grad_kernel_for(opdef),
                attrs=dict(opdef.attrs),
            )
        )
    return opdef


def get_op(op_type: str, where: str = "") -> OpDef:
    """The OpDef of `op_type`; UnknownOpError (naming it, `where` it came from, and all known types)."""
    try:
        return _REGISTRY[op_type]
    except KeyError:
        raise UnknownOpError(op_type, where) from None


def has_op(op_type: str) -> bool:
    return op_type in _REGISTRY


def by_onnx(onnx_type: str) -> OpDef | None:
    """The OpDef implementing ONNX op type `onnx_type`, or None."""
    return _BY_ONNX.get(onnx_type)


def list_ops() -> list[str]:
    return sorted(_REGISTRY)


def static_arg(ins: dict, attrs: dict, name: str) -> Any:
    """The value of an argument ONNX passes as a tensor input but that is usually a constant
    (Reshape's shape, ReduceSum's axes, Slice's starts, Dropout's ratio, ...).

    Such an op lists `name` both as an optional input slot and as an attribute (with its default):
    a fed tensor wins, else the attribute (the ONNX importer folds constant inputs into it). Tensors
    come back as Python scalars / lists, so kernels and shape rules see one form.
    """
    if name in ins:
        return ins[name].tolist()
    return attrs.get(name)


def unbroadcast(xp, grad, shape) -> Any:
    """Sum `grad` down to `shape`: the adjoint of numpy/ONNX multidirectional broadcasting."""
    shape = tuple(shape)
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and grad.shape[lead + i] != 1
    )
    out = grad.sum(axis=axes, keepdims=True) if axes else grad
    return out.reshape(shape)
