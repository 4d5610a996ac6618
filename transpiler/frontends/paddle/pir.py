"""Reading a PIR program (Paddle 3.x's default IR) into a `PaddleRead`: `pd_op.*` ops renamed to
their legacy twins, constant operands folded into attrs, backward and optimizer ops told apart, the
loss found from the backward seed, L2Decay and ClipGradByGlobalNorm read off the gradients."""

from __future__ import annotations

from typing import Any

from transpiler.frontends.paddle.ops import PaddleImportError, PaddleOp
from transpiler.frontends.paddle.read import SKIP_ATTRS, PaddleRead, call_site
from transpiler.ir import Var

# -- reading a PIR program --------------------------------------------------------------------
# PIR op -> (legacy op type, {PIR operand: legacy slot, or "=attr" to fold a constant operand into
# an attr}, {PIR result: legacy slot}, {PIR attr: legacy attr}); unlisted slots are CamelCased
# (x -> X, beta1_pow -> Beta1Pow), which is what the legacy op calls them.
_PIR_AS_LEGACY: dict[str, tuple[str, dict, dict, dict]] = {
    "pd_op.embedding": ("lookup_table_v2", {"x": "Ids", "weight": "W"}, {}, {"sparse": "is_sparse"}),
    "pd_op.reshape": ("reshape2", {"shape": "=shape"}, {}, {}),
    "pd_op.concat": ("concat", {"axis": "=axis"}, {}, {}),
    "pd_op.add_n": ("sum", {"inputs": "X"}, {}, {}),
    "pd_op.add": ("elementwise_add", {}, {}, {}),
    "pd_op.subtract": ("elementwise_sub", {}, {}, {}),
    "pd_op.multiply": ("elementwise_mul", {}, {}, {}),
    "pd_op.divide": ("elementwise_div", {}, {}, {}),
    "pd_op.matmul": ("matmul_v2", {}, {}, {"transpose_x": "trans_x", "transpose_y": "trans_y"}),
    "pd_op.relu": ("relu", {}, {}, {}),
    "pd_op.sigmoid": ("sigmoid", {}, {}, {}),
    "pd_op.tanh": ("tanh", {}, {}, {}),
    "pd_op.square": ("square", {}, {}, {}),
    "pd_op.scale": ("scale", {"scale": "=scale"}, {}, {}),
    "pd_op.cast": ("cast", {}, {}, {"dtype": "out_dtype"}),
    "pd_op.full": ("fill_constant", {}, {}, {}),
    "pd_op.sigmoid_cross_entropy_with_logits": (
        "sigmoid_cross_entropy_with_logits",
        {"pos_weight": "pos_weight"},
        {},
        {},
    ),
    "pd_op.sum": ("reduce_sum", {"axis": "=dim"}, {}, {"keepdim": "keep_dim", "dtype": "out_dtype"}),
    "pd_op.mean": ("reduce_mean", {"axis": "=dim"}, {}, {"keepdim": "keep_dim"}),
    "pd_op.mean_all": ("mean", {}, {}, {}),
    "pd_op.cross_entropy_with_softmax": ("softmax_with_cross_entropy", {"input": "Logits"}, {}, {}),
    "pd_op.log_loss": ("log_loss", {"input": "Predicted", "label": "Labels"}, {"out": "Loss"}, {}),
    "pd_op.sgd_": ("sgd", {}, {}, {}),
    "pd_op.adam_": ("adam", {"beta1": "=beta1", "beta2": "=beta2", "epsilon": "=epsilon"}, {}, {}),
    "pd_op.adagrad_": ("adagrad", {}, {}, {}),
    "pd_op.unsqueeze": ("unsqueeze2", {"axis": "=axes"}, {}, {}),
    "pd_op.transpose": ("transpose2", {}, {}, {"perm": "axis"}),
    "pd_op.softmax": ("softmax", {}, {}, {}),
    "pd_op.slice": ("slice", {"starts": "=starts", "ends": "=ends"}, {}, {}),
    "pd_op.conv2d": ("conv2d", {}, {"out": "Output"}, {}),
    "pd_op.adamw_": ("adamw", {"beta1": "=beta1", "beta2": "=beta2", "epsilon": "=epsilon"}, {}, {}),
}
_PIR_OPTIMIZERS = {
    "pd_op.sgd_",
    "pd_op.adam_",
    "pd_op.adagrad_",
    "pd_op.adamw_",
    "pd_op.momentum_",
    "pd_op.rmsprop_",
    "pd_op.lamb_",
}
_PIR_SKIP = {"pd_op.fetch", "builtin.shadow_output"}


def _camel(slot: str) -> str:
    return "".join(p.capitalize() for p in slot.split("_"))


def read_pir(main: Any, paddle_dir: str) -> PaddleRead:
    ops = list(main.global_block().ops)
    names = _value_names(ops)  # Value.id -> name
    consts: dict[Any, Any] = {}  # Value.id -> Python value of a full / full_int_array
    combos: dict[Any, list[str]] = {}  # Value.id of a builtin.combine -> its operands' names

    def name_of(v: Any) -> str:
        if isinstance(v, str):
            return v
        if v.id not in names:
            raise PaddleImportError(f"fetch/feed value {v} is not a value of this program")
        return names[v.id]

    read = PaddleRead("pir", name_of=name_of)
    backward = _backward_ids(ops)
    for i, op in enumerate(ops):
        kind, results = op.name(), op.results()
        _declare_results(read, results, names)
        if kind == "builtin.parameter":
            v = read.vars[names[results[0].id]]
            trainable = op.attrs().get("trainable", True)
            v.is_parameter = v.persistable = True
            v.trainable = bool(trainable[0] if isinstance(trainable, list) else trainable)
        elif kind == "pd_op.data":
            if not results[0].persistable:
                read.feeds.append(names[results[0].id])
        elif kind == "builtin.combine":
            combos[results[0].id] = [names[s.id] for s in op.operands_source()]
        elif _is_loss_seed(op, backward):
            read.loss = names[op.operand_source(0).id]
        elif kind in _PIR_SKIP or (op.id() in backward and kind not in _PIR_OPTIMIZERS):
            continue
        elif kind in ("pd_op.full", "pd_op.full_int_array"):
            consts[results[0].id] = op.attrs()["value"]
            read.lazy[names[results[0].id]] = _pir_node(op, i, names, consts, combos, paddle_dir)
        elif kind in _PIR_OPTIMIZERS:
            node = _pir_node(op, i, names, consts, combos, paddle_dir)
            _read_update(read, op, node, names, consts, backward)
        else:
            read.ops.append(_pir_node(op, i, names, consts, combos, paddle_dir))
    return read


def _value_names(ops: list) -> dict[Any, str]:
    """Value.id -> name: a value's own name, else `<op>_<k>.tmp_<j>` (k counts that op type in
    program order, j the result), stable for a given program."""
    names: dict[Any, str] = {}
    taken = {r.name for op in ops for r in op.results() if r.has_name}
    counts: dict[str, int] = {}
    for op in ops:
        short = op.name().split(".", 1)[-1]
        for j, r in enumerate(op.results()):
            if r.has_name:
                names[r.id] = r.name
                continue
            k = counts.get(short, 0)
            while f"{short}_{k}.tmp_{j}" in taken:
                k += 1
            names[r.id] = f"{short}_{k}.tmp_{j}"
            taken.add(names[r.id])
        counts[short] = counts.get(short, 0) + 1
    return names


def _backward_ids(ops: list) -> set[Any]:
    """Ids of the ops (and of their values) on the backward / optimizer side: grad ops, optimizer
    ops and whatever consumes their results."""
    backward: set[Any] = set()
    for op in ops:
        srcs = [s for s in op.operands_source() if s.initialized()]
        if (
            op.name().endswith(("_grad", "_grad_"))
            or op.name() in _PIR_OPTIMIZERS
            or any(s.id in backward for s in srcs)
        ):
            backward.add(op.id())
            backward.update(r.id for r in op.results())
    return backward


def _declare_results(read: PaddleRead, results: list, names: dict[Any, str]) -> None:
    """The facts (shape, dtype, persistable, stop_gradient) of an op's dense-tensor results."""
    from paddle.base.data_feeder import convert_dtype

    for r in results:
        if r.is_dense_tensor_type():
            read.vars[names[r.id]] = Var(
                names[r.id],
                shape=tuple(r.shape),
                dtype=convert_dtype(r.dtype),
                persistable=bool(r.persistable),
                stop_gradient=bool(r.stop_gradient),
            )


def _is_loss_seed(op: Any, backward: set[Any]) -> bool:
    """A forward `full_like(loss, 1)` read only by backward ops: the seed of the loss gradient."""
    used = op.results()[0].all_used_ops() if op.name() == "pd_op.full_like" else []
    return op.id() not in backward and bool(used) and all(u.id() in backward for u in used)


def _read_update(
    read: PaddleRead, op: Any, node: PaddleOp, names: dict[Any, str], consts: dict, backward: set[Any]
) -> None:
    """An optimizer update op: its parameter's L2Decay and global-norm clip recorded, any other
    transform of the gradient refused."""
    grad = op.operand_source(op.get_input_names().index("grad"))
    param = op.operand_source(op.get_input_names().index("param"))
    grad, coeff = _pir_l2(grad, param, consts)
    if coeff:
        read.l2[names[param.id]] = coeff
    grad, clip = _pir_clip(grad, consts)
    if clip:
        read.clip[names[param.id]] = clip
    bad = _grad_transform(grad, backward)
    if bad:
        raise node.fail(
            f"the gradient is transformed by {bad!r} before the update (gradient "
            "clipping, or weight decay other than L2Decay?), which is not imported"
        )
    read.optimize.append(node)


def _pir_l2(grad: Any, param: Any, consts: dict) -> tuple[Any, float]:
    """(g, c) when `grad` is Paddle's PIR L2Decay `add_n([g, scale(param, full(c), bias=0)])`, else
    (grad, 0.0)."""
    op = grad.get_defining_op()
    if op.name() != "pd_op.add_n":
        return grad, 0.0
    combine = op.operand_source(0).get_defining_op()
    srcs = combine.operands_source() if combine.name() == "builtin.combine" else []
    if len(srcs) != 2:
        return grad, 0.0
    sc = srcs[1].get_defining_op()
    if sc.name() != "pd_op.scale" or sc.attrs().get("bias") or sc.operand_source(0).id != param.id:
        return grad, 0.0
    coeff = consts.get(sc.operand_source(1).id)
    return (srcs[0], float(coeff)) if coeff is not None else (grad, 0.0)


def _pir_clip(grad: Any, consts: dict) -> tuple[Any, float]:
    """(g, clip_norm) when `grad` is Paddle's PIR ClipGradByGlobalNorm
    `multiply(g, divide(full(c), maximum(sqrt(..), full(c))))`, else (grad, 0.0)."""
    op = grad.get_defining_op()
    if op.name() != "pd_op.multiply":
        return grad, 0.0
    div = op.operand_source(1).get_defining_op()
    if div.name() != "pd_op.divide":
        return grad, 0.0
    mx = div.operand_source(1).get_defining_op()
    clip = consts.get(div.operand_source(0).id)
    if mx.name() != "pd_op.maximum" or clip is None or consts.get(mx.operand_source(1).id) != clip:
        return grad, 0.0
    return op.operand_source(0), float(clip)


def _grad_transform(value: Any, backward: set) -> str | None:
    """The first op between grad ops and an optimizer that does more than sum gradients (weight
    decay adds a scaled parameter, clipping rescales); None for a plain (accumulated) gradient."""
    op = value.get_defining_op()
    kind = op.name()
    if kind.endswith(("_grad", "_grad_")) or kind == "builtin.split":
        return None
    if kind not in ("pd_op.add_n", "pd_op.add", "pd_op.add_", "builtin.combine"):
        return kind
    for src in op.operands_source():
        if src.id not in backward:
            return kind
        bad = _grad_transform(src, backward)
        if bad:
            return bad
    return None


def _pir_node(op: Any, index: int, names: dict, consts: dict, combos: dict, paddle_dir: str) -> PaddleOp:
    from paddle.base.data_feeder import convert_dtype

    kind = op.name()
    if kind.endswith("_") and kind[:-1] in _PIR_AS_LEGACY:  # in-place twin (relu_): same math in SSA
        kind = kind[:-1]
    legacy, ins_map, outs_map, attr_map = _PIR_AS_LEGACY.get(kind, (kind, {}, {}, {}))
    node = PaddleOp(legacy, index=index, site=call_site(op.attrs().get("op_callstack", []), paddle_dir))
    if not kind.startswith("pd_op."):  # builtin ops have no slot names; nothing to map them to
        return node
    for slot, src in zip(op.get_input_names(), op.operands_source(), strict=True):
        if not src.initialized():
            continue
        target = ins_map.get(slot, _camel(slot))
        if target.startswith("="):
            if src.id not in consts:
                raise node.fail(f"operand {slot!r} is computed at run time; hetps needs a constant")
            node.attrs[target[1:]] = consts[src.id]
        else:
            node.inputs[target] = combos.get(src.id) or [names[src.id]]
    for slot, r in zip(op.get_output_names(), op.results(), strict=True):
        node.outputs[outs_map.get(slot, _camel(slot))] = [names[r.id]]
    for k, v in op.attrs().items():
        if k in SKIP_ATTRS:
            continue
        if type(v).__name__ == "DataType":
            v = None if v.name == "UNDEFINED" else convert_dtype(v)
        node.attrs[attr_map.get(k, k)] = v
    return node
