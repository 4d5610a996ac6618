"""The `hetps` commands and train options of a model's life after training (runtime/cli/app.py wires them):

    hetps train PLAN_DIR ... --checkpoint DIR --checkpoint-every N [--keep K] [--resume DIR]
                             --eval-data D [--eval-every N] [--eval-group COL] [--eval-slice COL]
    hetps eval PLAN_DIR --checkpoint DIR --data D          held-out loss, AUC, examples
    hetps predict PLAN_DIR --checkpoint DIR --data D -o scores.npy | scores.csv
        (both with [--workers N [--servers S]]: N worker processes, S parameter-server shards)
    hetps export PLAN_DIR --checkpoint DIR --inference [--rows existing] -o model.onnx

Held-out data (`--eval-data`, and `--data` of eval / predict) is read like `train --data`: with
`--schema` by the schema, else 'synthetic[:seed=N]' (then `--eval-batches` batches of
`--batch-size` examples from batch index 1e6 on, apart from the training batches), a .npz of
arrays or Criteo text files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from runtime.cli.common import EXIT_OK, UsageError, load_plan, make_data, parse_feeds

HELD_OUT_START = 10**6  # generated held-out batches: indices far from the training steps


def train_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="save checkpoints (tables, optimizer state, step) as DIR/step-NNNNNNNN at the end "
        "and every --checkpoint-every steps",
    )
    s.add_argument("--checkpoint-every", type=int, metavar="N", help="save a checkpoint every N steps")
    s.add_argument("--keep", type=int, default=2, help="checkpoints to keep (default %(default)s)")
    s.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from the newest complete checkpoint in DIR (--steps / --epochs count the whole run)",
    )
    s.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart the run from its last complete checkpoint (or the start) up to N times when a "
        "trainer, shard or node is lost (default %(default)s)",
    )
    s.add_argument(
        "--eval-every", type=int, metavar="N", help="evaluate --eval-data every N steps (and at the end)"
    )
    s.add_argument(
        "--eval-group", metavar="COLUMN", help="held-out GAUC: the AUC per value of this column (a user id)"
    )
    s.add_argument(
        "--eval-slice", metavar="COLUMN", help="held-out loss, AUC, calibration per value of this column"
    )
    s.add_argument(
        "--eval-batches",
        type=int,
        default=8,
        metavar="N",
        help="held-out batches of generated (synthetic) data (default %(default)s)",
    )


def train_kwargs(args: argparse.Namespace, plan: Any, feeds: dict[str, str]) -> dict[str, Any]:
    """train()'s checkpoint / resume / evaluation arguments from the command line."""

    if args.checkpoint_every is not None and not args.checkpoint:
        raise UsageError("--checkpoint-every N needs --checkpoint DIR (where to save)")
    for flag, shown in (("eval_every", "N"), ("eval_group", "COLUMN"), ("eval_slice", "COLUMN")):
        if getattr(args, flag) is not None and not args.eval_data:
            raise UsageError(f"--{flag.replace('_', '-')} {shown} needs --eval-data (the held-out set)")
    held_out = None
    if args.eval_data and plan is not None:
        held_out = finite_data(args, plan, args.eval_data, feeds, args.eval_batches)
    return dict(
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        resume=args.resume,
        eval_data=held_out,
        eval_every=args.eval_every,
        eval_output=getattr(args, "pred", None),
        eval_group=args.eval_group,
        eval_slice_by=args.eval_slice,
        max_restarts=args.max_restarts,
    )


def finite_data(args: argparse.Namespace, plan: Any, spec: str, feeds: dict[str, str], batches: int) -> Any:
    """Held-out data from a --data-like `spec`: an iterable of feed dicts."""

    if getattr(args, "schema", None):
        from runtime.data import open_dataset

        try:
            return open_dataset(spec.split(","), args.schema, batch_size=args.batch_size)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(str(e)) from None
    data, _ = make_data(plan, spec, args.batch_size, feeds, getattr(args, "vocab", None))
    if hasattr(data, "batch"):
        return [data.batch(HELD_OUT_START + i, args.batch_size) for i in range(batches)]
    return data


def describe_eval(history: Any) -> str:
    lines = []
    for e in history.eval:
        ctr = "".join(f", {k} {e[k]:.4f}" for k in ("logloss", "calibration", "gauc") if k in e)
        lines.append(
            f"held-out at step {e['step']}: loss {e['loss']:.4f}, AUC {e['auc']:.4f}{ctr} "
            f"({e['examples']} examples)"
        )
    return "\n".join(lines)


def _eval_data(args: argparse.Namespace, plan: Any) -> Any:
    """--data of eval / predict: files read by the feature pipeline kept with the model (the
    checkpoint's or the plan's features.json: the training data's stats), else as --data says."""
    from runtime.data.files.features import check_same, find_features

    fitted = find_features(args.checkpoint, args.plan)
    if fitted is not None and not _generated(args.data):
        if args.schema:
            from runtime.data.files.schema import Schema

            try:
                check_same(Schema.load(args.schema), fitted, "its features.json")
            except (FileNotFoundError, ValueError) as e:
                raise UsageError(f"--schema {args.schema}: {e}") from None
        args.schema = fitted
    return finite_data(args, plan, args.data, parse_feeds(args.feeds), args.batches)


def _generated(spec: str) -> bool:
    return spec.partition(":")[0] == "synthetic" or spec.endswith(".npz")


def _workers(args: argparse.Namespace) -> dict[str, Any]:
    """evaluate() / predict()'s workers= and servers= from --workers / --servers."""
    if args.servers is not None and args.workers is None:
        raise UsageError("--servers S goes with --workers N (the parallel evaluation's shards)")
    for flag, n in (("--workers", args.workers), ("--servers", args.servers)):
        if n is not None and n < 1:
            raise UsageError(f"{flag} {n}: give a positive number")
    return {"workers": args.workers, "servers": args.servers}


WORKERS_PAY_FROM = 500_000  # rows: below this one process is faster here (benchmarks/evaluate_workers.py)


def note_workers(args: argparse.Namespace, data: Any) -> None:
    """Say so when --workers is given for data small enough that their start-up dominates."""
    if args.workers is None or not (hasattr(data, "rows") or isinstance(data, list)):
        return
    rows = data.rows() if hasattr(data, "rows") else sum(len(b[next(iter(b))]) for b in data)
    if rows < WORKERS_PAY_FROM:
        print(
            f"note: {rows} rows: workers pay only when scoring takes longer than starting the shards "
            "and workers (a few seconds); one process scores ~40 000-150 000 examples/s, so below "
            f"~{WORKERS_PAY_FROM:,} rows leave --workers out (figures: benchmarks/README.md)",
            file=sys.stderr,
        )


def cmd_eval(args: argparse.Namespace) -> int:
    from runtime.evaluation.evaluate import evaluate

    plan = load_plan(args.plan)
    data = _eval_data(args, plan)
    note_workers(args, data)
    res = evaluate(
        plan,
        data,
        checkpoint=args.checkpoint,
        output=args.pred,
        group=args.group,
        slice_by=args.slice,
        **_workers(args),
    )
    print(json.dumps(res))
    return EXIT_OK


def cmd_predict(args: argparse.Namespace) -> int:
    from runtime.evaluation.evaluate import predict

    out = Path(args.output)
    if out.suffix not in (".npy", ".csv"):
        raise UsageError(f"-o {args.output}: name a .npy or .csv file")
    plan = load_plan(args.plan)
    data = _eval_data(args, plan)
    note_workers(args, data)
    scores = predict(plan, data, checkpoint=args.checkpoint, output=args.pred, **_workers(args))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".npy":
        np.save(out, scores)
    else:
        np.savetxt(out, scores.reshape(len(scores), -1), delimiter=",", fmt="%.9g")
    print(f"{len(scores)} predictions written to {out}")
    return EXIT_OK


def cmd_export_inference(args: argparse.Namespace) -> int:
    from runtime.evaluation.evaluate import export

    if Path(args.output).suffix != ".onnx":
        raise UsageError(f"-o {args.output}: --inference writes one model: name a .onnx file")
    from runtime.data.files.features import find_features

    fitted = find_features(args.checkpoint, args.plan)
    plan = load_plan(args.plan)
    path = export(
        plan, args.output, checkpoint=args.checkpoint, rows=args.rows, output=args.pred, features=fitted
    )
    if fitted is None:
        print(
            f"servable model written to {path} (inputs: the plan's feeds but the label; "
            "output: the prediction)"
        )
    else:
        print(
            f"servable model written to {path}: inputs: each dense column's raw float64 values "
            f"[n, 1] (NaN = missing; fill and transform inside), the categorical ids of "
            f"runtime.data.encode(records, {path.with_suffix('.features.json')}); output: the prediction"
        )
    if args.rows == "existing":
        print(f"id feeds take positions in {path.with_suffix('.ids.npz')} (evaluate.remap_ids)")
    return EXIT_OK


def add_commands(sub: Any, command: Any) -> None:
    """`hetps eval` and `hetps predict` (`command` is cli._command)."""
    for name, func, what in (
        ("eval", cmd_eval, "held-out loss, AUC and examples of a checkpoint"),
        ("predict", cmd_predict, "the model's predictions on data, from a checkpoint"),
    ):
        s = command(sub, name, func, help=what)
        s.add_argument("plan", help="plan directory")
        s.add_argument(
            "--checkpoint",
            metavar="DIR",
            help="a checkpoint, or a directory of train's checkpoints (the newest is used); "
            "default: the plan's initial values",
        )
        s.add_argument(
            "--data",
            required=True,
            help="'synthetic[:seed=N]', a .npz of arrays, Criteo text files, or with --schema "
            "files read by the schema",
        )
        s.add_argument(
            "--schema",
            help="YAML schema to read --data by (default: the features.json kept with the "
            "checkpoint or plan)",
        )
        s.add_argument("--pred", metavar="NAME", help="the prediction tensor (default: found in the plan)")
        s.add_argument("--feeds", help="data column -> program feed, e.g. sparse=a,dense=b,label=c")
        s.add_argument("--vocab", type=int, help="id range of categorical data")
        s.add_argument("--batch-size", type=int, default=512, help="examples per batch (default %(default)s)")
        s.add_argument(
            "--batches",
            type=int,
            default=8,
            help="batches of generated (synthetic) data (default %(default)s)",
        )
        s.add_argument(
            "--workers",
            type=int,
            metavar="N",
            help="run the model on N worker processes, each on its share of the data, with the "
            "tables on --servers parameter-server shards (default: in this process)",
        )
        s.add_argument(
            "--servers",
            type=int,
            metavar="S",
            help="parameter-server shards for --workers (default: the plan's)",
        )
        if name == "predict":
            s.add_argument("-o", "--output", required=True, help="scores.npy or scores.csv")
        else:
            s.add_argument(
                "--group", metavar="COLUMN", help="GAUC: the AUC per value of this column (e.g. a user id)"
            )
            s.add_argument(
                "--slice", metavar="COLUMN", help="loss, AUC, calibration per value of this column"
            )
