"""Executor: runs a program op by op on a Scope of named arrays, with kernels from the registry.

A program is compiled once into a list of steps (kernel, slots, merged attrs) and cached by
(program identity, version), so per-op dispatch is a few dict operations. Persistable vars live in
the scope across runs; everything else lives until its last use in the run (or to the fetch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np

from ops_registry import get_op
from ops_registry.errors import HetpsError
from runtime.exec.device import to_host
from transpiler.ir import Op, Program, Var


class ExecutionError(HetpsError, RuntimeError):
    """A kernel failed; the message names the op, its inputs with shapes, and the cause."""


class MissingFeedError(HetpsError, KeyError):
    def __str__(self) -> str:
        return self.args[0]


@dataclass(slots=True)
class _Step:
    op: Op
    kernel: Callable
    ins: list[tuple[str, Any, bool]]  # slot, name (a list of names when variadic), variadic
    outs: list[tuple[str, Any, bool, tuple | None]]  # ..., the declared shape's check (_shape_check)
    attrs: dict[str, Any]
    needs_rng: bool
    handler: bool
    frees: list[str]  # non-persistable vars no later step uses: dropped after this one


@dataclass(frozen=True)
class RunContext:
    """A plain context for `Executor.run(..., ctx=)`: the step that seeds random ops (a runner
    with more to tell its handlers passes its own record with a `step`, e.g. a trainer's item)."""

    step: int


@dataclass
class _Compiled:
    program: Program  # held so that id(program) in the cache key cannot be reused
    feeds: list[tuple[str, Var | None, Op]]
    steps: list[_Step]
    persistable: list[str]


Handler = Callable[[Op, dict[str, Any], Any], None]  # (op, values, the run's ctx)


def _shape_check(var: Var | None) -> tuple | None:
    """(declared shape, its ndim, getter of its fixed dims, their values): a cheap test of an output
    against its declared shape, -1 dims matching anything. None when the shape is unknown."""
    if var is None or var.shape is None:
        return None
    fixed = [i for i, d in enumerate(var.shape) if d != -1]
    get = itemgetter(*fixed) if fixed else None
    return var.shape, len(var.shape), get, get(var.shape) if get else None


class Executor:
    """`Executor().run(program, feed={name: array}, fetch_list=[names or Vars]) -> [arrays]`.

    `handlers` maps op types to callables `(op, values, ctx)` that the runtime supplies for ops
    whose work is not a kernel (send/recv, parameter-server pull/push: `runtime.exec.comm_ops`); `ctx` is
    what the caller passed to `run`. `xp` is the array namespace (numpy, or cupy on a CUDA device);
    `graphs` (`runtime.exec.graphs.DeviceGraphs`, on a device) replays each program's kernels as
    captured CUDA graphs after a warm-up. Every kernel output is checked against the shape the
    program declares for it, so a wrong-shaped parameter or feed cannot broadcast silently.
    """

    def __init__(self, xp: Any = np, handlers: dict[str, Handler] | None = None, graphs: Any = None) -> None:
        self.xp = xp
        self.graphs = graphs  # runtime.exec.graphs.DeviceGraphs: segments replayed as CUDA graphs
        self.scope: dict[str, Any] = {}
        self.handlers = dict(handlers or {})
        self._cache: dict[tuple[int, int], _Compiled] = {}
        self.run_count = 0

    # -- compilation -------------------------------------------------------------------
    def _compile(self, program: Program) -> _Compiled:
        key = (id(program), program.version)
        hit = self._cache.get(key)
        if hit is not None and hit.program is program:
            return hit
        block = program.global_block()
        feeds, steps = [], []
        for i, op in enumerate(program.ops):
            opdef = get_op(op.type, where=f"op #{i} (id {op.id})")
            if op.type == "data":
                name = op.outputs["Out"][0]
                feeds.append((name, block.vars.get(name), op))
                continue
            kernel = self.handlers.get(op.type) or opdef.kernel
            if kernel is None:
                raise ExecutionError(
                    f"op #{i} {op.type!r} has no kernel and no runtime handler; it "
                    "runs only inside the hetps runtime (train / simulate)"
                )
            attrs = {**opdef.attrs, **op.attrs}
            ins = [
                (s, op.inputs[s] if opdef.is_variadic(s) else op.inputs[s][0], opdef.is_variadic(s))
                for s in opdef.in_slots
                if s in op.inputs
            ]
            outs = [
                (s, op.outputs[s], True, None)
                if opdef.is_variadic(s)
                else (s, op.outputs[s][0], False, _shape_check(block.vars.get(op.outputs[s][0])))
                for s in opdef.out_slots
                if s in op.outputs
            ]
            steps.append(_Step(op, kernel, ins, outs, attrs, opdef.needs_rng, op.type in self.handlers, []))
        persistable = [n for n, v in block.vars.items() if v.persistable]
        last_use = {n: i for i, s in enumerate(steps) for n in s.op.input_names() + s.op.output_names()}
        for n in set(last_use) - set(persistable):
            steps[last_use[n]].frees.append(n)
        compiled = self._cache[key] = _Compiled(program, feeds, steps, persistable)
        return compiled

    # -- running -------------------------------------------------------------------------
    def run(
        self,
        program: Program,
        feed: dict[str, Any] | None = None,
        fetch_list: Iterable[str | Var] | None = None,
        return_numpy: bool = True,
        *,
        scope: dict[str, Any] | None = None,
        ctx: Any = None,
    ) -> list[Any]:
        """Run every op of `program` once; return the fetched values (numpy arrays, or the
        executor's own arrays with `return_numpy=False`).

        `scope`: the persistable values to read and update (default: the executor's own `scope`);
        `ctx`: handed to every handler as its third argument (what this run is about, e.g. a
        trainer's micro-batch); its `step` attribute, when it has one, seeds random ops (dropout)
        instead of the executor's count of runs."""
        compiled = self._compile(program)
        scope = self.scope if scope is None else scope
        fetch = [f.name if isinstance(f, Var) else f for f in fetch_list or ()]
        values = self._bind(compiled, program, feed or {}, scope)
        step = getattr(ctx, "step", None)
        rng = self.run_count if step is None else step
        if self.graphs is None:
            self._execute(compiled.steps, values, set(fetch), ctx, rng)
        else:
            self.graphs.execute(compiled, values, set(fetch), ctx, rng, self._execute)
        for name in compiled.persistable:
            if name in values:
                scope[name] = values[name]
        self.run_count += 1
        return [self._fetched(values, name, return_numpy) for name in fetch]

    def _bind(
        self, compiled: _Compiled, program: Program, feed: dict[str, Any], scope: dict[str, Any]
    ) -> dict[str, Any]:
        """The run's starting values: the scope, the program's parameters (copied into the scope
        on first use: training updates scope values in place, the program's own stay initial), the
        feeds (checked against their data vars)."""
        values: dict[str, Any] = dict(scope)
        for name, arr in program.params.items():
            if name not in values:
                var = program.vars.get(name)
                if var is not None and var.shape is not None and tuple(np.shape(arr)) != var.shape:
                    raise ValueError(
                        f"parameter {name!r} has a value of shape {list(np.shape(arr))}, "
                        f"but the program declares {list(var.shape)}"
                    )
                values[name] = scope[name] = self.xp.array(arr, copy=True)
        for name, var, op in compiled.feeds:
            values[name] = self._feed_value(var, name, feed, op)
        return values

    def _execute(
        self, steps: list[_Step], values: dict[str, Any], keep: set[str], ctx: Any, rng: int
    ) -> None:
        xp, rng_step = self.xp, {"_rng_step": rng}
        for s in steps:  # the hot loop: keep it free of anything but dispatch
            if s.handler:
                s.kernel(s.op, values, ctx)
                continue
            ins = {}
            try:
                for slot, names, var in s.ins:  # "" in a variadic slot: no value (no gradient)
                    ins[slot] = [values[n] if n else None for n in names] if var else values[names]
                res = s.kernel(xp, ins, {**s.attrs, **rng_step} if s.needs_rng else s.attrs)
            except Exception as e:
                raise _step_error(s, ins, e) from e
            _store(s, res, values, ins)
            for name in s.frees:  # free early: numpy reuses the memory, peak memory stays low
                if name not in keep:
                    values.pop(name, None)

    @staticmethod
    def _fetched(values: dict[str, Any], name: str, return_numpy: bool) -> Any:
        if name not in values:
            raise KeyError(f"fetch {name!r}: no op of the program produced it and it is not in the scope")
        return to_host(values[name]) if return_numpy else values[name]

    def _feed_value(self, var: Var | None, name: str, feed: dict[str, Any], op: Op) -> Any:
        if name not in feed:
            raise MissingFeedError(
                f"missing feed for data variable {name!r} (data op id {op.id}); fed: {sorted(feed)}"
            )
        arr = feed[name]
        if var is None:
            return self.xp.asarray(arr)
        return self.xp.asarray(check_feed(name, arr, var))


def check_feed(name: str, arr: Any, var: Var) -> Any:
    """`arr` as the data variable `var` takes it (ints cast to its int dtype); ValueError /
    TypeError naming the feed when its shape or dtype does not fit."""
    arr = np.asarray(arr) if not hasattr(arr, "__cuda_array_interface__") else arr
    if var.shape is not None:
        ok = len(arr.shape) == len(var.shape) and all(
            d == -1 or d == a for d, a in zip(var.shape, arr.shape, strict=True)
        )
        if not ok:
            raise ValueError(
                f"feed {name!r} has shape {list(arr.shape)}, expected {list(var.shape)} (-1 = any)"
            )
    want = np.dtype(var.dtype)
    if arr.dtype != want:
        if arr.dtype.kind != want.kind and not (arr.dtype.kind in "iu" and want.kind in "iu"):
            raise TypeError(f"feed {name!r} has dtype {arr.dtype}, expected {want}")
        arr = arr.astype(want)
    return arr


def _store(s: _Step, res: dict[str, Any], values: dict[str, Any], ins: dict[str, Any]) -> None:
    """Put a kernel's outputs into `values`, each checked against its declared shape."""
    for slot, names, var, check in s.outs:
        v = res.get(slot)
        if v is None:
            continue
        if var:
            for n, x in zip(names, v, strict=False):
                if n:
                    values[n] = x
        elif names:
            values[names] = v
            if check is not None:
                want, ndim, get, fixed = check
                shape = getattr(v, "shape", None)
                if shape is not None and (len(shape) != ndim or (get and get(shape) != fixed)):
                    raise ExecutionError(
                        f"op {s.op.type!r} (id {s.op.id}) made {names!r} with shape {list(shape)}, but "
                        f"the program declares {list(want)} (-1 = any); inputs {_describe(s, ins)}"
                    )


def _describe(s: _Step, ins: dict[str, Any]) -> str:
    return ", ".join(f"{slot}={names}:{_shape_of(ins.get(slot))}" for slot, names, _ in s.ins)


def _step_error(s: _Step, ins: dict[str, Any], e: Exception) -> Exception:
    """The exception to raise for a failed step: names the op, its inputs and their shapes."""
    if isinstance(e, ExecutionError):
        return e
    if isinstance(e, KeyError) and len(ins) < len(s.ins):  # an input value was missing
        return ExecutionError(
            f"op {s.op.type!r} (id {s.op.id}) reads {e.args[0]!r}, which no earlier "
            "op produced, no feed gave and the scope lacks"
        )
    return ExecutionError(
        f"op {s.op.type!r} (id {s.op.id}) failed on inputs {_describe(s, ins)}: {type(e).__name__}: {e}"
    )


def _shape_of(v: Any) -> Any:
    if isinstance(v, list):
        return [_shape_of(x) for x in v]
    return list(getattr(v, "shape", ())) if v is not None else None
