"""`evaluate` and `predict`: a plan's forward graph on held-out data, with trained tables.

The forward graph (`transpiler.exporters.servable.forward_graph`: every trainer type's forward ops in
one program, send/recv dropped) runs in this process on the numpy executor; its `pull_dense` /
`pull_sparse` ops read the tables from a `TableSource`: the servers of a running job (what
`train(eval_data=...)` uses, through the driver's client, with peek pulls that create no rows and
update nothing) or a checkpoint loaded into an in-process shard (`evaluate` / `predict` with
`checkpoint=`; without one, the plan's initial values). Ids a table never saw read as the
initializer's values for them, as a training pull would.

With `workers=N` the same forward pass runs on N worker processes instead, reading the checkpoint
from parameter-server shards (runtime/evaluation_workers.py), with the same results (for a dataset,
whose batches are then cut per worker, the loss within float rounding).

`data`: an iterable of feed dicts (a list, `ArrayReader`, a dataset of `runtime.data.open_dataset`);
each dict is one batch, run as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.driver.checkpoints import check_resume, latest
from runtime.engines import Engine
from runtime.evaluation.metrics import auc
from runtime.exec.comm_ops import comm_handlers
from runtime.exec.executor import Executor
from runtime.ps import PSClient, Shard
from runtime.ps.checkpoint import read_manifest
from transpiler.exporters.servable import ONNX_LIMIT, ForwardGraph, export_inference, forward_graph
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
    targets = [graph.output] + ([graph.loss] if with_loss and graph.loss else [])
    prog = graph.pruned(targets)
    feeds = graph.feeds + (graph.label_feeds if with_loss else [])
    exe = _executor(pull)

    def forward(batch: dict[str, Any]) -> tuple[np.ndarray, float | None]:
        missing = [f for f in feeds if f not in batch]
        if missing:
            raise KeyError(f"a batch lacks the feeds {missing} the model reads; it has {sorted(batch)}")
        outs = exe.run(prog, feed={f: batch[f] for f in feeds}, fetch_list=targets)
        return np.asarray(outs[0]), float(np.asarray(outs[1])) if len(outs) > 1 else None

    return forward


def run_forward(
    graph: ForwardGraph, pull: TableSource, data: Any, with_loss: bool
) -> Iterator[tuple[dict[str, Any], np.ndarray, float | None]]:
    """Per batch of `data`: (batch, prediction, loss or None)."""
    forward = forward_fn(graph, pull, with_loss)
    for batch in batches_of(data):
        yield batch, *forward(batch)


def label_feed(graph: ForwardGraph) -> str | None:
    """The label the AUC compares predictions with: the loss's one label feed (None: not one)."""
    return graph.label_feeds[0] if len(graph.label_feeds) == 1 else None


@dataclass
class Tally:
    """Forward passes combined as `evaluate` reports them: the loss over all examples (a mean loss
    weighted by batch size, a sum loss summed), the AUC of all predictions against binary labels."""

    reduction: str  # "mean" or "sum" (loss_reduction)
    total: float = 0.0
    examples: int = 0
    scores: list = field(default_factory=list)
    labels: list = field(default_factory=list)

    def add(self, pred: np.ndarray, loss: float, label: Any = None) -> None:
        """One batch's prediction, loss, and labels (None: no AUC)."""
        self.total += loss * len(pred) if self.reduction == "mean" else loss
        self.examples += len(pred)
        if label is not None:
            self.scores.append(pred.reshape(-1))
            self.labels.append(np.asarray(label).reshape(-1))

    def result(self) -> dict[str, float]:
        """{"loss", "auc", "examples"}; ValueError when no example was added."""
        if self.examples == 0:
            raise ValueError("evaluate got no examples: data is empty")
        y = np.concatenate(self.labels) if self.labels else None
        n_scores = sum(s.size for s in self.scores)
        binary = y is not None and y.size == n_scores and bool(np.isin(y, (0, 1)).all())
        return {
            "loss": self.total / self.examples if self.reduction == "mean" else self.total,
            "auc": auc(y, np.concatenate(self.scores)) if binary else float("nan"),
            "examples": self.examples,
        }


def evaluate_with(
    graph: ForwardGraph, pull: TableSource, data: Any, loss_reduction: str = "mean"
) -> dict[str, float]:
    """{"loss", "auc", "examples"} of the graph on `data` (see `Tally`; NaN AUC without binary
    labels)."""
    if not graph.loss:
        raise ValueError("the plan has no loss: evaluate needs one (use predict for predictions)")
    label = label_feed(graph)
    tally = Tally(loss_reduction)
    for batch, pred, loss in run_forward(graph, pull, data, with_loss=True):
        tally.add(pred, loss, None if label is None else batch[label])
    return tally.result()


def loss_reduction(plan: Plan) -> str:
    """ "sum" for a reduce_sum loss, else "mean" (how a loss over batches combines)."""
    op = next(
        (
            op
            for p in plan.programs.values()
            for op in p.ops
            if plan.loss_name in op.output_names() and op.role != "comm"
        ),
        None,
    )
    return "sum" if op is not None and op.type == "reduce_sum" else "mean"


def evaluate(
    plan: Plan,
    data: Any,
    checkpoint: str | Path | None = None,
    output: str | None = None,
    *,
    workers: int | None = None,
    servers: int | None = None,
    engine: str | Engine = "local",
    stall_timeout: float = 60.0,
) -> dict[str, float]:
    """Held-out {"loss", "auc", "examples"} of `plan` with the tables of `checkpoint` (see the
    module docstring); forward only, nothing is updated. `workers=N`: on N worker processes and
    `servers` parameter-server shards (default: the plan's), see runtime/evaluation_workers.py."""
    if workers is not None or servers is not None:
        from runtime.evaluation.workers import evaluate_parallel

        return evaluate_parallel(plan, data, checkpoint, output, workers, servers, engine, stall_timeout)
    graph = forward_graph(plan, output)
    return evaluate_with(graph, checkpoint_source(plan, checkpoint), data, loss_reduction(plan))


def predict(
    plan: Plan,
    data: Any,
    checkpoint: str | Path | None = None,
    output: str | None = None,
    *,
    workers: int | None = None,
    servers: int | None = None,
    engine: str | Engine = "local",
    stall_timeout: float = 60.0,
) -> np.ndarray:
    """The prediction output of `plan` on every batch of `data`, concatenated along the batch axis
    in the data's order (`workers=N`, `servers`: as for `evaluate`)."""
    if workers is not None or servers is not None:
        from runtime.evaluation.workers import predict_parallel

        return predict_parallel(plan, data, checkpoint, output, workers, servers, engine, stall_timeout)
    graph = forward_graph(plan, output)
    preds = [pred for _, pred, _ in run_forward(graph, checkpoint_source(plan, checkpoint), data, False)]
    if not preds:
        raise ValueError("predict got no examples: data is empty")
    return np.concatenate(preds)


def full_tables(plan: Plan, checkpoint: str | Path | None) -> dict[str, np.ndarray]:
    """Every table as a full array (sparse: [vocab, dim], unseen rows at their initial values)."""
    shard = load_tables(plan, checkpoint)
    out = {}
    for t in plan.tables:
        if t.kind == "dense":
            out[t.name] = shard.pull(t.name, None, peek=True)
        elif t.shape[0] > 0:
            out[t.name] = shard.pull(t.name, np.arange(t.shape[0]), peek=True)
        else:
            raise ValueError(
                f"table {t.name!r} has an unbounded vocab (shape[0] = -1): export it with "
                "rows='existing' (only the rows it holds, ids remapped)"
            )
    return out


def existing_tables(plan: Plan, checkpoint: str | Path | None) -> tuple[dict[str, np.ndarray], dict]:
    """The tables with only the rows that exist, for huge sparse tables: (tables, {feed: ids}).

    Each id feed that sparse lookups read gets the sorted union `ids` of the rows its tables hold;
    each of those tables keeps the rows of `ids` in that order (a row one table lacks: its initial
    value) plus one last row of zeros for ids it never saw. A lookup then takes the position of
    its id in `ids` (`remap_ids`), len(ids) for an unseen id."""
    shard = load_tables(plan, checkpoint)
    graph = forward_graph(plan)
    made = {n: op for op in graph.program.ops for n in op.output_names()}
    feed_of: dict[str, str] = {}  # sparse table -> the raw feed it is looked up with
    for op in graph.program.ops:
        if op.type == "pull_sparse":
            uniq = made.get(op.inputs["Ids"][0])
            feed = uniq.inputs["Ids"][0] if uniq is not None and uniq.type == "unique_ids" else None
            if feed not in graph.feeds or feed_of.get(op.attrs["table"], feed) != feed:
                raise ValueError(
                    f"table {op.attrs['table']!r} is not looked up with one raw id feed: "
                    "rows='existing' cannot remap its ids"
                )
            feed_of[op.attrs["table"]] = feed
    ids = {
        f: np.unique(
            np.concatenate([shard.tables[t].index.ids_by_slot() for t, g in feed_of.items() if g == f])
        )
        for f in set(feed_of.values())
    }
    out = {}
    for t in plan.tables:
        name = t.name
        if t.kind == "dense":
            out[name] = shard.pull(name, None, peek=True)
        elif name in feed_of:
            rows = shard.pull(name, ids[feed_of[name]], peek=True)
            out[name] = np.concatenate([rows, np.zeros((1, rows.shape[1]), rows.dtype)])
    return out, ids


def remap_ids(ids: dict[str, np.ndarray], feed: dict[str, Any]) -> dict[str, Any]:
    """A feed dict for a model exported with rows='existing': each remapped id feed's ids replaced
    by their positions in `ids` (the `<model>.ids.npz` the export writes), unseen ids by len(ids)."""
    out = dict(feed)
    for name, known in ids.items():
        x = np.asarray(feed[name])
        pos = np.minimum(np.searchsorted(known, x), len(known) - 1)
        out[name] = np.where(known[pos] == x, pos, len(known)).astype(np.int64)
    return out


def export(
    plan: Plan,
    path: str | Path,
    checkpoint: str | Path | None = None,
    output: str | None = None,
    opset: int | None = None,
    external_over: int = ONNX_LIMIT,
    rows: str = "all",
) -> Path:
    """Write the servable ONNX model of `plan` with the tables of `checkpoint` (see
    transpiler/export_inference.py; `external_over`: bytes of tables beyond which the initializers
    go to `<path>.data`); `Plan.export_inference` does the same from table values.

    `rows`: "all" (a sparse table as its full [vocab, dim] array: the model takes raw ids) or
    "existing" (only the rows the checkpoint holds, for huge or unbounded tables: the model then
    takes each id's position in `<path minus .onnx>.ids.npz` — `remap_ids` computes it — and
    scores an id never trained with a zero embedding; see `existing_tables`)."""
    if rows == "all":
        return export_inference(plan, path, full_tables(plan, checkpoint), output, opset, external_over)
    if rows != "existing":
        raise ValueError(f"rows={rows!r}: expected 'all' or 'existing'")
    tables, ids = existing_tables(plan, checkpoint)
    out = export_inference(plan, path, tables, output, opset, external_over)
    np.savez(out.with_suffix(".ids.npz"), **ids)
    return out
