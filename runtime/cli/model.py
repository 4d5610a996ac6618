"""`hetps transpile`, `inspect`, `draw` and `export`: a MODEL into a plan directory, and looking at it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from runtime.cli.common import EXIT_OK, OnnxOptions, UsageError, load_model, load_plan
from runtime.cli.lifecycle import cmd_export_inference
from runtime.cli.tune import predicted_summary


def has_optimizer_ops(program) -> bool:
    return any(op.role == "optimize" for op in program.ops)


def load_config(path: str | None, optimizer: str | None, lr: float | None):
    """The TranspileConfig of --config (YAML or JSON), with --optimizer / --lr over its optimizer."""
    from transpiler import TranspileConfig

    config = TranspileConfig()
    if path is not None:
        if not Path(path).is_file():
            raise UsageError(f"--config {path}: no such file")
        try:
            config = TranspileConfig.load(path)
        except Exception as e:  # YAML / JSON syntax, unknown keys, bad values
            raise UsageError(f"--config {path}: {e}") from None
    if optimizer is not None or lr is not None:
        same = optimizer is None or optimizer == config.optimizer["type"]
        opt = dict(config.optimizer) if same else {"type": optimizer}
        if lr is not None:
            opt["lr"] = lr
        config.optimizer = opt
    return config


def describe_optimizer(opt: dict[str, Any]) -> str:
    """'adam(lr=0.01)' for an optimizer spec {"type", hyper-parameters..., "state"?}."""
    hyper = ", ".join(f"{k}={v}" for k, v in opt.items() if k not in ("type", "state"))
    return f"{opt['type']}({hyper})"


def set_optimizer(plan, optimizer: str | None, lr: float | None) -> str:
    """Replace the optimizer of every trained table of `plan` (--optimizer / --lr of train);
    returns what the tables now use, for the terminal."""
    from transpiler.ir import Var
    from transpiler.passes.insert_ps import optimizer_spec

    used = set()
    for i, t in enumerate(plan.tables):
        old = t.optimizer
        if not old:
            continue  # frozen
        kind = optimizer or old.type
        hyper = dict(old.hyper) if kind == old.type else {}
        if lr is not None:
            hyper["lr"] = lr
        new = optimizer_spec(kind, hyper, Var(t.name, shape=tuple(t.shape)))
        plan.tables[i] = replace(t, optimizer=new)
        used.add(describe_optimizer(new.to_dict()))
    return ", ".join(sorted(used)) or "no trained tables"


def model_plan(args: argparse.Namespace, schema, shapes: dict[str, tuple]) -> tuple[Any, Any]:
    """(Model, Plan) of --model built for the schema's feeds, with --dim / --hidden / --optimizer /
    --lr (default Adam, lr 0.01), transpiled with --config (default: the default config)."""
    from runtime.data.models import build_model
    from transpiler import builder as nn
    from transpiler import transpile

    kinds = {"sgd": nn.SGD, "adagrad": nn.Adagrad, "adam": nn.Adam}
    kind = args.optimizer or "adam"
    if kind not in kinds:
        raise UsageError(f"--optimizer {kind}: --model builds with one of {sorted(kinds)}")
    optimizer = kinds[kind](lr=0.01 if args.lr is None else args.lr)
    dim, hidden = args.dim or 8, tuple(args.hidden or (64, 32))
    try:
        model = build_model(args.model, schema, shapes, dim=dim, hidden=hidden, optimizer=optimizer)
    except ValueError as e:
        raise UsageError(str(e)) from None
    config = load_config(getattr(args, "config", None), None, None)
    print(f"{args.model}: dim {dim}, hidden {list(hidden)}, {kind}(lr={optimizer.lr})")
    return model, transpile(model.main, config)


def schema_plan(args: argparse.Namespace) -> int:
    """transpile wide_deep|deepfm|dlrm --schema S: the built-in model for the schema's feeds (a
    dense list column's width is read off data: train --model --data does that)."""
    from runtime.data.files.features import save_features
    from runtime.data.files.schema import Schema

    try:
        schema = Schema.load(args.schema)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--schema {args.schema}: {e}") from None
    shapes: dict[str, tuple] = {"dense": (len(schema.dense),)} if schema.dense else {}
    if schema.sparse:
        shapes["sparse"] = (len(schema.sparse),)
    _, plan = model_plan(args, schema, shapes)
    plan.save(args.out)
    save_features(args.out, schema)  # without stats: `hetps train` fits them on its --data
    print(plan.summary())
    print(f"plan written to {args.out} (with the schema as features.json; train fits its statistics)")
    return EXIT_OK


def cmd_transpile(args: argparse.Namespace) -> int:
    from runtime.data.models import MODELS
    from transpiler import transpile

    if args.model in MODELS:
        if not args.schema:
            raise UsageError(
                f"transpile {args.model}: a built-in model is built for a schema: add --schema S"
            )
        return schema_plan(args)
    if args.schema or args.dim or args.hidden:
        raise UsageError(f"--schema / --dim / --hidden go with a built-in model ({', '.join(MODELS)})")
    config = load_config(args.config, args.optimizer, args.lr)
    if getattr(args, "unbounded", False):
        config.unbounded = True
    onnx = OnnxOptions(args.fixed_batch, args.pred, args.clamp_log, not args.no_stable_log, args.losses)
    program = load_model(Path(args.model), args.loss, args.label, onnx)
    plan = transpile(program, config)
    plan.save(args.out)
    print(plan.summary())
    if not any(t.optimizer for t in plan.tables):
        print(
            "warning: nothing will train: the plan has no loss, so every parameter is frozen "
            "(an ONNX model without a loss needs --loss bce|bce_with_logits|mse|softmax_ce, "
            "against the input --label); it can still be evaluated or exported",
            file=sys.stderr,
        )
    elif has_optimizer_ops(program):
        if args.optimizer or args.lr is not None:
            print(
                "note: the model carries its own optimizer ops; --optimizer / --lr were not used "
                "(use them with `hetps train` to override the plan's tables)"
            )
    else:
        source = (
            "--optimizer/--lr"
            if args.optimizer or args.lr is not None
            else "--config"
            if args.config
            else "the default; change it with --optimizer / --lr"
        )
        print(
            f"optimizer: {describe_optimizer(config.optimizer)} for every trained parameter "
            f"(the model carries none; {source})"
        )
    print(f"plan written to {args.out}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    only_predict = (
        "settings",
        "trainers",
        "servers",
        "mode",
        "micro_batches",
        "batch_size",
        "cores",
        "profile",
    )
    given = [f"--{n.replace('_', '-')}" for n in only_predict if getattr(args, n) is not None]
    if given and not args.predict:
        raise UsageError(
            f"{', '.join(given)}: only used with --predict (the predicted examples/s and "
            "bottleneck for those settings); add --predict, or leave them out"
        )
    plan = load_plan(args.plan)
    if args.program:
        if args.program not in plan.programs:
            raise UsageError(f"--program {args.program!r}: the plan's trainer types are {plan.trainer_types}")
        print(plan.programs[args.program])
        return EXIT_OK
    if args.explain:
        for name in args.explain:
            print(plan.explain(name))
        return EXIT_OK
    print(predicted_summary(args, plan) if args.predict else plan.summary())
    return EXIT_OK


def cmd_draw(args: argparse.Namespace) -> int:
    from transpiler.exporters.draw import FORMATS

    if Path(args.output).suffix.lower().lstrip(".") not in FORMATS:
        raise UsageError(f"-o {args.output}: name a .png, .svg or .pdf file (.svg suits big graphs)")
    print(f"placement drawn to {load_plan(args.plan).draw(args.output)}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    if args.inference:
        return cmd_export_inference(args)
    if args.checkpoint:
        raise UsageError("--checkpoint goes with --inference (a servable model with trained weights)")
    for f in load_plan(args.plan).to_onnx(args.output):
        print(f"wrote {f}")
    return EXIT_OK
