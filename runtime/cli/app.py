"""The `hetps` command line: transpile a model into a plan, look at it, train it, plot the run.

    hetps transpile MODEL --out PLAN_DIR [--config cfg.yaml] [--loss bce | --losses ctr=bce:click,...]
                    [--optimizer adam --lr 0.01]
    hetps inspect PLAN_DIR [--explain VAR] [--program TYPE]
    hetps draw PLAN_DIR -o plan.png        (or plan.svg for big graphs)
    hetps export PLAN_DIR -o ONNX_DIR
    hetps export PLAN_DIR --checkpoint DIR --inference -o model.onnx
    hetps train PLAN_DIR --data synthetic --steps N --trainers cpu=2,gpu=1 --servers 1 --mode sync
    hetps train PLAN_DIR --data synthetic --steps N --checkpoint DIR --checkpoint-every 100 \
                --eval-data synthetic:seed=1 --eval-every 100 [--resume DIR]
    hetps eval PLAN_DIR --checkpoint DIR --data D
    hetps predict PLAN_DIR --checkpoint DIR --data D -o scores.npy
    hetps train PLAN_DIR --data 'train/*.parquet' --schema schema.yaml --epochs 1
    hetps train --data train.csv --schema schema.yaml --model wide_deep --epochs 2 --eval-data test.csv
    hetps train PLAN_DIR --stream logs/ --schema schema.yaml --checkpoint DIR --publish PUB_DIR
    hetps bench [--steps N] [--trainers cpu=1,gpu=1]
    hetps plot METRICS.jsonl [...] -o curves.png
    hetps tune MODEL|PLAN_DIR --budget cpu=16,gpu=1 --out TUNED_DIR [--explain]
    hetps train PLAN_DIR --settings TUNED_DIR/run.yaml --data synthetic --steps N   (flags override it)

Exit codes: 0 success, 1 the work failed (the message says why), 2 bad arguments (usage printed),
130 interrupted (Ctrl-C), 143 terminated (SIGTERM; cleaned up like Ctrl-C).
A MODEL is any file `transpiler.frontends.load.load_model` reads: ONNX, a saved PaddlePaddle training
program or a saved hetps program.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any

from runtime.cli.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, RunDefaults, UsageError, settings_option
from runtime.cli.lifecycle import add_commands, train_options
from runtime.cli.model import cmd_draw, cmd_export, cmd_inspect, cmd_transpile, set_optimizer
from runtime.cli.online import online_options
from runtime.cli.train import cmd_bench, cmd_plot, cmd_train
from runtime.cli.tune import add_tune_command, predict_options

__all__ = [
    "EXIT_FAIL",
    "EXIT_OK",
    "EXIT_USAGE",
    "UsageError",
    "build_parser",
    "main",
    "one_line",
    "set_optimizer",
]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: handled like Ctrl-C (the run is torn down), then exit code 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the clean-up short
    raise Terminated


# -- parser ------------------------------------------------------------------------------------------


def _run_options(p: argparse.ArgumentParser, defaults: RunDefaults) -> None:
    p.set_defaults(run_defaults=defaults)
    p.add_argument("--trainers", help=f"trainers per type, e.g. cpu=2,gpu=1 (default {defaults.trainers})")
    p.add_argument(
        "--servers",
        type=int,
        default=None,
        help="parameter-server shards (default: the plan's num_servers, 1 unless configured)",
    )
    p.add_argument(
        "--mode", choices=("sync", "async"), help=f"parameter-server mode (default {defaults.mode})"
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        help="micro-batches per step and reader trainer (default: the fewest that give every trainer an "
        "item each step, 1 unless a type has more trainers than readers)",
    )
    p.add_argument(
        "--kernel-threads",
        metavar="TYPE=N,...",
        help="threads per trainer process of a type for its large matrix products, e.g. gpu=2 for a "
        "gpu trainer emulated on CPU cores the others leave idle (default 1)",
    )
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: processes on this machine; ray: actors on a Ray cluster (pip install hetps[ray])",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto', 'ray://host:10001'); default: start a local Ray",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="examples per global batch (one step), for every kind of --data and --schema data "
        f"(default {defaults.batch_size})",
    )


def _optimizer_options(p: argparse.ArgumentParser, what: str) -> None:
    from transpiler.config import OPTIMIZERS

    p.add_argument("--optimizer", choices=OPTIMIZERS, help=f"table optimizer: {what}")
    p.add_argument("--lr", type=float, help="learning rate of that optimizer")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hetps")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def _command(sub: Any, name: str, func: Any, **kw: Any) -> argparse.ArgumentParser:
    s = sub.add_parser(name, **kw)
    s.set_defaults(func=func, usage=s.format_usage)
    return s


def _add_transpile(sub: Any) -> None:
    s = _command(
        sub,
        "transpile",
        cmd_transpile,
        help="place and split a model into a plan directory",
        description="Import MODEL (.onnx, a paddle.static.save prefix, or a hetps "
        "Program.save .json), place its ops on trainer types, split it and save the plan.",
    )
    s.add_argument(
        "model", help="model file or paddle.static.save prefix; or wide_deep|deepfm|dlrm with --schema"
    )
    s.add_argument("--out", required=True, help="plan directory to write")
    s.add_argument("--schema", help="with a built-in model: the YAML schema whose feeds it is built for")
    s.add_argument("--dim", type=int, help="built-in model: embedding width (default 8)")
    s.add_argument("--hidden", type=int, nargs="+", help="built-in model: MLP layer sizes (default 64 32)")
    s.add_argument("--config", help="TranspileConfig as YAML or JSON (placement, PS mode, optimizer)")
    s.add_argument(
        "--loss",
        choices=("bce", "bce_with_logits", "mse", "softmax_ce"),
        help="ONNX models without a loss: attach this loss on the first output",
    )
    s.add_argument("--label", help="name of the label input the attached loss reads (default 'label')")
    s.add_argument(
        "--losses",
        metavar="OUT=LOSS:LABEL[:W],...",
        help="ONNX multi-task models: a loss per output against its own label input, summed with "
        "weights W (default 1), e.g. ctr=bce:click,ctcvr=bce:buy (ESMM); each output is a task",
    )
    _onnx_import_options(s)
    s.add_argument(
        "--unbounded",
        action="store_true",
        help="every sparse table's vocabulary is unbounded: any 64-bit id is a row, created on first "
        "use (TranspileConfig.unbounded; for a schema's hash64 ids)",
    )
    _optimizer_options(s, "for models that carry no optimizer ops (ONNX); default adam, lr 0.01")


def _onnx_import_options(s: Any) -> None:
    """How an ONNX model's loss and batch are read at import (transpile)."""
    s.add_argument(
        "--pred",
        metavar="NAME",
        help="ONNX models with a loss inside: the tensor holding the prediction, scored for "
        "the AUC (default: found in a binary cross-entropy written as Log/Sigmoid ops)",
    )
    s.add_argument(
        "--clamp-log",
        type=float,
        metavar="EPS",
        help="ONNX models with a loss inside: every Log of the loss reads max(x, EPS), e.g. "
        "1e-7 (torch's BCELoss clamps its logs, its ONNX export does not); changes the maths",
    )
    s.add_argument(
        "--no-stable-log",
        action="store_true",
        help="ONNX models with a loss inside: keep Log(Sigmoid(z)) and Log(1 - Sigmoid(z)) as "
        "exported (by default they are evaluated as -softplus(-z) and -softplus(z): the same "
        "function, finite where the sigmoid saturates)",
    )
    s.add_argument(
        "--fixed-batch",
        action="store_true",
        help="ONNX models: keep a batch size written in the graph's inputs (by default it is "
        "made dynamic when the graph allows it)",
    )


def _add_inspect(sub: Any) -> None:
    s = _command(sub, "inspect", cmd_inspect, help="print a plan's placement, boundary tensors and tables")
    s.add_argument("plan", help="plan directory")
    s.add_argument(
        "--explain", action="append", metavar="VAR", help="why the op producing VAR runs where it does"
    )
    s.add_argument("--program", metavar="TYPE", help="print the sub-program of trainer type TYPE")
    predict_options(s)


def _add_draw(sub: Any) -> None:
    s = _command(sub, "draw", cmd_draw, help="draw a plan's op graph by trainer type (PNG, SVG or PDF)")
    s.add_argument("plan", help="plan directory")
    s.add_argument(
        "-o",
        "--output",
        required=True,
        help="file to write: .png, .svg (sharp and searchable for big graphs) or .pdf",
    )


def _add_export(sub: Any) -> None:
    s = _command(sub, "export", cmd_export, help="export each sub-program of a plan to ONNX")
    s.add_argument("plan", help="plan directory")
    s.add_argument(
        "-o",
        "--output",
        required=True,
        help="directory for <trainer type>.onnx files; with --inference, the .onnx file",
    )
    s.add_argument(
        "--inference",
        action="store_true",
        help="one servable ONNX model (standard ops only): the forward graph with trained weights",
    )
    s.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="with --inference: the weights (a checkpoint, or train's checkpoint directory)",
    )
    s.add_argument(
        "--rows",
        choices=("all", "existing"),
        default="all",
        help="with --inference: sparse tables as full [vocab, dim] arrays (all), or only the "
        "rows that exist, ids remapped by a .ids.npz beside the model (existing)",
    )
    s.add_argument("--pred", metavar="NAME", help="with --inference: the prediction tensor (default: found)")


def _model_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("--out", metavar="PLAN_DIR", help="with --model: write the plan directory here")
    s.add_argument("--dim", type=int, help="with --model: embedding width (default 8)")
    s.add_argument("--hidden", type=int, nargs="+", help="with --model: MLP layer sizes (default 64 32)")
    s.add_argument(
        "--pred",
        metavar="NAME",
        help="the prediction tensor --eval-data scores (default: the one forward result no op reads)",
    )


def _add_train(sub: Any) -> None:

    s = _command(sub, "train", cmd_train, help="train a plan on trainer and parameter-server processes")
    s.add_argument("plan", nargs="?", help="plan directory (or build a model with --model)")
    s.add_argument(
        "--data",
        help="'synthetic[:seed=N]', a .npz of arrays, or Criteo text files "
        "(comma-separated, or a directory); with --schema: CSV / TSV / Criteo / slot text "
        "(.gz too) / Parquet files, directories or globs ('train/*.parquet')",
    )
    s.add_argument(
        "--schema",
        help="YAML schema: label, dense, sparse, multi columns -> feeds (runtime/data/files/schema.py)",
    )
    s.add_argument(
        "--model",
        choices=("wide_deep", "deepfm", "dlrm"),
        help="build this model from the schema's feeds instead of a PLAN_DIR (its plan directory "
        "is written to --out, or PLAN inside --checkpoint)",
    )
    _model_options(s)
    s.add_argument(
        "--eval-data",
        help="held-out data, read like --data (synthetic: other batches): "
        "print the trained model's held-out loss and AUC",
    )
    s.add_argument(
        "--shuffle",
        type=int,
        default=0,
        metavar="ROWS",
        help="with --schema: shuffle windows of ROWS rows (seeded; default 0, file order)",
    )
    s.add_argument("--feeds", help="data column -> program feed, e.g. sparse=a,dense=b,label=c")
    s.add_argument("--vocab", type=int, help="id range of categorical data (default: smallest sparse table)")
    s.add_argument("--steps", type=int, help="stop after N steps")
    s.add_argument("--epochs", type=int, help="stop after N passes over file data")
    s.add_argument("--until-loss", type=float, help="stop once the loss is at or below X")
    _run_options(s, RunDefaults("cpu=2,gpu=1"))
    settings_option(s, "")
    _optimizer_options(s, "replaces the optimizer of every trained table of the plan")
    s.add_argument(
        "--allow-emulation",
        action="store_true",
        help="run gpu trainers on CPU kernels when no CUDA device exists (logged)",
    )
    s.add_argument("--metrics", help="append metrics (loss, AUC, examples/s) to this JSONL file")
    s.add_argument("--trace", help="write a Chrome-trace timeline (Perfetto) of every trainer and server")
    s.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write loss, AUC and examples/s as TensorBoard event files in DIR",
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    train_options(s)
    online_options(s)


def _add_bench(sub: Any) -> None:
    s = _command(
        sub,
        "bench",
        cmd_bench,
        help="measure training throughput on synthetic CTR data",
        description="Train Wide&Deep (or --plan) on synthetic data with gpu trainers "
        "emulated when no CUDA device exists; print examples/s and per-trainer busy time.",
    )
    s.add_argument("--plan", help="benchmark this plan directory instead of the built-in Wide&Deep")
    s.add_argument("--steps", type=int, default=100, help="measured steps (default %(default)s)")
    s.add_argument("--warmup", type=int, default=5, help="steps of a warm-up run first (default %(default)s)")
    s.add_argument("--vocab", type=int, default=100_000)
    s.add_argument("--dim", type=int, default=16)
    s.add_argument("--hidden", type=int, nargs="+", default=[400, 400, 400])
    _run_options(s, RunDefaults("cpu=1,gpu=1"))


def _add_plot(sub: Any) -> None:
    s = _command(sub, "plot", cmd_plot, help="plot loss, AUC and examples/s from metrics JSONL files")
    s.add_argument("metrics", nargs="+", help="metrics JSONL file(s) written by train --metrics")
    s.add_argument("-o", "--output", required=True, help="PNG file to write")


def build_parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(
        prog="hetps",
        description="Heterogeneous parameter-server training: "
        "transpile a model into per-trainer-type programs and train them.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details; show tracebacks")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_transpile, _add_inspect, _add_draw, _add_export, _add_train):
        add(sub)
    add_commands(sub, _command)
    _add_bench(sub)
    add_tune_command(sub, _command)
    _add_plot(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, message printed)
        return int(e.code or 0)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return args.func(args)
    except UsageError as e:
        sys.stderr.write(args.usage())
        print(f"hetps {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Terminated:
        print(f"hetps {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"hetps {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hetps inspect plan | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return EXIT_OK
    except Exception as e:  # the work failed: say why in one line (the traceback with -v)
        if args.verbose:
            traceback.print_exc()
        print(
            f"hetps {args.command}: error: {type(e).__name__}: {one_line(e, args.verbose)}", file=sys.stderr
        )
        return EXIT_FAIL
    finally:
        if previous is not None:  # main() may run inside another program (tests)
            signal.signal(signal.SIGTERM, previous)


def one_line(e: Exception, verbose: bool) -> str:
    """The error's message; for a TrainingError (which holds the failed process's traceback) only
    its last line unless `verbose`."""
    from runtime.driver.train import TrainingError

    if isinstance(e, TrainingError) and not verbose:
        last = next((line.strip() for line in reversed(e.detail.splitlines()) if line.strip()), "")
        return f"{e.who} failed: {last} (hetps -v ... shows its traceback)"
    return str(e)
