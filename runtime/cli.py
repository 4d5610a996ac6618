"""The `hetps` command line: transpile a model into a plan, look at it, train it, plot the run.

    hetps transpile MODEL --out PLAN_DIR [--config cfg.yaml] [--loss bce] [--optimizer adam --lr 0.01]
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
    hetps tune MODEL|PLAN_DIR --budget cpu=16,gpu=1 --out TUNED_DIR [--explain]
    hetps train PLAN_DIR --settings TUNED_DIR/run.yaml --data synthetic --steps N   (flags override it)

Exit codes: 0 success, 1 the work failed (the message says why), 2 bad arguments (usage printed),
130 interrupted (Ctrl-C), 143 terminated (SIGTERM; cleaned up like Ctrl-C).
A MODEL is any file `transpiler.load.load_model` reads: ONNX, a saved PaddlePaddle training
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transpiler.cost import RunSettings

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Arguments that cannot work; reported with the subcommand's usage and exit code 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: handled like Ctrl-C (the run is torn down), then exit code 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the clean-up short
    raise Terminated


# -- models and plans ---------------------------------------------------------------------------
def load_model(path: Path, loss: str | None, label: str | None, onnx: OnnxOptions | None = None):
    """The training Program of MODEL (`transpiler.load.load_model`), its flags checked first."""
    from transpiler.load import ModelFileError, model_kind
    from transpiler.load import load_model as transpiler_load_model

    onnx = onnx or OnnxOptions()
    try:
        kind, f = model_kind(path)
    except ModelFileError as e:
        raise UsageError(str(e)) from None
    if kind != "onnx":
        for flag, value in (("--loss", loss), *onnx.given()):
            if value is not None:
                raise UsageError(f"{flag} applies to ONNX models only; {f} is a {kind} program")
        return transpiler_load_model(f)
    if loss is not None and (onnx.pred is not None or onnx.clamp_log is not None or not onnx.stable_log):
        raise UsageError("--pred / --clamp-log / --no-stable-log apply to a loss inside the model; with "
                         "--loss the prediction is the model's first output")
    return transpiler_load_model(f, loss=loss, label=label, dynamic_batch=not onnx.fixed_batch,
                                 pred=onnx.pred, log_clamp=onnx.clamp_log, stable_log=onnx.stable_log)


@dataclass(frozen=True)
class OnnxOptions:
    """transpile's options for ONNX models (see `transpiler.from_onnx`)."""

    fixed_batch: bool = False
    pred: str | None = None
    clamp_log: float | None = None
    stable_log: bool = True

    def given(self) -> list[tuple[str, Any]]:
        """(flag, value or None) of the options the user set."""
        return [("--fixed-batch", True if self.fixed_batch else None), ("--pred", self.pred),
                ("--clamp-log", self.clamp_log), ("--no-stable-log", None if self.stable_log else True)]


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


def has_optimizer_ops(program) -> bool:
    return any(op.role == "optimize" for op in program.ops)


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
    for t in plan.tables:
        old = t.get("optimizer")
        if not old:
            continue  # frozen
        kind = optimizer or old["type"]
        hyper = {k: v for k, v in old.items() if k not in ("type", "state")} if kind == old["type"] else {}
        if lr is not None:
            hyper["lr"] = lr
        t["optimizer"] = optimizer_spec(kind, hyper, Var(t["name"], shape=tuple(t["shape"])))
        used.add(describe_optimizer(t["optimizer"]))
    return ", ".join(sorted(used)) or "no trained tables"


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
    from transpiler import transpile

    config = load_config(args.config, args.optimizer, args.lr)
    onnx = OnnxOptions(args.fixed_batch, args.pred, args.clamp_log, not args.no_stable_log)
    program = load_model(Path(args.model), args.loss, args.label, onnx)
    plan = transpile(program, config)
    plan.save(args.out)
    print(plan.summary())
    if has_optimizer_ops(program):
        if args.optimizer or args.lr is not None:
            print("note: the model carries its own optimizer ops; --optimizer / --lr were not used "
                  "(use them with `hetps train` to override the plan's tables)")
    else:
        source = "--optimizer/--lr" if args.optimizer or args.lr is not None else \
            "--config" if args.config else "the default; change it with --optimizer / --lr"
        print(f"optimizer: {describe_optimizer(config.optimizer)} for every trained parameter "
              f"(the model carries none; {source})")
    print(f"plan written to {args.out}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    only_predict = ("settings", "trainers", "servers", "mode", "micro_batches", "batch_size", "cores",
                    "profile")
    given = [f"--{n.replace('_', '-')}" for n in only_predict if getattr(args, n) is not None]
    if given and not args.predict:
        raise UsageError(f"{', '.join(given)}: only used with --predict (the predicted examples/s and "
                         "bottleneck for those settings); add --predict, or leave them out")
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


def check_devices(plan, allow_emulation: bool) -> None:
    """A gpu trainer type without a CUDA device is a usage error naming --allow-emulation."""
    from .device import array_module

    if allow_emulation:
        return
    for t in plan.trainer_types:
        try:
            array_module(t)
        except RuntimeError:
            raise UsageError(f"trainer type {t!r} needs a CUDA GPU (cupy) and none was found: pass "
                             "--allow-emulation to run it on CPU kernels, or install hetps[gpu] on a "
                             "CUDA machine") from None


def check_fixed_batch(plan, batch_size: int, micro_batches: int, counts: dict[str, int]) -> None:
    """A plan whose feeds have a fixed leading dimension F takes micro-batches of exactly F
    examples: --batch-size must be F x readers x micro-batches. Raises UsageError naming it."""
    readers = next((t for t, prog in plan.programs.items() if prog.attrs.get("feeds")), None)
    fixed = {v.shape[0] for v in feed_vars(plan).values() if v.shape and v.shape[0] > 0}
    if readers is None or len(fixed) != 1:
        return
    (f,) = fixed
    n = counts.get(readers, 1)
    need = f * n * micro_batches
    if batch_size != need:
        raise UsageError(f"the plan's feeds have a fixed batch of {f} examples (written in the model), "
                         f"so --batch-size must be {f} x {n} {readers} reader(s) x {micro_batches} "
                         f"micro-batch(es) = {need} (or change --trainers / --micro-batches); a model "
                         "transpiled with --fixed-batch can be transpiled again without it")


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
    resolve_run_options(args)
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
        if args.optimizer:
            raise UsageError("--model trains with Adam; --lr sets its learning rate "
                             "(--optimizer is for a PLAN_DIR)")
        lr = 0.01 if args.lr is None else args.lr
        life = train_kwargs(args, None, feeds)
        del life["eval_data"]
        _, history, score = fit(args.model, data, eval_data=held_out, lr=lr, **run, **life)
        print(describe(history))
        if held_out is not None:
            print(f"held-out AUC {score:.4f} on {held_out.rows()} rows of {args.eval_data}")
        return EXIT_OK
    plan = load_plan(args.plan)
    if args.schema:
        data, batch_size = open_schema_data(args)[0], None
    else:
        data, batch_size = make_data(plan, args.data, args.batch_size, feeds, args.vocab)
        check_fixed_batch(plan, args.batch_size, args.micro_batches, counts)
    check_devices(plan, args.allow_emulation)
    run["servers"] = args.servers or plan.config.num_servers
    if args.optimizer or args.lr is not None:
        print(f"optimizer: {set_optimizer(plan, args.optimizer, args.lr)} (--optimizer/--lr)")
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
    resolve_run_options(args)
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


# -- tune: placement and resources by measured cost (transpiler/cost.py + tune.py, runtime/profile.py)
def parse_budget(text: str) -> dict[str, int]:
    """'cpu=16,gpu=1' -> {"cpu": 16, "gpu": 1} (gpu may be 0 or left out)."""
    out = {"gpu": 0}
    for part in filter(None, text.split(",")):
        name, eq, n = part.partition("=")
        if not eq or name.strip() not in ("cpu", "gpu") or not n.isdigit():
            raise UsageError(f"--budget {text!r}: expected cpu=N[,gpu=N], e.g. cpu=16,gpu=1")
        out[name.strip()] = int(n)
    if out.get("cpu", 0) < 2:
        raise UsageError(f"--budget {text!r}: give cpu=N with N >= 2 (a trainer and a PS shard)")
    return out


def _tune_profile(args: argparse.Namespace, plan):
    from .profile import load_profile, machine_profile

    if args.profile:
        if not Path(args.profile).is_file():
            raise UsageError(f"--profile {args.profile}: no such file")
        return load_profile(args.profile)
    return machine_profile(plan, log=lambda m: print(m, file=sys.stderr))


def _tune_sample(plan, batch_size: int):
    """A batch of synthetic CTR data for the share of unique ids, or None when the feeds are not CTR's."""
    try:
        data, _ = make_data(plan, "synthetic", batch_size, {}, None)
    except UsageError:
        return None
    return data.batch(0, batch_size)


def cmd_tune(args: argparse.Namespace) -> int:
    from transpiler import TranspileConfig, transpile
    from transpiler.tune import Budget

    from .profile import tune

    budget = parse_budget(args.budget)
    modes = tuple(filter(None, args.modes.split(",")))
    if not modes or set(modes) - {"sync", "async"}:
        raise UsageError(f"--modes {args.modes!r}: expected sync, async or sync,async")
    path = Path(args.model)
    is_plan = path.is_dir() and (path / "plan.json").is_file()
    if is_plan:
        if args.config:
            raise UsageError("--config applies to a MODEL; a plan directory keeps its own placement")
        target = plan = load_plan(args.model)
    else:
        config = TranspileConfig.load(args.config) if args.config else None
        target = load_model(path, args.loss, args.label)
        plan = transpile(target, config)
    profile = _tune_profile(args, plan)
    result = tune(target, Budget(budget["cpu"], budget["gpu"], modes), config=plan.config,
                  batch_size=args.batch_size, cores=args.cores, sample=_tune_sample(plan, args.batch_size),
                  profile=profile)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import yaml

    (out / "config.yaml").write_text(yaml.safe_dump(result.config.to_dict(), sort_keys=False))
    (out / "run.yaml").write_text(yaml.safe_dump(result.settings.to_dict(), sort_keys=False))
    s = result.settings
    print(result.explain() if args.explain else result.prediction.describe())
    if profile.emulated:
        print(f"note: the profile's {', '.join(profile.emulated)} kernels were EMULATED on the CPU (no CUDA "
              "device where it was measured): predictions for those trainers are CPU timings")
    counts = ",".join(f"{t}={n}" for t, n in s.trainers.items())
    print(f"wrote {out / 'config.yaml'} (TranspileConfig) and {out / 'run.yaml'} (run settings); use them:\n"
          f"  hetps transpile MODEL --config {out / 'config.yaml'} --out PLAN_DIR\n"
          f"  hetps train PLAN_DIR --settings {out / 'run.yaml'} --data ...   "
          f"(--trainers {counts} --servers {s.servers} --mode {s.mode} --micro-batches {s.micro_batches} "
          f"--batch-size {s.batch_size})")
    if is_plan:
        print("(a plan directory keeps its placement: pass the MODEL to search placement too)")
    return EXIT_OK


def _add_tune_command(sub: Any) -> None:
    s = _command(sub, "tune", cmd_tune, help="choose placement, trainer counts, micro-batches and shards "
                 "by measured cost", description="Profile this machine (kernels, link, parameter server; "
                 "cached under ~/.cache/hetps), predict throughput with the cost model and search placement "
                 "of light and dense ops, trainer counts, micro-batches, shards and modes within --budget; "
                 "write the winning TranspileConfig (config.yaml) and run settings (run.yaml) to --out.")
    s.add_argument("model", help="model file (placement is searched too) or plan directory (resources only)")
    s.add_argument("--budget", required=True,
                   help="CPU processes (cpu trainers + PS shards) and GPUs, e.g. cpu=16,gpu=1")
    s.add_argument("--out", required=True, help="directory for config.yaml and run.yaml")
    s.add_argument("--explain", action="store_true", help="say why the winner wins")
    s.add_argument("--modes", default="sync", help="PS modes the search may pick: sync, async or sync,async")
    s.add_argument("--batch-size", type=int, default=512, help="global batch size (default %(default)s)")
    s.add_argument("--cores", type=int, help="all processes share this many CPU cores (one machine)")
    s.add_argument("--profile", help="use this profile JSON instead of measuring this machine")
    s.add_argument("--config", help="TranspileConfig to start from (YAML or JSON)")
    s.add_argument("--loss", choices=("bce", "bce_with_logits", "mse", "softmax_ce"),
                   help="ONNX models without a loss: attach this loss on the first output")
    s.add_argument("--label", help="name of the label input the attached loss reads (default 'label')")


def _add_predict_options(s: argparse.ArgumentParser) -> None:
    defaults = RunDefaults(trainers=None, mode=None)
    s.set_defaults(run_defaults=defaults)
    s.add_argument("--predict", action="store_true",
                   help="show predicted examples/s and the bottleneck role (profiles this machine, cached)")
    s.add_argument("--trainers", help="for --predict: trainers per type (default one of each)")
    s.add_argument("--servers", type=int, help="for --predict: PS shards (default: the plan's)")
    s.add_argument("--mode", choices=("sync", "async"), help="for --predict: PS mode (default: the plan's)")
    s.add_argument("--micro-batches", type=int, help=f"for --predict (default {defaults.micro_batches})")
    s.add_argument("--batch-size", type=int, help=f"for --predict (default {defaults.batch_size})")
    s.add_argument("--cores", type=int, help="for --predict: all processes share this many CPU cores")
    _settings_option(s, "for --predict: ")
    s.add_argument("--profile", help="for --predict: a profile JSON instead of measuring this machine")


def predicted_summary(args: argparse.Namespace, plan) -> str:
    from transpiler.cost import RunSettings

    resolve_run_options(args)
    counts = parse_counts(args.trainers) if args.trainers else {t: 1 for t in plan.trainer_types}
    if set(counts) != set(plan.trainer_types):
        raise UsageError(f"--trainers {args.trainers}: give a count for each of {plan.trainer_types}")
    mode = args.mode or (plan.config.mode if plan.config.mode in ("sync", "async") else "sync")
    sample = _tune_sample(plan, args.batch_size)
    from .profile import unique_fraction

    settings = RunSettings(counts, args.micro_batches, args.servers or plan.config.num_servers, mode,
                           args.batch_size, args.cores, unique_fraction(plan, sample) if sample else 1.0)
    return plan.summary(_tune_profile(args, plan), settings)


# -- run options: flags, then a --settings file (run.yaml of `hetps tune`), then defaults ----------------
@dataclass(frozen=True)
class RunDefaults:
    """A command's defaults of the run options (None: decided later, from the plan)."""

    trainers: str | None
    mode: str | None = "sync"
    micro_batches: int = 4
    batch_size: int = 512


def load_settings(path: str) -> RunSettings:
    """The RunSettings of a run.yaml written by `hetps tune`; a bad file is a usage error naming it."""
    import yaml

    from transpiler.cost import RunSettings

    if not Path(path).is_file():
        raise UsageError(f"--settings {path}: no such file (hetps tune ... --out DIR writes DIR/run.yaml)")
    try:
        return RunSettings.from_dict(yaml.safe_load(Path(path).read_text()))
    except (yaml.YAMLError, ValueError) as e:
        raise UsageError(f"--settings {path}: not the run.yaml of hetps tune: {e}") from None


def resolve_run_options(args: argparse.Namespace) -> None:
    """Fill each run option not given as a flag (None): from --settings FILE, else the command's default."""
    fallback = asdict(args.run_defaults)
    if getattr(args, "settings", None):
        s = load_settings(args.settings)
        fallback.update(trainers=",".join(f"{t}={n}" for t, n in s.trainers.items()), mode=s.mode,
                        micro_batches=s.micro_batches, batch_size=s.batch_size, servers=s.servers,
                        cores=s.cores)
    for name, value in fallback.items():
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, value)


def _settings_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--settings", metavar="RUN_YAML",
                   help=f"{what}trainers, servers, mode, micro-batches and batch size from this run.yaml "
                   "(written by hetps tune); flags given override it")


# -- parser ------------------------------------------------------------------------------------------
def _run_options(p: argparse.ArgumentParser, defaults: RunDefaults) -> None:
    p.set_defaults(run_defaults=defaults)
    p.add_argument("--trainers", help=f"trainers per type, e.g. cpu=2,gpu=1 (default {defaults.trainers})")
    p.add_argument("--servers", type=int, default=None,
                   help="parameter-server shards (default: the plan's num_servers, 1 unless configured)")
    p.add_argument("--mode", choices=("sync", "async"),
                   help=f"parameter-server mode (default {defaults.mode})")
    p.add_argument("--micro-batches", type=int,
                   help=f"micro-batches in flight per reader trainer (default {defaults.micro_batches})")
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: processes on this machine; ray: actors on a Ray cluster "
                   "(pip install hetps[ray])")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto', 'ray://host:10001'); default: start a local Ray")
    p.add_argument("--batch-size", type=int,
                   help="examples per global batch (one step), for every kind of --data and --schema data "
                   f"(default {defaults.batch_size})")


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


def build_parser() -> argparse.ArgumentParser:
    from .cli_lifecycle import add_commands, train_options

    p = argparse.ArgumentParser(prog="hetps", description="Heterogeneous parameter-server training: "
                                "transpile a model into per-trainer-type programs and train them.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details; show tracebacks")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
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
    s.add_argument("--pred", metavar="NAME",
                   help="ONNX models with a loss inside: the tensor holding the prediction, scored for "
                   "the AUC (default: found in a binary cross-entropy written as Log/Sigmoid ops)")
    s.add_argument("--clamp-log", type=float, metavar="EPS",
                   help="ONNX models with a loss inside: every Log of the loss reads max(x, EPS), e.g. "
                   "1e-7 (torch's BCELoss clamps its logs, its ONNX export does not); changes the maths")
    s.add_argument("--no-stable-log", action="store_true",
                   help="ONNX models with a loss inside: keep Log(Sigmoid(z)) and Log(1 - Sigmoid(z)) as "
                   "exported (by default they are evaluated as -softplus(-z) and -softplus(z): the same "
                   "function, finite where the sigmoid saturates)")
    s.add_argument("--fixed-batch", action="store_true",
                   help="ONNX models: keep a batch size written in the graph's inputs (by default it is "
                   "made dynamic when the graph allows it)")
    _optimizer_options(s, "for models that carry no optimizer ops (ONNX); default adam, lr 0.01")

    s = _command(sub, "inspect", cmd_inspect, help="print a plan's placement, boundary tensors and tables")
    s.add_argument("plan", help="plan directory")
    s.add_argument("--explain", action="append", metavar="VAR",
                   help="why the op producing VAR runs where it does")
    s.add_argument("--program", metavar="TYPE", help="print the sub-program of trainer type TYPE")
    _add_predict_options(s)

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
    s.add_argument("--shuffle", type=int, default=0, metavar="ROWS",
                   help="with --schema: shuffle windows of ROWS rows (seeded; default 0, file order)")
    s.add_argument("--feeds", help="data column -> program feed, e.g. sparse=a,dense=b,label=c")
    s.add_argument("--vocab", type=int, help="id range of categorical data (default: smallest sparse table)")
    s.add_argument("--steps", type=int, help="stop after N steps")
    s.add_argument("--epochs", type=int, help="stop after N passes over file data")
    s.add_argument("--until-loss", type=float, help="stop once the loss is at or below X")
    _run_options(s, RunDefaults("cpu=2,gpu=1"))
    _settings_option(s, "")
    _optimizer_options(s, "replaces the optimizer of every trained table of the plan")
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
    _run_options(s, RunDefaults("cpu=1,gpu=1"))

    _add_tune_command(sub)

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
        print(f"hetps {args.command}: error: {type(e).__name__}: {one_line(e, args.verbose)}",
              file=sys.stderr)
        return EXIT_FAIL
    finally:
        if previous is not None:  # main() may run inside another program (tests)
            signal.signal(signal.SIGTERM, previous)


def one_line(e: Exception, verbose: bool) -> str:
    """The error's message; for a TrainingError (which holds the failed process's traceback) only
    its last line unless `verbose`."""
    from .train import TrainingError

    if isinstance(e, TrainingError) and not verbose:
        last = next((line.strip() for line in reversed(e.detail.splitlines()) if line.strip()), "")
        return f"{e.who} failed: {last} (hetps -v ... shows its traceback)"
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
