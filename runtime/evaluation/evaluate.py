"""`evaluate` and `predict`: a plan's forward graph on held-out data, with trained tables.

The forward graph (`transpiler.exporters.servable.forward_graph`: every trainer type's forward ops in
one program, send/recv dropped) runs in this process on the numpy executor; its `pull_dense` /
`pull_sparse` ops read the tables from a `TableSource`: the servers of a running job (what
`train(eval_data=...)` uses, through the driver's client, with peek pulls that create no rows and
update nothing) or a checkpoint loaded into an in-process shard (`evaluate` / `predict` with
`checkpoint=`; without one, the plan's initial values). Ids a table never saw read as the
initializer's values for them, as a training pull would.

With `workers=N` the same forward pass runs on N worker processes instead, reading the checkpoint
from parameter-server shards (runtime/evaluation/workers.py), with the same results (for a dataset,
whose batches are then cut per worker, the loss within float rounding).

`data`: an iterable of feed dicts (a list, `ArrayReader`, a dataset of `runtime.data.open_dataset`);
each dict is one batch, run as is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.engines import Engine
from runtime.evaluation.forward import (
    TableSource,
    Tally,
    batches_of,
    check_grouping,
    checked_checkpoint,
    checkpoint_source,
    client_source,
    evaluate_grouped,
    evaluate_with,
    forward_fn,
    label_feed,
    load_tables,
    run_forward,
    value_names,
)
from transpiler.exporters.servable import ONNX_LIMIT, export_inference, forward_graph
from transpiler.plan import Plan

if TYPE_CHECKING:
    from runtime.data.files.schema import Schema

__all__ = [
    "TableSource",
    "Tally",
    "batches_of",
    "checked_checkpoint",
    "checkpoint_source",
    "client_source",
    "check_grouping",
    "evaluate",
    "evaluate_grouped",
    "evaluate_with",
    "existing_tables",
    "export",
    "forward_fn",
    "full_tables",
    "id_feeds",
    "label_feed",
    "load_tables",
    "predict",
    "remap_ids",
    "run_forward",
    "value_names",
]


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
    features: Any = "auto",
    group: str | None = None,
    slice_by: str | None = None,
) -> dict[str, Any]:
    """Held-out {"loss", "auc", "examples"} of `plan` with the tables of `checkpoint` (see the
    module docstring); forward only, nothing is updated. A dataset of `open_dataset` is read with
    the feature pipeline `features` (default "auto": the one kept with `checkpoint`; see `export`).
    With binary labels and probabilities the result has "logloss" and "calibration" (predicted /
    observed CTR) too; `group`: a categorical column of the schema (or a feed) for "gauc" (the AUC
    per group, weighted by impressions); `slice_by`: one for "slices", {value: examples, AUC, log
    loss, calibration} per value. `workers=N`: on N worker processes and
    `servers` parameter-server shards (default: the plan's), see runtime/evaluation/workers.py."""
    data = fitted_data(data, _features(features, checkpoint))
    if workers is not None or servers is not None:
        from runtime.evaluation.workers import evaluate_parallel

        if group or slice_by:
            raise ValueError("group= / slice_by= are computed in this process: leave workers= out")
        return evaluate_parallel(plan, data, checkpoint, output, workers, servers, engine, stall_timeout)
    graph = forward_graph(plan, output)
    return evaluate_grouped(
        graph, checkpoint_source(plan, checkpoint), data, plan.loss_reduction, group, slice_by
    )


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
    features: Any = "auto",
) -> np.ndarray:
    """The prediction output of `plan` on every batch of `data`, concatenated along the batch axis
    in the data's order (`workers=N`, `servers`: as for `evaluate`)."""
    data = fitted_data(data, _features(features, checkpoint))
    if workers is not None or servers is not None:
        from runtime.evaluation.workers import predict_parallel

        return predict_parallel(plan, data, checkpoint, output, workers, servers, engine, stall_timeout)
    graph = forward_graph(plan, output)
    preds = [pred for _, pred, _ in run_forward(graph, checkpoint_source(plan, checkpoint), data, False)]
    if not preds:
        raise ValueError("predict got no examples: data is empty")
    return np.concatenate(preds)


def fitted_data(data: Any, fitted: Schema | None) -> Any:
    """`data` read as the model was trained: a dataset of `open_dataset` gets the feature pipeline
    `fitted` (its standardize stats are the training data's, not `data`'s own); ConfigError when
    its schema differs otherwise. Other data, or no `fitted`, is returned as it is."""
    if fitted is None:  # (no feature pipeline kept: nothing to check, pyarrow not needed)
        return data
    from runtime.data.files.dataset import Dataset
    from runtime.data.files.features import check_same

    if not isinstance(data, Dataset) or data.schema.stats == fitted.stats:
        return data
    check_same(data.schema, fitted, "the features kept with the model")
    return data.with_schema(fitted)


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
    feed_of = id_feeds(plan)
    ids = {
        f: np.unique(np.concatenate([shard.tables[t].ids() for t, g in feed_of.items() if g == f]))
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


def id_feeds(plan: Plan) -> dict[str, str]:
    """{sparse table: the raw id feed its forward lookups read}; ValueError for a table looked up
    with anything else (rows='existing' cannot remap its ids)."""
    graph = forward_graph(plan)
    made = {n: op for op in graph.program.ops for n in op.output_names()}
    feed_of: dict[str, str] = {}
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
    return feed_of


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
    rows: str | None = None,
    features: Any = "auto",
) -> Path:
    """Write the servable ONNX model of `plan` with the tables of `checkpoint` (see
    transpiler/exporters/servable.py; `external_over`: bytes of tables beyond which the initializers
    go to `<path>.data`); `Plan.export_inference` does the same from table values.

    `rows`: "all" (a sparse table as its full [vocab, dim] array: the model takes raw ids) or
    "existing" (only the rows the checkpoint holds, for huge or unbounded tables: the model then
    takes each id's position in `<path minus .onnx>.ids.npz` — `remap_ids` computes it — and
    scores an id never trained with a zero embedding; see `existing_tables`); None: "existing" when
    a sparse table is unbounded (shape[0] = -1, e.g. `TranspileConfig.unbounded`), else "all".

    `features`: the feature pipeline (a `Schema` with its fitted stats, or a features.json);
    "auto" (default): the one kept with `checkpoint`, if any; None: none. With one, the model takes
    raw dense values (one float64 input per column, the fill and transform inside the graph) and
    `<path minus .onnx>.features.json` is written beside it for `runtime.data.encode`, which gives
    the categorical ids (runtime/data/files/features.py)."""
    if rows is None:
        unbounded = any(t.kind == "sparse" and t.shape[0] < 0 for t in plan.tables)
        rows = "existing" if unbounded else "all"
    if rows not in ("all", "existing"):
        raise ValueError(f"rows={rows!r}: expected 'all' or 'existing'")
    from runtime.data.files.features import dense_inputs, save_features  # pyarrow: on first use

    schema = _features(features, checkpoint)
    raw = None
    if schema is not None and "dense" in forward_graph(plan, output).feeds:
        _check_dense_width(plan, schema)
        raw = dense_inputs(schema)
    meta = {} if schema is None else {"hetps.features": json.dumps(schema.to_dict(), sort_keys=True)}
    tables, ids = (
        existing_tables(plan, checkpoint) if rows == "existing" else (full_tables(plan, checkpoint), None)
    )
    out = export_inference(plan, path, tables, output, opset, external_over, raw, meta)
    if ids is not None:
        np.savez(out.with_suffix(".ids.npz"), **ids)
    if schema is not None:
        save_features(out.with_suffix(".features.json"), schema)
    return out


def _features(features: Any, checkpoint: str | Path | None) -> Schema | None:
    from runtime.data.kept_features import features_file

    if isinstance(features, str) and features == "auto":
        features = features_file(checkpoint)  # (none kept: nothing read, pyarrow not needed)
    if features is None:
        return None
    from runtime.data.files.features import load_features
    from runtime.data.files.schema import Schema

    return features if isinstance(features, Schema) else load_features(features)


def _check_dense_width(plan: Plan, schema: Schema) -> None:
    """Raw dense inputs are one value per column: the plan's `dense` feed must be as wide as the
    schema has dense columns (a list-valued column cannot take raw values)."""
    width = next(
        (v.shape[1] for p in plan.programs.values() for n, v in p.vars.items() if n == "dense"), None
    )
    if width is not None and width != len(schema.dense):
        raise ValueError(
            f"the plan's dense feed is {width} wide, the features have {len(schema.dense)} dense "
            "columns: a list-valued dense column cannot take raw values; export with features=None"
        )
