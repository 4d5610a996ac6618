"""Executor: runs a program op by op on a Scope of named arrays, with kernels from the registry.

A program is compiled once into a list of steps (kernel, slots, merged attrs) and cached by
(program identity, version), so per-op dispatch is a few dict operations. Persistable vars live in
the scope across runs; everything else lives for one run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from ops_registry import get_op
from transpiler.ir import Op, Program, Var


class ExecutionError(RuntimeError):
    """A kernel failed; the message names the op, its inputs with shapes, and the cause."""


class MissingFeedError(KeyError):
    def __str__(self) -> str:
        return self.args[0]


@dataclass
class _Step:
    op: Op
    kernel: Callable
    ins: list[tuple[str, list[str], bool]]   # slot, names, variadic
    outs: list[tuple[str, list[str], bool]]
    attrs: dict[str, Any]
    needs_rng: bool


Handler = Callable[[Op, dict[str, Any]], None]


class Executor:
    """`Executor().run(program, feed={name: array}, fetch_list=[names or Vars]) -> [arrays]`.

    `handlers` maps op types to callables `(op, values)` that the runtime supplies for ops whose
    work is not a kernel (send/recv, parameter-server pull/push). `xp` is the array namespace
    (numpy, or cupy on a CUDA device).
    """

    def __init__(self, xp: Any = np, handlers: dict[str, Handler] | None = None) -> None:
        self.xp = xp
        self.scope: dict[str, Any] = {}
        self.handlers = dict(handlers or {})
        self._cache: dict[tuple[int, int], tuple[Program, list[_Step]]] = {}
        self.run_count = 0

    # -- compilation -------------------------------------------------------------------
    def _compile(self, program: Program) -> list[_Step]:
        key = (id(program), program.version)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is program:
            return hit[1]
        steps = []
        for i, op in enumerate(program.ops):
            opdef = get_op(op.type, where=f"op #{i} (id {op.id})")
            kernel = self.handlers.get(op.type) or opdef.kernel
            if kernel is None:
                raise ExecutionError(f"op #{i} {op.type!r} has no kernel and no runtime handler; it "
                                     "runs only inside the hetps runtime (runtime.train / simulate)")
            attrs = {**opdef.attrs, **op.attrs}
            ins = [(s, op.inputs[s], opdef.is_variadic(s)) for s in opdef.in_slots if s in op.inputs]
            outs = [(s, op.outputs[s], opdef.is_variadic(s)) for s in opdef.out_slots if s in op.outputs]
            steps.append(_Step(op, kernel, ins, outs, attrs, opdef.needs_rng))
        self._cache[key] = (program, steps)
        return steps

    # -- running -------------------------------------------------------------------------
    def run(self, program: Program, feed: dict[str, Any] | None = None,
            fetch_list: Iterable[str | Var] | None = None, return_numpy: bool = True) -> list[Any]:
        """Run every op of `program` once; return the fetched values (numpy arrays)."""
        steps = self._compile(program)
        feed = feed or {}
        values: dict[str, Any] = dict(self.scope)
        for name, arr in program.params.items():
            if name not in values:
                values[name] = self.xp.asarray(arr)
                self.scope[name] = values[name]
        block = program.global_block()
        for s in steps:
            if s.op.type == "data":
                name = s.op.outputs["Out"][0]
                values[name] = self._feed_value(block.vars.get(name), name, feed, s.op)
                continue
            self._run_step(s, values)
        for name, var in block.vars.items():
            if var.persistable and name in values:
                self.scope[name] = values[name]
        self.run_count += 1
        out = []
        for f in fetch_list or []:
            name = f.name if isinstance(f, Var) else f
            if name not in values:
                raise KeyError(f"fetch {name!r}: no op of the program produced it and it is not in "
                               "the scope")
            v = values[name]
            out.append(_to_numpy(v) if return_numpy else v)
        return out

    def _run_step(self, s: _Step, values: dict[str, Any]) -> None:
        if s.op.type in self.handlers:
            s.kernel(s.op, values)
            return
        try:
            ins = {slot: ([values[n] for n in names] if var else values[names[0]])
                   for slot, names, var in s.ins}
        except KeyError as e:
            raise ExecutionError(f"op {s.op.type!r} (id {s.op.id}) reads {e.args[0]!r}, which no "
                                 "earlier op produced, no feed gave and the scope lacks") from None
        attrs = s.attrs
        if s.needs_rng:
            attrs = {**attrs, "_rng_step": self.run_count}
        try:
            res = s.kernel(self.xp, ins, attrs)
        except ExecutionError:
            raise
        except Exception as e:
            desc = ", ".join(f"{slot}={names}:{_shape_of(ins.get(slot))}" for slot, names, _ in s.ins)
            raise ExecutionError(f"op {s.op.type!r} (id {s.op.id}) failed on inputs {desc}: "
                                 f"{type(e).__name__}: {e}") from e
        for slot, names, var in s.outs:
            if slot not in res:
                continue
            if var:
                for n, v in zip(names, res[slot]):
                    if n:
                        values[n] = v
            elif names[0]:
                values[names[0]] = res[slot]

    def _feed_value(self, var: Var | None, name: str, feed: dict[str, Any], op: Op) -> Any:
        if name not in feed:
            raise MissingFeedError(f"missing feed for data variable {name!r} (data op id {op.id}); "
                                   f"fed: {sorted(feed)}")
        arr = feed[name]
        if var is None:
            return self.xp.asarray(arr)
        arr = np.asarray(arr) if not hasattr(arr, "__cuda_array_interface__") else arr
        if var.shape is not None:
            ok = len(arr.shape) == len(var.shape) and all(
                d == -1 or d == a for d, a in zip(var.shape, arr.shape))
            if not ok:
                raise ValueError(f"feed {name!r} has shape {list(arr.shape)}, expected "
                                 f"{list(var.shape)} (-1 = any)")
        want = np.dtype(var.dtype)
        if arr.dtype != want:
            if arr.dtype.kind != want.kind and not (arr.dtype.kind in "iu" and want.kind in "iu"):
                raise TypeError(f"feed {name!r} has dtype {arr.dtype}, expected {want}")
            arr = arr.astype(want)
        return self.xp.asarray(arr)


def _shape_of(v: Any) -> Any:
    if isinstance(v, list):
        return [_shape_of(x) for x in v]
    return list(getattr(v, "shape", ())) if v is not None else None


def _to_numpy(v: Any) -> Any:
    if hasattr(v, "get") and hasattr(v, "__cuda_array_interface__"):
        return v.get()
    if hasattr(v, "to_dense"):
        return v
    return np.asarray(v)
