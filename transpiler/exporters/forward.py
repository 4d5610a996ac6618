"""inference_program: the forward part of a (trained) program, for evaluation and serving.

Like Paddle's `Program.clone(for_test=True)` followed by pruning to the fetch targets: backward,
optimize, comm and ps ops go, ops with a `training_mode` attribute (dropout) switch to inference
behaviour, and with `targets` only the ops those targets need stay — so evaluating predictions
needs no label feed. Parameters keep their names: run it with the training Executor to use the
trained values from its scope.
"""

from __future__ import annotations

from ops_registry import get_op
from transpiler.ir import Program, Var

# Loss ops whose inputs are (score, binary label): the AUC ranks the score, serving exports it.
SCORE_OPS = {
    "sigmoid_cross_entropy_with_logits": ("X", "Label"),
    "log_loss": ("Predicted", "Labels"),
    "bce_loss": ("X", "Label"),
}


def score_names(program: Program) -> list[str] | None:
    """[prediction, label] of `program`'s loss: `attrs["score_names"]` (set by importers that find a
    loss written as raw ops), else the inputs of its forward loss op of a kind in SCORE_OPS."""
    named = program.attrs.get("score_names")
    if named:
        return list(named)
    return next(
        (
            [op.inputs[a][0], op.inputs[b][0]]
            for op in program.ops
            if op.type in SCORE_OPS and op.role != "backward"
            for a, b in [SCORE_OPS[op.type]]
        ),
        None,
    )


def inference_program(program: Program, targets: list[str | Var] | None = None) -> Program:
    """A new Program with only the forward ops of `program` (those `targets` need, when given)."""
    out = program.clone()
    block = out.global_block()
    ops = [op for op in block.ops if op.role in ("forward", "loss")]
    if targets is not None:
        need = {t.name if isinstance(t, Var) else t for t in targets}
        for name in need:
            block.var(name)  # KeyError naming the target when it is not in the program
        kept = []
        for op in reversed(ops):
            if need & set(op.output_names()):
                kept.append(op)
                need.update(op.input_names())
        ops = kept[::-1]
    block.set_ops(ops)
    for op in ops:
        if "training_mode" in get_op(op.type, where=f"op id {op.id}").attrs:
            block.update_op(op, attrs={"training_mode": 0})
    used = {n for op in ops for n in op.input_names() + op.output_names()}
    block.vars = {n: v for n, v in block.vars.items() if n in used}
    out.params = {n: v for n, v in out.params.items() if n in used}
    out.attrs.pop("optimizer", None)
    return out
