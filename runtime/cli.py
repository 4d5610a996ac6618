"""The `hetps` command line: transpile a model into a plan, look at it, train it, plot the run.

    hetps transpile MODEL --out PLAN_DIR [--config cfg.yaml] [--loss bce]
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
    hetps bench [--steps N] [--trainers cpu=1,gpu=1]
    hetps plot METRICS.jsonl [...] -o curves.png

Exit codes: 0 success, 1 the work failed (the message says why), 2 bad arguments (usage printed).
A MODEL is an ONNX file (`.onnx`), a saved PaddlePaddle training program (`paddle.static.save`
prefix: `.pdmodel` for the legacy IR, `.json` + `.pdparams` for PIR) or a saved hetps program
(`Program.save`: `.json` [+ `.npz`]).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Arguments that cannot work; reported with the subcommand's usage and exit code 2."""


# -- models and plans ---------------------------------------------------------------------------
def model_kind(path: Path) -> tuple[str, Path]:
    """("onnx" | "paddle-legacy" | "paddle-pir" | "hetps", path) of a model file or file prefix."""
    if path.suffix == ".onnx" and path.is_file():
        return "onnx", path
    for suffix, kind in ((".pdmodel", "paddle-legacy"), (".json", None)):
        f = path if path.suffix == suffix else Path(f"{path}{suffix}")
        if not f.is_file():
            continue
        if kind:
            return kind, f
        if f.with_suffix(".pdparams").is_file():
            return "paddle-pir", f
        try:
            is_program = "blocks" in json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            is_program = False
        if is_program:
            return "hetps", f
        raise UsageError(f"{f} is neither a saved hetps program (JSON with 'blocks') nor a saved "
                         "PIR Paddle program (no .pdparams beside it)")
    if path.is_dir() and (path / "plan.json").is_file():
        raise UsageError(f"{path} is already a plan directory; use it with inspect / draw / train")
    raise UsageError(f"no model at {path}: expected an .onnx file, a paddle.static.save prefix "
                     "(.pdmodel, or .json + .pdparams) or a hetps Program.save file (.json)")


def load_paddle(kind: str, path: Path):
    """A saved Paddle training program (`paddle.static.save`) with its saved values, imported."""
    import paddle

    from transpiler import from_paddle

    paddle.enable_static()
    prefix = str(path.with_suffix(""))
    if kind == "paddle-legacy":
        with paddle.pir_utils.OldIrGuard():
            program = paddle.static.Program.parse_from_string(path.read_bytes())
            # a parsed ProgramDesc forgets which vars were data: those read, never written, not persistable
            block = program.global_block()
            written = {n for op in block.ops for n in op.output_arg_names}
            for n in {n for op in block.ops for n in op.input_arg_names} - written:
                if not block.var(n).persistable:
                    block.var(n).is_data = True
            return from_paddle(program, scope=_paddle_scope(paddle, prefix))
    program = paddle.static.Program()
    paddle.base.core.deserialize_pir_program(str(path), program, 1)
    return from_paddle(program, scope=_paddle_scope(paddle, prefix))


def _paddle_scope(paddle, prefix: str):
    scope = paddle.static.Scope()
    for name, value in paddle.static.load_program_state(prefix).items():
        scope.var(name).get_tensor().set(np.asarray(value), paddle.CPUPlace())
    return scope


def load_model(path: Path, loss: str | None, label: str | None):
    """A training Program from any model file `model_kind` recognises."""
    kind, f = model_kind(path)
    if loss is not None and kind != "onnx":
        raise UsageError(f"--loss applies to ONNX models only; {f} is a {kind} program")
    if kind == "onnx":
        from transpiler import from_onnx

        program = from_onnx(f, loss=loss, label=label)
    elif kind == "hetps":
        from transpiler import Program

        program = Program.load(f)
    else:
        program = load_paddle(kind, f)
    return program


def load_plan(path: str):
    from transpiler import Plan

    if not (Path(path) / "plan.json").is_file():
        raise UsageError(f"{path} is not a plan directory (no plan.json); make one with "
                         "`hetps transpile MODEL --out DIR`")
    return Plan.load(path)


# -- data -----------------------------------------------------------------------------------------
def parse_counts(text: str) -> dict[str, int]:
    """'cpu=2,gpu=1' -> {"cpu": 2, "gpu": 1}."""
    out = {}
    for part in filter(None, text.split(",")):
        name, eq, n = part.partition("=")
        if not eq or not name or not n.isdigit() or int(n) < 1:
            raise UsageError(f"--trainers {text!r}: expected TYPE=N[,TYPE=N...] with N >= 1, "
                             "e.g. cpu=2,gpu=1")
        out[name.strip()] = int(n)
    if not out:
        raise UsageError("--trainers is empty; e.g. --trainers cpu=2,gpu=1")
    return out


def parse_feeds(text: str | None) -> dict[str, str]:
    """'sparse=a,dense=b,label=c' -> {"sparse": "a", ...}: data column -> program feed name."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        src, eq, dst = part.partition("=")
        if not eq or src not in ("sparse", "dense", "label") or not dst:
            raise UsageError(f"--feeds {text!r}: expected sparse=NAME,dense=NAME,label=NAME")
        out[src] = dst
    return out


def feed_vars(plan) -> dict[str, Any]:
    """{feed name: Var} of the plan's data ops (read by the trainer type that owns them)."""
    return {n: prog.var(n) for prog in plan.programs.values() for n in prog.attrs.get("feeds", [])}


def make_data(plan, spec: str, batch_size: int, feeds: dict[str, str], vocab: int | None):
    """A data source for `runtime.train` from --data: "synthetic[:seed=N]", a .npz of arrays, or
    Criteo text files. Returns (data, batch_size for train: set for generated data only)."""
    from .data import ArrayReader, CriteoReader, SyntheticCTR

    fv = feed_vars(plan)
    names = {k: feeds.get(k, k) for k in ("sparse", "dense", "label")}
    tables = [t["shape"][0] for t in plan.tables if t["kind"] == "sparse"]
    vocab = vocab or (min(tables) if tables else None)
    kind, _, opts = spec.partition(":")
    if kind == "synthetic" or kind.endswith(".txt") or kind.endswith(".tsv") or Path(kind).is_dir():
        missing = [n for n in names.values() if n not in fv]
        if missing or len(fv) != 3:
            raise UsageError(f"the plan's feeds are {sorted(fv)}; CTR data has sparse, dense and label "
                             f"columns: map them with --feeds sparse=NAME,dense=NAME,label=NAME")
        if vocab is None:
            raise UsageError("the plan has no sparse table to take the id range from: pass --vocab N")
    if kind == "synthetic":
        kw = dict(p.split("=", 1) for p in filter(None, opts.split(",")))
        sparse, dense = fv[names["sparse"]].shape, fv[names["dense"]].shape
        return SyntheticCTR(vocab=vocab, num_slots=sparse[1], num_dense=dense[1], seed=int(kw.get("seed", 0)),
                            sparse_name=names["sparse"], dense_name=names["dense"],
                            label_name=names["label"]), batch_size
    path = Path(kind)
    if path.suffix == ".npz" and path.is_file():
        with np.load(path, allow_pickle=False) as z:
            arrays = {feeds.get(k, k): z[k] for k in z.files}
        return ArrayReader(arrays, batch_size), None
    files = sorted(path.glob("*")) if path.is_dir() else [Path(p) for p in spec.split(",")]
    if not files or not all(f.is_file() for f in files):
        raise UsageError(f"--data {spec!r}: expected 'synthetic', a .npz file, Criteo text files "
                         "(comma-separated) or a directory of them")
    columns = (names["sparse"], names["dense"], names["label"])
    return CriteoReader(files, vocab, batch_size, names=columns), None


def describe(history) -> str:
    """What a run did, for the terminal: steps, loss, AUC, throughput, per-trainer time use."""
    window = max(1, min(10, history.steps // 4))
    loss = float(np.mean(history.loss[-window:])) if history.steps else float("nan")
    return (f"{history.steps} steps in {history.wall_s:.1f} s (+{history.startup_s:.1f} s start-up); "
            f"loss {loss:.4f}, AUC {history.auc_over(window):.4f} (last {window} steps); "
            f"{history.examples_per_s():,.0f} examples/s\n{history.time_use()}")


# -- subcommands ------------------------------------------------------------------------------------
def cmd_transpile(args: argparse.Namespace) -> int:
    from transpiler import TranspileConfig, transpile

    config = TranspileConfig.load(args.config) if args.config else None
    program = load_model(Path(args.model), args.loss, args.label)
    plan = transpile(program, config)
    plan.save(args.out)
    print(plan.summary())
    print(f"plan written to {args.out}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    if args.program:
        if args.program not in plan.programs:
            raise UsageError(f"--program {args.program!r}: the plan's trainer types are {plan.trainer_types}")
        print(plan.programs[args.program])
        return EXIT_OK
    print(plan.summary())
    for name in args.explain or []:
        print(plan.explain(name))
    return EXIT_OK


def cmd_draw(args: argparse.Namespace) -> int:
    from transpiler.draw import FORMATS

    if Path(args.output).suffix.lower().lstrip(".") not in FORMATS:
        raise UsageError(f"-o {args.output}: name a .png, .svg or .pdf file (.svg suits big graphs)")
    print(f"placement drawn to {load_plan(args.plan).draw(args.output)}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    if args.inference:
        from .cli_lifecycle import cmd_export_inference

        return cmd_export_inference(args)
    if args.checkpoint:
        raise UsageError("--checkpoint goes with --inference (a servable model with trained weights)")
    for f in load_plan(args.plan).to_onnx(args.output):
        print(f"wrote {f}")
    return EXIT_OK


def check_engine(args: argparse.Namespace) -> None:
    if args.address is not None and args.engine != "ray":
        raise UsageError(f"--address {args.address} names a Ray cluster: add --engine ray")


def open_schema_data(args: argparse.Namespace):
    """--data read by --schema (train data), and --eval-data read with the same schema and stats."""
    from .data import open_dataset

    try:
        data = open_dataset(args.data.split(","), args.schema, args.batch_size, shuffle=args.shuffle)
        held_out = None
        if args.eval_data:
            held_out = open_dataset(args.eval_data.split(","), data.schema, batch_size=4096)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    return data, held_out


def cmd_train(args: argparse.Namespace) -> int:
    from . import train
    from .cli_lifecycle import describe_eval, train_kwargs

    check_engine(args)
    counts, feeds = parse_counts(args.trainers), parse_feeds(args.feeds)
    if args.steps is None and args.epochs is None and args.until_loss is None:
        raise UsageError("say when to stop: --steps N, --epochs N or --until-loss X")
    if (args.plan is None) == (args.model is None):
        raise UsageError("give a PLAN_DIR to train, or --model wide_deep|deepfm|dlrm (with --schema) "
                         "to build one")
    if args.model and not args.schema:
        raise UsageError("--model reads the data by a schema: add --schema schema.yaml")
    run = dict(steps=args.steps, epochs=args.epochs, until_loss=args.until_loss, trainers=counts,
               servers=args.servers, mode=args.mode, micro_batches=args.micro_batches, engine=args.engine,
               address=args.address, allow_emulation=args.allow_emulation, metrics=args.metrics,
               trace=args.trace, tensorboard=args.tensorboard, progress=False if args.no_progress else None)
    if args.model:
        from .ingest.models import fit

        data, held_out = open_schema_data(args)
        life = train_kwargs(args, None, feeds)
        del life["eval_data"]
        _, history, score = fit(args.model, data, eval_data=held_out, lr=args.lr, **run, **life)
        print(describe(history))
        if held_out is not None:
            print(f"held-out AUC {score:.4f} on {held_out.rows()} rows of {args.eval_data}")
        return EXIT_OK
    plan = load_plan(args.plan)
    if args.schema:
        data, batch_size = open_schema_data(args)[0], None
    else:
        data, batch_size = make_data(plan, args.data, args.batch_size, feeds, args.vocab)
    history = train(plan, data, batch_size=batch_size, **run, **train_kwargs(args, plan, feeds))
    if history.first_step:
        print(f"resumed at step {history.first_step} from {args.resume}")
    print(describe(history))
    if history.eval:
        print(describe_eval(history))
    if args.checkpoint:
        print(f"checkpoints in {args.checkpoint} (resume: --resume {args.checkpoint})")
    if args.trace:
        print(f"timeline written to {args.trace} (open it in https://ui.perfetto.dev)")
    if args.tensorboard:
        print(f"TensorBoard events written to {args.tensorboard} "
              f"(view them: tensorboard --logdir {args.tensorboard})")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from . import train

    check_engine(args)
    if args.plan:
        plan = load_plan(args.plan)
    else:
        from transpiler import builder, transpile
        from transpiler.models import wide_deep

        model = wide_deep(vocab=args.vocab, dim=args.dim, hidden=tuple(args.hidden),
                          optimizer=builder.SGD(lr=0.01))
        plan = transpile(model.main)
    data, _ = make_data(plan, "synthetic", args.batch_size, {}, None)
    kw = dict(batch_size=args.batch_size, trainers=parse_counts(args.trainers), servers=args.servers,
              mode=args.mode, micro_batches=args.micro_batches, engine=args.engine, address=args.address,
              allow_emulation=True, progress=False)
    train(plan, data, steps=args.warmup, **kw)  # the same shapes once: caches and allocator warm
    history = train(plan, data, steps=args.steps, **kw)
    print(describe(history))
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    from .plot import plot_metrics

    for p in args.metrics:
        if not Path(p).is_file():
            raise UsageError(f"no metrics file at {p}")
    print(f"curves drawn to {plot_metrics(args.metrics, args.output)}")
    return EXIT_OK


# -- parser ------------------------------------------------------------------------------------------
def _run_options(p: argparse.ArgumentParser, trainers: str) -> None:
    p.add_argument("--trainers", default=trainers,
                   help="trainers per type, e.g. cpu=2,gpu=1 (default %(default)s)")
    p.add_argument("--servers", type=int, default=1, help="parameter-server shards (default 1)")
    p.add_argument("--mode", choices=("sync", "async"), default="sync", help="parameter-server mode")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches in flight per reader trainer")
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: processes on this machine; ray: actors on a Ray cluster "
                   "(pip install hetps[ray])")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto', 'ray://host:10001'); default: start a local Ray")
    p.add_argument("--batch-size", type=int, default=512,
                   help="examples per step for generated data and --schema data")


def _command(sub: Any, name: str, func: Any, **kw: Any) -> argparse.ArgumentParser:
    s = sub.add_parser(name, **kw)
    s.set_defaults(func=func, usage=s.format_usage)
    return s


def build_parser() -> argparse.ArgumentParser:
    from .cli_lifecycle import add_commands, train_options

    p = argparse.ArgumentParser(prog="hetps", description="Heterogeneous parameter-server training: "
                                "transpile a model into per-trainer-type programs and train them.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details; show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = _command(sub, "transpile", cmd_transpile, help="place and split a model into a plan directory",
                       description="Import MODEL (.onnx, a paddle.static.save prefix, or a hetps "
                       "Program.save .json), place its ops on trainer types, split it and save the plan.")
    s.add_argument("model", help="model file or paddle.static.save prefix")
    s.add_argument("--out", required=True, help="plan directory to write")
    s.add_argument("--config", help="TranspileConfig as YAML or JSON (placement, PS mode, optimizer)")
    s.add_argument("--loss", choices=("bce", "bce_with_logits", "mse", "softmax_ce"),
                   help="ONNX models without a loss: attach this loss on the first output")
    s.add_argument("--label", help="name of the label input the attached loss reads (default 'label')")

    s = _command(sub, "inspect", cmd_inspect, help="print a plan's placement, boundary tensors and tables")
    s.add_argument("plan", help="plan directory")
    s.add_argument("--explain", action="append", metavar="VAR",
                   help="why the op producing VAR runs where it does")
    s.add_argument("--program", metavar="TYPE", help="print the sub-program of trainer type TYPE")

    s = _command(sub, "draw", cmd_draw, help="draw a plan's op graph by trainer type (PNG, SVG or PDF)")
    s.add_argument("plan", help="plan directory")
    s.add_argument("-o", "--output", required=True,
                   help="file to write: .png, .svg (sharp and searchable for big graphs) or .pdf")

    s = _command(sub, "export", cmd_export, help="export each sub-program of a plan to ONNX")
    s.add_argument("plan", help="plan directory")
    s.add_argument("-o", "--output", required=True,
                   help="directory for <trainer type>.onnx files; with --inference, the .onnx file")
    s.add_argument("--inference", action="store_true",
                   help="one servable ONNX model (standard ops only): the forward graph with trained weights")
    s.add_argument("--checkpoint", metavar="DIR",
                   help="with --inference: the weights (a checkpoint, or train's checkpoint directory)")
    s.add_argument("--rows", choices=("all", "existing"), default="all",
                   help="with --inference: sparse tables as full [vocab, dim] arrays (all), or only the "
                   "rows that exist, ids remapped by a .ids.npz beside the model (existing)")

    s = _command(sub, "train", cmd_train, help="train a plan on trainer and parameter-server processes")
    s.add_argument("plan", nargs="?", help="plan directory (or build a model with --model)")
    s.add_argument("--data", required=True,
                   help="'synthetic[:seed=N]', a .npz of arrays, or Criteo text files "
                   "(comma-separated, or a directory); with --schema: CSV / TSV / Criteo / slot text "
                   "(.gz too) / Parquet files, directories or globs ('train/*.parquet')")
    s.add_argument("--schema", help="YAML schema: label, dense, sparse, multi columns -> feeds "
                   "(runtime/ingest/schema.py)")
    s.add_argument("--model", choices=("wide_deep", "deepfm", "dlrm"),
                   help="build this model from the schema's feeds instead of a PLAN_DIR")
    s.add_argument("--eval-data", help="held-out data, read like --data (synthetic: other batches): "
                   "print the trained model's held-out loss and AUC")
    s.add_argument("--lr", type=float, default=0.01, help="Adam learning rate of a --model (default 0.01)")
    s.add_argument("--shuffle", type=int, default=0, metavar="ROWS",
                   help="with --schema: shuffle windows of ROWS rows (seeded; default 0, file order)")
    s.add_argument("--feeds", help="data column -> program feed, e.g. sparse=a,dense=b,label=c")
    s.add_argument("--vocab", type=int, help="id range of categorical data (default: smallest sparse table)")
    s.add_argument("--steps", type=int, help="stop after N steps")
    s.add_argument("--epochs", type=int, help="stop after N passes over file data")
    s.add_argument("--until-loss", type=float, help="stop once the loss is at or below X")
    _run_options(s, "cpu=2,gpu=1")
    s.add_argument("--allow-emulation", action="store_true",
                   help="run gpu trainers on CPU kernels when no CUDA device exists (logged)")
    s.add_argument("--metrics", help="append metrics (loss, AUC, examples/s) to this JSONL file")
    s.add_argument("--trace", help="write a Chrome-trace timeline (Perfetto) of every trainer and server")
    s.add_argument("--tensorboard", metavar="DIR",
                   help="write loss, AUC and examples/s as TensorBoard event files in DIR")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    train_options(s)

    add_commands(sub, _command)

    s = _command(sub, "bench", cmd_bench, help="measure training throughput on synthetic CTR data",
                       description="Train Wide&Deep (or --plan) on synthetic data with gpu trainers "
                       "emulated when no CUDA device exists; print examples/s and per-trainer busy time.")
    s.add_argument("--plan", help="benchmark this plan directory instead of the built-in Wide&Deep")
    s.add_argument("--steps", type=int, default=100, help="measured steps (default %(default)s)")
    s.add_argument("--warmup", type=int, default=5, help="steps of a warm-up run first (default %(default)s)")
    s.add_argument("--vocab", type=int, default=100_000)
    s.add_argument("--dim", type=int, default=16)
    s.add_argument("--hidden", type=int, nargs="+", default=[400, 400, 400])
    _run_options(s, "cpu=1,gpu=1")

    s = _command(sub, "plot", cmd_plot, help="plot loss, AUC and examples/s from metrics JSONL files")
    s.add_argument("metrics", nargs="+", help="metrics JSONL file(s) written by train --metrics")
    s.add_argument("-o", "--output", required=True, help="PNG file to write")
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
    try:
        return args.func(args)
    except UsageError as e:
        sys.stderr.write(args.usage())
        print(f"hetps {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"hetps {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hetps inspect plan | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return EXIT_OK
    except Exception as e:  # the work failed: say why in one line (the traceback with -v)
        if args.verbose:
            traceback.print_exc()
        print(f"hetps {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
