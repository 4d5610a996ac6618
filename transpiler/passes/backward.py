"""append_backward: gradient ops from the registry's gradient rules (reverse-mode AD over the IR)."""

from __future__ import annotations

from ops_registry import get_op
from transpiler.errors import PlanError
from transpiler.ir import Op, Program, Var, grad_name


def _producers(ops: list[Op]) -> dict[str, Op]:
    return {n: op for op in ops for n in op.output_names()}


class _Backward:
    """State of one backward pass: which vars need gradients and their pending contributions."""

    def __init__(self, program: Program, need: set[str]) -> None:
        self.program = program
        self.block = program.global_block()
        self.need = need
        self.contrib: dict[str, list[tuple[Op, str, int]]] = {}  # var -> (op, slot, index)
        self.ready: set[str] = set()

    def grad_var(self, name: str, gname: str) -> str:
        v = self.block.var(name)
        if not self.block.has_var(gname):
            self.block.create_var(gname, shape=v.shape, dtype=v.dtype, is_sparse=v.is_sparse)
        return gname

    def emit(self, fwd: Op, type: str, inputs: dict, outputs: dict, attrs: dict | None) -> Op:
        attrs = dict(attrs or {})
        attrs.update(op_role="backward", fwd_id=fwd.id, op_device=fwd.device)
        op = self.program.append_op(type, inputs, outputs, attrs)
        for slot, names in op.outputs.items():
            for i, n in enumerate(names):
                base = n.split("@GRAD@RENAME@")[0]
                if "@GRAD@RENAME@" in n:
                    self.contrib.setdefault(base, []).append((op, slot, i))
        return op

    def materialize(self, name: str, at: Op) -> None:
        """Give `name@GRAD` its final value: the single contribution renamed, or a `sum` op."""
        parts = self.contrib.pop(name, [])
        if not parts or name in self.ready:
            return
        gname = self.grad_var(name, grad_name(name))
        if len(parts) == 1:
            op, slot, i = parts[0]
            tmp = op.outputs[slot][i]
            op.outputs[slot][i] = gname
            del self.block.vars[tmp]
        else:
            names = [op.outputs[slot][i] for op, slot, i in parts]
            self.emit(at, "sum", {"data_0": names}, {"sum": [gname]}, {})
        self.ready.add(name)


class _Emitter:
    """The object a gradient rule talks to (ops_registry.base.GradEmitter)."""

    def __init__(self, bw: _Backward, op: Op) -> None:
        self.bw, self.op = bw, op
        self._n = 0

    def input(self, slot: str) -> list[str]:
        return self.op.inputs.get(slot, [])

    def output(self, slot: str) -> list[str]:
        return self.op.outputs.get(slot, [])

    def out_grad(self, slot: str) -> list[str | None]:
        return [grad_name(n) if n in self.bw.ready else None for n in self.output(slot)]

    def in_grad(self, slot: str) -> list[str | None]:
        out = []
        for n in self.input(slot):
            if n in self.bw.need:
                k = len(self.bw.contrib.get(n, [])) + self._n
                self._n += 1
                out.append(self.bw.grad_var(n, f"{grad_name(n)}@RENAME@{self.op.id}_{k}"))
            else:
                out.append(None)
        return out

    def emit(self, type: str, inputs: dict, outputs: dict, attrs: dict | None = None) -> None:
        self.bw.emit(self.op, type, inputs, outputs, attrs)


def _requiring(block, ops: list, requires: set[str], blocked: set[str]) -> set[str]:
    """The vars that depend on a var of `requires` (forward order), stopped by stop_gradient / `blocked`."""
    for op in ops:
        opdef = get_op(op.type, where=f"op id {op.id}")
        if not opdef.differentiable:
            continue
        if any(n in requires for s in opdef.diff_inputs() for n in op.inputs.get(s, [])):
            requires.update(
                n for n in op.output_names() if not block.var(n).stop_gradient and n not in blocked
            )
    return requires


def _reaching(ops: list, loss: str) -> tuple[set[str], list]:
    """The vars `loss` depends on through differentiable ops, and those ops (in reverse order)."""
    reach, relevant = {loss}, []
    for op in reversed(ops):
        if not set(op.output_names()) & reach:
            continue
        opdef = get_op(op.type)
        if not opdef.differentiable:
            continue
        relevant.append(op)
        reach.update(n for s in opdef.diff_inputs() for n in op.inputs.get(s, []))
    return reach, relevant


def append_backward(
    program: Program,
    loss: str | Var,
    parameter_list: list[str] | None = None,
    no_grad_set: set[str] | None = None,
) -> list[tuple[str, str]]:
    """Append gradient ops for scalar `loss` to `program`; return [(param, param@GRAD)].

    Gradients flow only into trainable parameters (or `parameter_list`) and the vars between them
    and the loss; `stop_gradient` vars and `no_grad_set` block them. Several contributions to one
    gradient are summed by an explicit `sum` op. Grad ops carry `op_role=backward` and their forward
    op's id (`fwd_id`) and `op_device`.
    """
    loss = loss.name if isinstance(loss, Var) else loss
    block = program.global_block()
    block.var(loss)
    blocked = set(no_grad_set or ())
    ops = [op for op in block.ops if op.role in ("forward", "loss")]
    prod = _producers(ops)
    if loss not in prod:
        raise PlanError(f"loss {loss!r} is not produced by any forward op")
    ops = ops[: ops.index(prod[loss]) + 1]
    prod[loss].attrs["op_role"] = "loss"

    params = [v.name for v in block.vars.values() if v.is_parameter and v.trainable and not v.stop_gradient]
    if parameter_list is not None:
        params = [p.name if isinstance(p, Var) else p for p in parameter_list]
    requires = _requiring(block, ops, set(params) - blocked, blocked)
    reach, relevant = _reaching(ops, loss)
    need = requires & reach
    if loss not in need:
        raise PlanError(f"loss {loss!r} does not depend on any trainable parameter")

    bw = _Backward(program, need)
    loss_grad = bw.grad_var(loss, grad_name(loss))
    bw.emit(prod[loss], "fill_constant", {"Like": [loss]}, {"Out": [loss_grad]}, {"value": 1.0})
    bw.ready.add(loss)
    for op in relevant:  # already in reverse order
        for n in op.output_names():
            bw.materialize(n, op)
        if not any(n in bw.ready for n in op.output_names()):
            continue
        get_op(op.type).grad(_Emitter(bw, op), op)
    for name in list(bw.contrib):
        bw.materialize(name, prod.get(name) or relevant[-1])
    return [(p, grad_name(p)) for p in params if p in bw.ready]
