"""`hetps train`, `bench` and `plot`: running a plan (or a model built from a schema) and its curves."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from runtime.cli.common import (
    EXIT_OK,
    UsageError,
    check_engine,
    describe,
    feed_vars,
    kernel_threads,
    load_plan,
    make_data,
    parse_counts,
    parse_feeds,
    resolve_run_options,
)
from runtime.cli.lifecycle import describe_eval, train_kwargs
from runtime.cli.model import model_plan, set_optimizer
from transpiler.config import default_micro_batches


def check_devices(plan, allow_emulation: bool) -> None:
    """A gpu trainer type without a CUDA device is a usage error naming --allow-emulation."""
    from runtime.exec.device import array_module

    if allow_emulation:
        return
    for t in plan.trainer_types:
        try:
            array_module(t)
        except RuntimeError:
            raise UsageError(
                f"trainer type {t!r} needs a CUDA GPU (cupy) and none was found: pass "
                "--allow-emulation to run it on CPU kernels, or install hetps[gpu] on a "
                "CUDA machine"
            ) from None


def check_fixed_batch(plan, batch_size: int, micro_batches: int | None, counts: dict[str, int]) -> None:
    """A plan whose feeds have a fixed leading dimension F takes micro-batches of exactly F
    examples: --batch-size must be F x readers x micro-batches (None: train's default). Raises
    UsageError naming it."""
    readers = next(iter(plan.reader_types), None)
    fixed = {v.shape[0] for v in feed_vars(plan).values() if v.shape and v.shape[0] > 0}
    if readers is None or len(fixed) != 1:
        return
    (f,) = fixed
    n = counts.get(readers, 1)
    full = {t: counts.get(t, 1) for t in plan.programs}
    micro_batches = micro_batches or default_micro_batches(full, readers)
    need = f * n * micro_batches
    if batch_size != need:
        raise UsageError(
            f"the plan's feeds have a fixed batch of {f} examples (written in the model), "
            f"so --batch-size must be {f} x {n} {readers} reader(s) x {micro_batches} "
            f"micro-batch(es) = {need} (or change --trainers / --micro-batches); a model "
            "transpiled with --fixed-batch can be transpiled again without it"
        )


def open_schema_data(args: argparse.Namespace, fitted: Any = None):
    """--data read by --schema (train data; checked, and the standardize stats fitted on it in one
    pass before training, unless `fitted`: the feature pipeline of a run resumed or a plan), and
    --eval-data read with the same fitted schema."""
    from runtime.data import open_dataset
    from runtime.data.files.features import check_same, find_features
    from runtime.data.files.schema import Schema

    try:
        schema = Schema.load(args.schema)
        fitted = find_features(args.resume) or fitted
        if fitted is not None:
            check_same(schema, fitted, f"features.json of {args.resume or args.plan}")
            schema = fitted if fitted.stats or not schema.needs_stats() else schema
        data = open_dataset(args.data.split(","), schema, args.batch_size, shuffle=args.shuffle, check=True)
        held_out = None
        if args.eval_data:
            held_out = open_dataset(args.eval_data.split(","), data.schema, batch_size=4096)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    if data.filled:
        print(f"missing values filled (by column): {data.filled}")
    return data, held_out


def cmd_train(args: argparse.Namespace) -> int:
    from runtime import train

    check_engine(args)
    given = args.trainers  # as typed (before --settings or the default fill it)
    resolve_run_options(args)
    counts, feeds = parse_counts(args.trainers), parse_feeds(args.feeds)
    if args.stream:
        return _train_stream(args, counts)
    if not args.data:
        raise UsageError("give --data (or --stream for online training)")
    args.trainers_given = given
    if args.steps is None and args.epochs is None and args.until_loss is None:
        raise UsageError("say when to stop: --steps N, --epochs N or --until-loss X")
    if (args.plan is None) == (args.model is None):
        raise UsageError(
            "give a PLAN_DIR to train, or --model wide_deep|deepfm|dlrm (with --schema) to build one"
        )
    if args.model and not args.schema:
        raise UsageError("--model reads the data by a schema: add --schema schema.yaml")
    if args.plan and (args.dim is not None or args.hidden is not None):
        raise UsageError("--dim / --hidden shape a --model; a PLAN_DIR's model is already built")
    run = _run_kwargs(args, counts)
    if args.model:
        return _fit_model(args, run, feeds)
    plan = load_plan(args.plan)
    if not any(t.optimizer for t in plan.tables):
        raise UsageError(
            f"nothing to train: every parameter of {args.plan} is frozen (its model has no loss; an "
            "ONNX model needs `hetps transpile MODEL --loss bce ...`)"
        )
    check_trainer_types(plan, counts, args.trainers_given)
    if args.schema:
        from runtime.data.files.features import find_features, save_features

        data, batch_size = open_schema_data(args, find_features(args.plan))[0], None
        args.schema = data.schema  # --eval-data is read with the training data's fitted stats
        if args.checkpoint:
            save_features(args.plan, data.schema)  # the plan carries the pipeline it trains with
    else:
        data, batch_size = make_data(plan, args.data, args.batch_size, feeds, args.vocab)
        check_fixed_batch(plan, args.batch_size, args.micro_batches, counts)
    check_devices(plan, args.allow_emulation)
    run["servers"] = args.servers or plan.config.num_servers
    if args.optimizer or args.lr is not None:
        print(f"optimizer: {set_optimizer(plan, args.optimizer, args.lr)} (--optimizer/--lr)")
    history = train(plan, data, batch_size=batch_size, **run, **train_kwargs(args, plan, feeds))
    _report(args, history)
    return EXIT_OK


def _train_stream(args: argparse.Namespace, counts: dict[str, int]) -> int:
    """train --stream: the online pass loop (runtime/cli/online.py)."""
    from runtime.cli.online import cmd_train_stream

    if args.plan is None:
        raise UsageError("--stream trains a PLAN_DIR (hetps transpile makes one)")
    plan = load_plan(args.plan)
    check_devices(plan, args.allow_emulation)
    run = _run_kwargs(args, counts)
    run["servers"] = args.servers or plan.config.num_servers
    return cmd_train_stream(args, plan, run)


def _run_kwargs(args: argparse.Namespace, counts: dict[str, int]) -> dict[str, Any]:
    """train()'s run arguments from the command line (a plan's servers are filled in later)."""
    return dict(
        steps=args.steps,
        epochs=args.epochs,
        until_loss=args.until_loss,
        trainers=counts,
        servers=args.servers,
        mode=args.mode,
        micro_batches=args.micro_batches,
        kernel_threads=kernel_threads(args),
        engine=args.engine,
        address=args.address,
        allow_emulation=args.allow_emulation,
        metrics=args.metrics,
        trace=args.trace,
        tensorboard=args.tensorboard,
        progress=False if args.no_progress else None,
    )


def check_trainer_types(plan, counts: dict[str, int], given: str | None) -> None:
    """--trainers must name every trainer type of the plan (before any device check)."""
    missing = [t for t in plan.trainer_types if t not in counts]
    extra = [t for t in counts if t not in plan.trainer_types]
    if given and (missing or extra):
        raise UsageError(
            f"--trainers {given}: the plan has the trainer types {plan.trainer_types}, so give a "
            f"count for each ({', '.join(f'{t}=1' for t in plan.trainer_types)}; without CUDA add "
            "--allow-emulation). For a CPU-only plan, transpile with a config of "
            "`trainer_types: [cpu]` and `category_map: {io: cpu, sparse: cpu, dense: cpu, loss: cpu}`"
        )


def _fit_model(args: argparse.Namespace, run: dict[str, Any], feeds: dict[str, str]) -> int:
    """train --model: build the model from the schema's feeds, write its plan directory (--out, or
    PLAN beside the checkpoints) with the fitted feature pipeline, and train it."""
    from runtime import train
    from runtime.data.files.features import save_features

    data, held_out = open_schema_data(args)
    model, plan = model_plan(args, data.schema, data.feed_shapes())
    out = args.out or (str(Path(args.checkpoint) / "plan") if args.checkpoint else None)
    check_trainer_types(plan, run["trainers"], args.trainers_given)
    check_devices(plan, args.allow_emulation)
    if out is not None:
        plan.save(out)
        save_features(out, data.schema)
    life = train_kwargs(args, None, feeds)
    life["eval_data"] = held_out
    life["eval_output"] = args.pred or model.pred.name
    history = train(plan, data, **run, **life)
    print(describe(history))
    if held_out is not None:
        last = history.eval[-1]
        grouped = f", GAUC {last['gauc']:.4f}" if "gauc" in last else ""
        print(f"held-out AUC {last['auc']:.4f}{grouped} on {held_out.rows()} rows of {args.eval_data}")
    if out is None:
        print("no plan directory written (give --out DIR, or --checkpoint DIR to write DIR/plan)")
    else:
        ck = f" --checkpoint {args.checkpoint}" if args.checkpoint else ""
        print(
            f"plan and feature pipeline written to {out}; next: hetps eval {out}{ck} --data FILES, "
            f"hetps predict {out}{ck} --data FILES -o scores.csv, "
            f"hetps export {out}{ck} --inference -o model.onnx"
        )
    return EXIT_OK


def _report(args: argparse.Namespace, history: Any) -> None:
    """What a finished train run did and where its outputs are, for the terminal."""
    if history.first_step:
        print(f"resumed at step {history.first_step} from {args.resume}")
    print(describe(history))
    for r in history.restarts:
        print(f"restarted: {r}")
    if history.eval:
        print(describe_eval(history))
    if args.checkpoint:
        print(f"checkpoints in {args.checkpoint} (resume: --resume {args.checkpoint})")
    if args.trace:
        print(f"timeline written to {args.trace} (open it in https://ui.perfetto.dev)")
    if args.tensorboard:
        print(
            f"TensorBoard events written to {args.tensorboard} "
            f"(view them: tensorboard --logdir {args.tensorboard})"
        )


def cmd_bench(args: argparse.Namespace) -> int:
    from runtime import train

    check_engine(args)
    resolve_run_options(args)
    if args.plan:
        plan = load_plan(args.plan)
    else:
        from transpiler import builder, transpile
        from transpiler.models import wide_deep

        model = wide_deep(
            vocab=args.vocab, dim=args.dim, hidden=tuple(args.hidden), optimizer=builder.SGD(lr=0.01)
        )
        plan = transpile(model.main)
    data, _ = make_data(plan, "synthetic", args.batch_size, {}, None)
    kw = dict(
        batch_size=args.batch_size,
        trainers=parse_counts(args.trainers),
        servers=args.servers,
        mode=args.mode,
        micro_batches=args.micro_batches,
        kernel_threads=kernel_threads(args),
        engine=args.engine,
        address=args.address,
        allow_emulation=True,
        progress=False,
    )
    train(plan, data, steps=args.warmup, **kw)  # the same shapes once: caches and allocator warm
    history = train(plan, data, steps=args.steps, **kw)
    print(describe(history))
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    from runtime.telemetry.plot import plot_metrics

    for p in args.metrics:
        if not Path(p).is_file():
            raise UsageError(f"no metrics file at {p}")
    print(f"curves drawn to {plot_metrics(args.metrics, args.output)}")
    return EXIT_OK
