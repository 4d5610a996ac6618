"""The forward pass that `evaluate`, `predict`, their worker processes and `train`'s held-out
evaluation share: a plan's forward graph run on the numpy executor, its pull ops reading the tables
from a `TableSource` (running servers through peek pulls, or a checkpoint loaded into an in-process
shard), the tally of loss and AUC over batches, and the GAUC and per-slice figures by a column
(runtime/evaluation/evaluate.py says more).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.driver.checkpoints import check_resume, latest
from runtime.evaluation.metrics import auc, calibration, gauc, logloss, sliced, task_aucs
from runtime.exec.comm_ops import comm_handlers
from runtime.exec.executor import Executor
from runtime.ps import PSClient, Shard
from runtime.ps.checkpoint import read_manifest
from transpiler.exporters.servable import ForwardGraph
from transpiler.plan import Plan

# pull(table, ids or None) -> the dense table or the rows of ids
TableSource = Callable[[str, "np.ndarray | None"], np.ndarray]


def client_source(client: PSClient) -> TableSource:
    """Tables read from running servers without changing them (peek pulls)."""
    return lambda table, ids: client.pull(table, ids, peek=True)


def checkpoint_source(plan: Plan, checkpoint: str | Path | None) -> TableSource:
    """Tables of checkpoint `checkpoint` (a checkpoint, or a directory of `train`'s step
    checkpoints: the newest), or the plan's initial values without one, in an in-process shard."""
    shard = load_tables(plan, checkpoint)
    return lambda table, ids: shard.pull(table, ids, peek=True)


def checked_checkpoint(plan: Plan, checkpoint: str | Path | None) -> Path | None:
    """The checkpoint `checkpoint` names (itself, or the newest complete one in a directory of
    `train`'s), after checking a `train` checkpoint belongs to `plan` (CheckpointError otherwise)."""
    if checkpoint is None:
        return None
    path = latest(checkpoint)
    if "run" in read_manifest(path):
        check_resume(plan, path)
    return path


def load_tables(plan: Plan, checkpoint: str | Path | None) -> Shard:
    """An in-process shard holding the tables of `checkpoint` (see `checkpoint_source`)."""
    shard = Shard(plan.tables)
    path = checked_checkpoint(plan, checkpoint)
    if path is not None:
        shard.load(path)
    else:
        for name, value in plan.params.items():
            if name in shard.tables:
                t = shard.tables[name]
                t.assign(value, *(() if t.spec.kind == "dense" else (np.arange(len(value)),)))
    return shard


class _Pulls:
    """The PS ops of a forward program (a `comm_ops.CommBackend` with pulls only): from `pull`."""

    def __init__(self, pull: TableSource) -> None:
        self.pull = pull

    def pull_dense(self, ctx: Any, table: str) -> np.ndarray:
        return self.pull(table, None)

    def pull_sparse(self, ctx: Any, table: str, ids_name: str, ids: Any) -> np.ndarray:
        return self.pull(table, np.asarray(ids).reshape(-1))


def _executor(pull: TableSource) -> Executor:
    return Executor(handlers=comm_handlers(_Pulls(pull)))


def batches_of(data: Any) -> Iterator[dict[str, Any]]:
    """The feed dicts of finite `data` (TypeError for endless generated data or a non-iterable)."""
    if hasattr(data, "batch") and callable(data.batch):
        raise TypeError(
            f"data {type(data).__name__} makes endless batches: evaluate a finite set, e.g. "
            "list(data.batches(batch_size, count))"
        )
    if not isinstance(data, Iterable) or isinstance(data, dict):
        raise TypeError(f"data must be an iterable of feed dicts, got {type(data).__name__}")
    yield from data


# forward(batch) -> (prediction, loss or None)
Forward = Callable[[dict[str, Any]], tuple[np.ndarray, "float | None"]]


def forward_fn(graph: ForwardGraph, pull: TableSource, with_loss: bool) -> Forward:
    """The forward pass of `graph` on one batch, its tables read from `pull`."""
    outputs = graph.outputs
    targets = outputs + ([graph.loss] if with_loss and graph.loss else [])
    prog = graph.pruned(targets)
    feeds = graph.feeds + (graph.label_feeds if with_loss else [])
    exe = _executor(pull)

    def forward(batch: dict[str, Any]) -> tuple[np.ndarray, float | None]:
        missing = [f for f in feeds if f not in batch]
        if missing:
            raise KeyError(f"a batch lacks the feeds {missing} the model reads; it has {sorted(batch)}")
        outs = exe.run(prog, feed={f: batch[f] for f in feeds}, fetch_list=targets)
        pred = task_columns(outs[: len(outputs)], outputs) if graph.tasks else np.asarray(outs[0])
        return pred, float(np.asarray(outs[-1])) if len(outs) > len(outputs) else None

    return forward


def run_forward(
    graph: ForwardGraph, pull: TableSource, data: Any, with_loss: bool
) -> Iterator[tuple[dict[str, Any], np.ndarray, float | None]]:
    """Per batch of `data`: (batch, prediction, loss or None)."""
    forward = forward_fn(graph, pull, with_loss)
    for batch in batches_of(data):
        yield batch, *forward(batch)


def task_columns(values: list[Any], names: list[str]) -> np.ndarray:
    """A multi-task model's per-task values (one per example each) as the columns of one
    [examples, tasks] array; ValueError naming a task with several values per example."""
    cols = [np.asarray(v).reshape(len(v), -1) for v in values]
    wide = [n for n, c in zip(names, cols, strict=True) if c.shape[1] != 1]
    if wide:
        raise ValueError(f"a task's prediction and label hold one value per example; {wide} hold more")
    return np.concatenate([c.astype(np.float32, copy=False) for c in cols], axis=1)


def label_feed(graph: ForwardGraph) -> str | None:
    """The label the AUC compares predictions with: the loss's one label feed (None: not one)."""
    return graph.label_feeds[0] if len(graph.label_feeds) == 1 else None


def labels_of(graph: ForwardGraph, batch: dict[str, Any]) -> np.ndarray | None:
    """A batch's labels for the AUC: the one label feed, or a multi-task graph's task labels as
    [examples, tasks] columns; None when there is no single label."""
    if graph.tasks:
        return task_columns([batch[t.label] for t in graph.tasks], [t.name for t in graph.tasks])
    label = label_feed(graph)
    return None if label is None else np.asarray(batch[label])


@dataclass
class Tally:
    """Forward passes combined as `evaluate` reports them: the loss over all examples (a mean loss
    weighted by batch size, a sum loss summed), the AUC of all predictions against binary labels."""

    reduction: str  # "mean" or "sum" (Plan.loss_reduction)
    tasks: list[str] = field(default_factory=list)  # a multi-task plan's: preds and labels have a column each
    total: float = 0.0
    examples: int = 0
    scores: list = field(default_factory=list)
    labels: list = field(default_factory=list)

    def add(self, pred: np.ndarray, loss: float, label: Any = None) -> None:
        """One batch's prediction, loss, and labels (None: no AUC)."""
        self.total += loss * len(pred) if self.reduction == "mean" else loss
        self.examples += len(pred)
        if label is not None and self.tasks:
            self.scores.append(pred)
            self.labels.append(np.asarray(label))
        elif label is not None:
            self.scores.append(pred.reshape(-1))
            self.labels.append(np.asarray(label).reshape(-1))

    def result(self) -> dict[str, float]:
        """{"loss", "auc", "examples"}; ValueError when no example was added."""
        if self.examples == 0:
            raise ValueError("evaluate got no examples: data is empty")
        if self.tasks:
            return self._task_result()
        y = np.concatenate(self.labels) if self.labels else None
        n_scores = sum(s.size for s in self.scores)
        binary = y is not None and y.size == n_scores and bool(np.isin(y, (0, 1)).all())
        p = np.concatenate(self.scores) if binary else None
        probs = binary and p.size > 0 and bool(((p >= 0) & (p <= 1)).all())  # CTR figures need probabilities
        return {
            "loss": self.total / self.examples if self.reduction == "mean" else self.total,
            "auc": auc(y, p) if binary else float("nan"),
            "examples": self.examples,
            **({"logloss": logloss(y, p), "calibration": calibration(y, p)} if probs else {}),
        }

    def _task_result(self) -> dict[str, Any]:
        """A multi-task result: the first task's AUC as "auc", every task's as "auc_<task>"."""
        loss = self.total / self.examples if self.reduction == "mean" else self.total
        nan = dict.fromkeys(self.tasks, float("nan"))
        aucs = (
            task_aucs(np.concatenate(self.labels), np.concatenate(self.scores), self.tasks)
            if self.labels
            else nan
        )
        return {
            "loss": loss,
            "auc": aucs[self.tasks[0]],
            "examples": self.examples,
            **{f"auc_{t}": a for t, a in aucs.items()},
        }


def evaluate_with(
    graph: ForwardGraph, pull: TableSource, data: Any, loss_reduction: str = "mean"
) -> dict[str, float]:
    """{"loss", "auc", "examples"} of the graph on `data` (see `Tally`; NaN AUC without binary
    labels); a multi-task graph's also "auc_<task>" per task."""
    if not graph.loss:
        raise ValueError("the plan has no loss: evaluate needs one (use predict for predictions)")
    tally = Tally(loss_reduction, [t.name for t in graph.tasks])
    for batch, pred, loss in run_forward(graph, pull, data, with_loss=True):
        tally.add(pred, loss, labels_of(graph, batch))
    return tally.result()


def evaluate_grouped(
    graph: ForwardGraph,
    pull: TableSource,
    data: Any,
    reduction: str = "mean",
    group: str | None = None,
    slice_by: str | None = None,
) -> dict[str, Any]:
    """`evaluate_with`'s figures plus "gauc" by `group` and "slices" by `slice_by` (see `evaluate`;
    `train`'s held-out evaluation uses it too)."""
    if group is None and slice_by is None:
        return evaluate_with(graph, pull, data, reduction)
    check_grouping(graph, group, slice_by)
    label = label_feed(graph)
    tally = Tally(reduction)
    cols = list(dict.fromkeys(c for c in (group, slice_by) if c is not None))
    keys: dict[str, list] = {c: [] for c in cols}
    for batch, pred, loss in run_forward(graph, pull, data, with_loss=True):
        tally.add(pred, loss, batch[label])
        for c in cols:
            keys[c].append(column_keys(data, batch, c))
    out: dict[str, Any] = tally.result()
    y, p = np.concatenate(tally.labels), np.concatenate(tally.scores)
    if group is not None:
        out["gauc"] = gauc(y, p, np.concatenate(keys[group]))
    if slice_by is not None:
        out["slices"] = sliced(y, p, np.concatenate(keys[slice_by]), value_names(data, slice_by))
    return out


def check_grouping(
    graph: ForwardGraph, group: str | None, slice_by: str | None, data: Any = None, batch: Any = None
) -> None:
    """ValueError unless `graph` has a loss against one label feed and, given `batch` (a batch of
    `data`), the batch has the columns `group` / `slice_by`."""
    if not graph.loss or label_feed(graph) is None:
        raise ValueError("group= / slice_by= need a plan with a loss against one label feed")
    for column in (c for c in (group, slice_by) if c is not None and batch is not None):
        column_keys(data, batch, column)


def column_keys(data: Any, batch: dict[str, Any], column: str) -> np.ndarray:
    """One key per example of `batch` for `column`: its id in a dataset's `sparse` feed, or the
    first value of the feed of that name."""
    schema = getattr(data, "schema", None)
    if schema is not None and column in schema.sparse:
        return np.asarray(batch["sparse"])[:, schema.sparse.index(column)]
    if column in batch:
        x = np.asarray(batch[column])
        return x.reshape(len(x), -1)[:, 0]
    have = list(schema.sparse) if schema is not None else sorted(batch)
    raise ValueError(f"cannot group or slice by {column!r}: give a categorical column or feed, one of {have}")


def value_names(data: Any, column: str) -> dict[int, str] | None:
    """{id: value} of a dataset's categorical `column` (its values read from the files once)."""
    schema = getattr(data, "schema", None)
    if schema is None or column not in schema.sparse or not hasattr(data, "values_of"):
        return None
    values = data.values_of(column)
    return dict(zip(schema.ids(values, column).tolist(), values.to_pylist(), strict=True))
