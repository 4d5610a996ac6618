"""`hetps tune` and `inspect --predict`: placement and resources by measured cost (transpiler/cost/model.py,
transpiler/cost/tune.py, runtime/profile/machine.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from runtime.cli.common import (
    EXIT_OK,
    RunDefaults,
    UsageError,
    load_model,
    load_plan,
    make_data,
    parse_counts,
    resolve_run_options,
    settings_option,
)


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


def tune_profile(args: argparse.Namespace, plan):
    from runtime.profile.machine import load_profile, machine_profile

    if args.profile:
        if not Path(args.profile).is_file():
            raise UsageError(f"--profile {args.profile}: no such file")
        if args.refresh_profile:
            raise UsageError("--refresh-profile measures this machine: give it without --profile")
        return load_profile(args.profile)
    return machine_profile(plan, refresh=args.refresh_profile, log=lambda m: print(m, file=sys.stderr))


def tune_sample(plan, batch_size: int):
    """A batch of synthetic CTR data for the share of unique ids, or None when the feeds are not CTR's."""
    try:
        data, _ = make_data(plan, "synthetic", batch_size, {}, None)
    except UsageError:
        return None
    return data.batch(0, batch_size)


def tune_objective(args: argparse.Namespace):
    """The objective of --prices / --target / --max-hourly (`transpiler.cost.money.Objective`)."""
    from transpiler.cost.money import Objective, Prices

    if args.target is not None and args.max_hourly is not None:
        raise UsageError("give --target (the cheapest reaching it) or --max-hourly (the fastest within it)")
    if args.prices is None:
        if args.target is not None or args.max_hourly is not None:
            raise UsageError("--target and --max-hourly need --prices (e.g. --prices cpu=0.048,gpu=2.50)")
        return Objective()
    try:
        prices = Prices.parse(args.prices)
        kind = "target" if args.target else "budget" if args.max_hourly else "per_dollar"
        return Objective(kind, prices, args.target, args.max_hourly, args.epoch_examples)
    except (ValueError, OSError) as e:
        raise UsageError(f"--prices {args.prices}: {e}") from None


def tune_budget(args: argparse.Namespace, cluster):
    from transpiler.cost.tune import Budget

    if args.budget is None and cluster is None:
        raise UsageError("give --budget cpu=N[,gpu=N] (or --cluster, whose cores and GPUs are the budget)")
    limits = (
        parse_budget(args.budget)
        if args.budget
        else {"cpu": cluster.nodes * cluster.cores, "gpu": cluster.nodes * cluster.gpus}
    )
    modes = tuple(filter(None, args.modes.split(",")))
    try:
        return Budget(limits["cpu"], limits["gpu"], modes)
    except ValueError as e:
        raise UsageError(f"--budget {args.budget} --modes {args.modes}: {e}") from None


def cmd_tune(args: argparse.Namespace) -> int:
    from runtime.profile.machine import tune
    from transpiler import TranspileConfig, transpile
    from transpiler.cost.paper import Cluster

    try:
        cluster = Cluster.parse(args.cluster) if args.cluster else None
    except ValueError as e:
        raise UsageError(f"--cluster: {e}") from None
    objective = tune_objective(args)
    budget = tune_budget(args, cluster)
    cores = parse_cores(args.cores)
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
    profile, w = tune_machine(args, plan, cluster, cores)
    device_map = cluster.device_map(plan.trainer_types) if cluster is not None else None
    result = tune(
        target,
        budget,
        config=plan.config,
        profile=profile,
        objective=objective,
        workload=w,
        device_map=device_map,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import yaml

    (out / "config.yaml").write_text(yaml.safe_dump(result.config.to_dict(), sort_keys=False))
    w, s = result.workload, result.scale
    (out / "run.yaml").write_text(yaml.safe_dump(run_yaml(result), sort_keys=False))
    print(result.explain() if args.explain else "\n".join([result.prediction.describe(), *result.money()]))
    if profile.emulated and cluster is None:
        print(
            f"note: the profile's {', '.join(profile.emulated)} kernels were EMULATED on the CPU (no CUDA "
            "device where it was measured): predictions for those trainers are CPU timings"
        )
    counts = ",".join(f"{t}={n}" for t, n in s.trainers.items())
    print(
        f"wrote {out / 'config.yaml'} (TranspileConfig) and {out / 'run.yaml'} (run settings); use them:\n"
        f"  hetps transpile MODEL --config {out / 'config.yaml'} --out PLAN_DIR\n"
        f"  hetps train PLAN_DIR --settings {out / 'run.yaml'} --data ...   "
        f"(--trainers {counts} --servers {s.servers} --mode {s.mode} --micro-batches {s.micro_batches} "
        f"--batch-size {w.batch_size})"
    )
    if is_plan:
        print("(a plan directory keeps its placement: pass the MODEL to search placement too)")
    return EXIT_OK


def tune_machine(args: argparse.Namespace, plan, cluster, cores):
    """(profile, workload) the prediction is for: this machine's (under its load with --cores auto),
    or --cluster's on paper (its assumptions printed)."""
    from runtime.profile.machine import unique_fraction, workload_for

    profile = tune_profile(args, plan)
    sample = tune_sample(plan, args.batch_size)
    w = workload_for(profile, args.batch_size, cores, unique_fraction(plan, sample) if sample else 1.0)
    if cluster is not None:
        print(f"PREDICTION ON PAPER for {cluster.describe()}: this machine cannot run it; assumptions:")
        for line in cluster.assumptions(profile):
            print(f"  - {line}")
        return cluster.profile(profile), cluster.workload(w)
    if cores == "auto":
        print(f"this machine now: {profile.load.describe()}")
    return profile, w


def run_yaml(result: Any) -> dict[str, Any]:
    """The run.yaml of a `TuneResult`: train's flat names (`runtime.driver.settings.FLAT`) for the
    tuned scale and batch size, and the workload the prediction assumed (cores, unique ids)."""
    s, w = result.scale, result.workload
    return {
        "trainers": s.trainers,
        "micro_batches": s.micro_batches,
        "servers": s.servers,
        "mode": s.mode,
        "batch_size": w.batch_size,
        "cores": w.cores,
        "unique_fraction": w.unique_fraction,
        "dense_on_trainer": s.dense_on_trainer,
        **({"device_map": s.device_map} if s.device_map else {}),
    }


def parse_cores(text: str | None) -> int | str | None:
    """--cores: None (a core per process), 'auto' (this machine's cores under its load) or N."""
    if text is None or text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--cores {text!r}: expected a count >= 1 or 'auto' (this machine, under its load)")
    return int(text)


def predicted_summary(args: argparse.Namespace, plan) -> str:
    from transpiler.cost.model import Workload
    from transpiler.settings import ScaleConfig

    resolve_run_options(args)
    counts = parse_counts(args.trainers) if args.trainers else {t: 1 for t in plan.trainer_types}
    if set(counts) != set(plan.trainer_types):
        raise UsageError(f"--trainers {args.trainers}: give a count for each of {plan.trainer_types}")
    sample = tune_sample(plan, args.batch_size)
    from runtime.profile.machine import unique_fraction

    try:
        scale = ScaleConfig(counts, args.micro_batches, args.servers, args.mode)
        workload = Workload(args.batch_size, args.cores, unique_fraction(plan, sample) if sample else 1.0)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return plan.summary(tune_profile(args, plan), scale, workload)


def add_tune_command(sub: Any, command: Any) -> None:
    """`hetps tune` (`command` is cli._command)."""
    s = command(
        sub,
        "tune",
        cmd_tune,
        help="choose placement, trainer counts, micro-batches and shards by measured cost",
        description="Profile this machine (kernels, link, parameter server; "
        "cached under ~/.cache/hetps), predict throughput with the cost model and search placement "
        "of light and dense ops, trainer counts, micro-batches, shards and modes within --budget; "
        "write the winning TranspileConfig (config.yaml) and run settings (run.yaml) to --out.",
    )
    s.add_argument("model", help="model file (placement is searched too) or plan directory (resources only)")
    s.add_argument(
        "--budget",
        help="CPU processes (cpu trainers + PS shards) and GPUs, e.g. cpu=16,gpu=1 (default with --cluster: "
        "its cores and GPUs)",
    )
    s.add_argument("--out", required=True, help="directory for config.yaml and run.yaml")
    s.add_argument("--explain", action="store_true", help="say why the winner wins")
    s.add_argument("--modes", default="sync", help="PS modes the search may pick: sync, async or sync,async")
    s.add_argument("--batch-size", type=int, default=512, help="global batch size (default %(default)s)")
    s.add_argument(
        "--cores",
        help="all processes share this many idle CPU cores (one machine); 'auto': this machine's available "
        "cores under the load other processes put on them now",
    )
    s.add_argument("--profile", help="use this profile JSON instead of measuring this machine")
    s.add_argument(
        "--refresh-profile",
        action="store_true",
        help="measure this machine's profile again instead of the cached one (its calibration moves "
        "between measurements: docs/tuning.md)",
    )
    s.add_argument(
        "--prices",
        help="$ per core-hour and per GPU-hour (cpu=0.048,gpu=2.50) or a YAML price list (cpu:, gpu:, "
        "machines: {name: {cpu, gpu, hourly}}); alone: the most examples per $",
    )
    s.add_argument("--target", type=float, help="with --prices: the cheapest setting reaching N examples/s")
    s.add_argument("--max-hourly", type=float, help="with --prices: the fastest setting within $N per hour")
    s.add_argument(
        "--epoch-examples",
        type=int,
        default=100_000_000,
        help="examples per epoch, for the $ per epoch printed (default %(default)s)",
    )
    s.add_argument(
        "--cluster",
        help="predict ON PAPER for machines this one cannot run: nodes=N,cores=C,gpus=G (per node),"
        "bandwidth=10Gbit,latency=50us,gpu-speedup=10 (an emulated GPU's kernels: this CPU's / it)",
    )
    s.add_argument("--config", help="TranspileConfig to start from (YAML or JSON)")
    s.add_argument(
        "--loss",
        choices=("bce", "bce_with_logits", "mse", "softmax_ce"),
        help="ONNX models without a loss: attach this loss on the first output",
    )
    s.add_argument("--label", help="name of the label input the attached loss reads (default 'label')")


def predict_options(s: argparse.ArgumentParser) -> None:
    """`hetps inspect --predict` and the run options it predicts for."""
    defaults = RunDefaults(trainers=None, mode=None)
    s.set_defaults(run_defaults=defaults)
    s.add_argument(
        "--predict",
        action="store_true",
        help="show predicted examples/s and the bottleneck role (profiles this machine, cached)",
    )
    s.add_argument("--trainers", help="for --predict: trainers per type (default one of each)")
    s.add_argument("--servers", type=int, help="for --predict: PS shards (default: the plan's)")
    s.add_argument("--mode", choices=("sync", "async"), help="for --predict: PS mode (default: the plan's)")
    s.add_argument("--micro-batches", type=int, help="for --predict (default: as train's)")
    s.add_argument("--batch-size", type=int, help=f"for --predict (default {defaults.batch_size})")
    s.add_argument("--cores", type=int, help="for --predict: all processes share this many CPU cores")
    settings_option(s, "for --predict: ")
    s.add_argument("--profile", help="for --predict: a profile JSON instead of measuring this machine")
    s.add_argument(
        "--refresh-profile", action="store_true", help="for --predict: measure this machine's profile again"
    )
