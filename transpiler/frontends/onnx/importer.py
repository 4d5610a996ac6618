"""from_onnx: an ONNX model -> a hetps Program that carries its parameter values.

The mapping is thin because the registry follows ONNX: `OpDef.onnx` names an op's ONNX type and its
slots are the schema's input/output names, so a node's positional inputs land in slots by
`onnx.defs.get_schema(type, opset)`. What import adds on top:

- float initializers other than 0-d ones (torch's dynamo exporter stores scalar constants as
  initializers), and float `Constant`s of more than one element (paddle2onnx stores weights that
  way), become trainable parameters whose values travel in `program.params`; other constants read
  as tensors become `constant` ops (values in the program) up to MAX_PROGRAM_CONSTANT elements,
  persistable non-trainable vars beyond;
- a constant input that ONNX passes as a tensor but the op also takes as an attribute of the same
  name (Reshape's shape, Reduce*'s axes, Slice's starts, Dropout's ratio, ...) is folded into it;
- `Identity` is folded away (kept only where it produces a graph output);
- a `Gather` (axis 0) whose data is a 2-D float initializer used only by such Gathers becomes an
  `embedding` lookup of a sparse table (row-sparse gradient, a parameter-server table candidate);
- graph inputs become `data` ops (category io), so placement sees where data enters;
- models older than opset 13 are upgraded by ONNX's own version converter first;
- control flow is made straight-line first (`onnx_control_flow.straighten`): an `If` on a condition
  known at import time is folded, torch's `nn.EmbeddingBag` Loop becomes a pooled `embedding_bag`
  lookup (its table a sparse one), a `Loop` with an import-time trip count is unrolled; any other
  Loop / If is refused with the node named and the reason;
- nodes of the domain ai.hetps (what `to_onnx` writes for hetps-only ops) import as those ops;
- shapes are lenient like onnxruntime's: a declared graph-output / value-info shape that disagrees
  with the computed one but is compatible (rank 0 vs [1], a fixed dim vs a symbolic one) gives way to
  the computed one with an OnnxShapeWarning naming the value (`lenient_types`).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import onnx

from transpiler.frontends.onnx.control_flow import Straightened, straighten
from transpiler.frontends.onnx.graph import GraphImporter, UnsupportedOnnxOpsError, supported_onnx_ops
from transpiler.frontends.onnx.loss import (
    LOSSES,
    attach_loss,
    attach_losses,
    clamp_logs,
    find_score,
    stable_logs,
    unclamped_logs,
)
from transpiler.frontends.onnx.model import (
    OnnxImportError,
    OnnxShapeWarning,
    load_onnx,
)
from transpiler.ir import Program, Var

__all__ = [
    "LOSSES",
    "OnnxImportError",
    "OnnxShapeWarning",
    "UnsupportedOnnxOpsError",
    "attach_loss",
    "from_onnx",
    "supported_onnx_ops",
]

log = logging.getLogger("hetps.onnx")


def from_onnx(
    model_or_path: onnx.ModelProto | str | os.PathLike,
    loss: str | None = None,
    label: str | None = None,
    *,
    dynamic_batch: bool = True,
    pred: str | None = None,
    log_clamp: float | None = None,
    stable_log: bool = True,
    losses: dict[str, tuple[str, str]] | None = None,
    weights: dict[str, float] | None = None,
) -> Program:
    """Import an ONNX model (a ModelProto or a path; external data files beside it are loaded).

    Variable names are the ONNX value names; `program.fetch_names` lists the graph outputs
    and `program.params` holds the parameter values, so `Executor().run(program, feed, fetch_list)`
    runs it as is. `loss` ("bce" on probabilities, "bce_with_logits", "mse", or "softmax_ce" with
    class ids, class axis 1) attaches a mean loss on the first graph output against a new data input
    `label` (default "label"); without it, a graph whose first scalar float output is a loss is
    trainable as is. Either way `program.attrs["loss_name"]` names the loss.

    - `dynamic_batch`: a batch size fixed in the graph's inputs (a traced export) is made dynamic
      when nothing in the graph depends on it (see `transpiler.frontends.onnx.batch`); logged either way.
    - `pred`: for a loss inside the graph, the tensor holding the prediction (probability or logit)
      to score the AUC with; by default it is found in a binary cross-entropy written as raw
      `Log`/`Sigmoid` ops. `program.attrs["score_names"]` = [prediction, label] when known.
    - `log_clamp`: an opt-in change of the model's maths: every `Log` the in-graph loss is computed
      from reads `Clip(x, min=log_clamp)`, as torch's BCELoss clamps and its export does not.
      With `stable_log`, it applies to the Logs the rewrite leaves.
    - `stable_log` (default True): the in-graph loss's `Log(Sigmoid(z))` is evaluated as
      `-Softplus(-z)` and `Log(1 - Sigmoid(z))` as `-Softplus(z)` (see `transpiler.frontends.onnx.loss`):
      the same function, more accurate in float32, finite where the sigmoid saturates; logged.
    - `losses` (multi-task training, instead of `loss`): {graph output: (loss kind, label feed)},
      e.g. ESMM's `{"ctr": ("bce", "click"), "ctcvr": ("bce", "buy")}`: a mean loss per output
      against its own new data input, the program's loss their sum weighted by `weights`
      ({output: weight}, default 1.0); each output is a task (`transpiler.tasks`, `Plan.tasks`)
      with its own AUC in training and evaluation, its own column in `predict`.
    """
    model, straight = _straightened(load_onnx(model_or_path), dynamic_batch)
    program = GraphImporter(straight.model, straight.refused).build()
    outputs = program.attrs["fetch_names"]
    if losses is not None or weights is not None:
        _no_single_loss_options(loss, label, pred, log_clamp)
        attach_losses(program, losses or {}, weights)
        return program
    if loss is not None:
        if pred is not None or log_clamp is not None:
            raise OnnxImportError(
                "pred / log_clamp apply to a loss inside the graph, not to an attached "
                f"loss={loss!r} (whose prediction is the first output)"
            )
        attach_loss(program, outputs[0], loss, label or "label")
        return program
    loss_name = next((name for name in outputs if _is_loss(program.var(name))), None)
    if loss_name is not None:
        program.attrs["loss_name"] = loss_name
    return _score_in_graph_loss(model, program, pred, log_clamp, stable_log)


def _no_single_loss_options(*given: object) -> None:
    if any(x is not None for x in given):
        raise OnnxImportError(
            "losses= (one loss per task) replaces loss= / label= / pred= / log_clamp=; give one or the other"
        )


def _is_loss(v: Var) -> bool:
    """A scalar (or [1]) float value: what a graph output holding a loss looks like."""
    return (
        v.shape is not None
        and len(v.shape) <= 1
        and all(d == 1 for d in v.shape)
        and np.dtype(v.dtype).kind == "f"
    )


def _straightened(model: onnx.ModelProto, dynamic_batch: bool) -> tuple[onnx.ModelProto, Straightened]:
    """(the model with its batch freed when `dynamic_batch` allows it, that model straightened);
    the batch decision logged."""
    from transpiler.frontends.onnx.batch import BatchDim, free_batch, leading_batch

    fixed = leading_batch(model)
    batch = BatchDim(fixed, False, "dynamic_batch=False") if fixed else BatchDim()
    if not dynamic_batch:
        straight = straighten(model)
    else:
        freed, freed_batch = free_batch(model)
        straight = straighten(freed)
        # control flow resolved only on the traced shapes (an If on Shape(x)[0]): keep them
        kept = straighten(model) if freed_batch.freed and straight.refused else None
        if kept is not None and len(kept.refused) < len(straight.refused):
            straight = kept
            batch = BatchDim(fixed, False, "the graph's control flow is resolved from the input shapes")
        else:
            model, batch = freed, freed_batch
    if batch.message():
        log.warning("%s", batch.message())
    return model, straight


def _score_in_graph_loss(
    model: onnx.ModelProto, program: Program, pred: str | None, log_clamp: float | None, stable_log: bool
) -> Program:
    """The in-graph loss's prediction and label (`score_names`), its Log(Sigmoid) patterns
    evaluated stably (`stable_log`) and its other Logs clamped when asked."""
    loss = program.attrs.get("loss_name")
    if loss is None:
        if pred is not None or log_clamp is not None:
            raise OnnxImportError(
                "pred / log_clamp need a loss: the graph has no scalar float output; "
                "attach one with loss=... (CLI: --loss)"
            )
        return program
    score = find_score(model, loss, pred)  # on the graph as exported: its Sigmoid is the prediction
    rewritten = _rewrite_logs(model, loss, log_clamp, stable_log)
    if rewritten is not model:
        attrs = program.attrs
        straight = straighten(rewritten)
        program = GraphImporter(straight.model, straight.refused).build()
        program.attrs["loss_name"] = attrs["loss_name"]
    if score is None:
        return program
    for name in (score.pred, score.label):
        if not program.global_block().has_var(name):
            raise OnnxImportError(
                f"pred {name!r} is folded away on import (an Identity output); name "
                "the tensor the Identity reads"
            )
    program.attrs["score_names"] = [score.pred, score.label]
    return program


def _rewrite_logs(
    model: onnx.ModelProto, loss: str, log_clamp: float | None, stable_log: bool
) -> onnx.ModelProto:
    """The model with the loss's Log(Sigmoid) patterns evaluated stably (`stable_log`) and its other
    Logs clamped (`log_clamp`); what was done, or a missing clamp, logged."""
    rewritten = model
    if stable_log:
        rewritten, done = stable_logs(model, loss)
        if done:
            log.warning(
                "stable_log: %d Log node(s) of the loss %r evaluated exactly without overflow (%s); "
                "import with stable_log=False (CLI: --no-stable-log) to keep the exported ops",
                len(done),
                loss,
                "; ".join(map(str, done)),
            )
    if log_clamp is not None:
        rewritten, n = clamp_logs(rewritten, loss, log_clamp)
        if n or not stable_log:
            log.warning(
                "log_clamp=%g: %d Log node(s) of the loss %r read Clip(x, min=%g)%s",
                log_clamp,
                n,
                loss,
                log_clamp,
                " (the ones stable_log left)" if stable_log else "",
            )
        else:
            log.warning(
                "log_clamp=%g: no Log of the loss %r is left to clamp (stable_log rewrote them); "
                "import with stable_log=False (CLI: --no-stable-log) to clamp the exported ones",
                log_clamp,
                loss,
            )
    elif n := unclamped_logs(rewritten, loss):
        log.warning(
            "the loss %r takes the Log of %d value(s) with no clamp: a saturated prediction gives "
            "log(0) = -inf and NaN gradients. torch's BCELoss clamps its logs, its export does not; "
            "to clamp, import with log_clamp=1e-7 (CLI: --clamp-log 1e-7)",
            loss,
            n,
        )
    return rewritten
