"""What the `hetps` commands share (runtime/cli/app.py wires them): usage errors, reading a MODEL or a
PLAN_DIR, --trainers / --feeds / --data, the run options a --settings file fills, a run's summary."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ops_registry.errors import HetpsError

if TYPE_CHECKING:
    from runtime.driver.settings import Settings
    from transpiler.cost.model import Workload

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(HetpsError):
    """Arguments that cannot work; reported with the subcommand's usage and exit code 2."""


def load_model(path: Path, loss: str | None, label: str | None, onnx: OnnxOptions | None = None):
    """The training Program of MODEL (`transpiler.frontends.load.load_model`), its flags checked first."""
    from transpiler.frontends.load import ModelFileError, model_kind
    from transpiler.frontends.load import load_model as transpiler_load_model

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
    losses, weights = parse_losses(onnx.losses) if onnx.losses else (None, None)
    if losses and (loss is not None or label is not None):
        raise UsageError("--losses (one loss per output) replaces --loss / --label; give one or the other")
    if losses and (onnx.pred is not None or onnx.clamp_log is not None or not onnx.stable_log):
        raise UsageError(
            "--pred / --clamp-log / --no-stable-log apply to a loss inside the model, not --losses"
        )
    if loss is not None and (onnx.pred is not None or onnx.clamp_log is not None or not onnx.stable_log):
        raise UsageError(
            "--pred / --clamp-log / --no-stable-log apply to a loss inside the model; with "
            "--loss the prediction is the model's first output"
        )
    return transpiler_load_model(
        f,
        loss=loss,
        label=label,
        dynamic_batch=not onnx.fixed_batch,
        pred=onnx.pred,
        log_clamp=onnx.clamp_log,
        stable_log=onnx.stable_log,
        **({"losses": losses, "weights": weights} if losses else {}),
    )


def parse_losses(text: str) -> tuple[dict[str, tuple[str, str]], dict[str, float]]:
    """`--losses ctr=bce:click,ctcvr=bce:buy:0.5` -> ({output: (loss, label)}, {output: weight})."""
    losses, weights = {}, {}
    for item in text.split(","):
        out, _, spec = item.strip().partition("=")
        parts = spec.split(":")
        if not out or len(parts) not in (2, 3) or not all(parts[:2]):
            raise UsageError(
                f"--losses item {item!r}: expected OUTPUT=LOSS:LABEL[:WEIGHT], e.g. ctr=bce:click"
            )
        losses[out] = (parts[0], parts[1])
        if len(parts) == 3:
            try:
                weights[out] = float(parts[2])
            except ValueError:
                raise UsageError(f"--losses item {item!r}: the weight {parts[2]!r} is not a number") from None
    return losses, weights


@dataclass(frozen=True)
class OnnxOptions:
    """transpile's options for ONNX models (see `transpiler.from_onnx`)."""

    fixed_batch: bool = False
    pred: str | None = None
    clamp_log: float | None = None
    stable_log: bool = True
    losses: str | None = None  # --losses OUTPUT=LOSS:LABEL[:WEIGHT],...

    def given(self) -> list[tuple[str, Any]]:
        """(flag, value or None) of the options the user set."""
        return [
            ("--fixed-batch", True if self.fixed_batch else None),
            ("--pred", self.pred),
            ("--clamp-log", self.clamp_log),
            ("--no-stable-log", None if self.stable_log else True),
            ("--losses", self.losses),
        ]


def load_plan(path: str):
    from transpiler import Plan

    if not (Path(path) / "plan.json").is_file():
        raise UsageError(
            f"{path} is not a plan directory (no plan.json); make one with `hetps transpile MODEL --out DIR`"
        )
    return Plan.load(path)


def parse_counts(text: str, option: str = "--trainers") -> dict[str, int]:
    """'cpu=2,gpu=1' -> {"cpu": 2, "gpu": 1} (`option`: the flag it came from, for the error)."""
    out = {}
    for part in filter(None, text.split(",")):
        name, eq, n = part.partition("=")
        if not eq or not name or not n.isdigit() or int(n) < 1:
            raise UsageError(f"{option} {text!r}: expected TYPE=N[,TYPE=N...] with N >= 1, e.g. cpu=2,gpu=1")
        out[name.strip()] = int(n)
    if not out:
        raise UsageError(f"{option} is empty; e.g. {option} cpu=2,gpu=1")
    return out


def kernel_threads(args: argparse.Namespace) -> dict[str, int] | None:
    """train()'s `kernel_threads` from --kernel-threads (None: 1 thread for every type)."""
    return parse_counts(args.kernel_threads, "--kernel-threads") if args.kernel_threads else None


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
    """A data source for `runtime.driver.train` from --data: "synthetic[:seed=N]", a .npz of arrays, or
    Criteo text files. Returns (data, batch_size for train: set for generated data only)."""
    from runtime.data import ArrayReader, CriteoReader, SyntheticCTR

    fv = feed_vars(plan)
    names = {k: feeds.get(k, k) for k in ("sparse", "dense", "label")}
    tables = [t.shape[0] for t in plan.tables if t.kind == "sparse"]
    vocab = vocab or (min(tables) if tables else None)
    kind, _, opts = spec.partition(":")
    if kind == "synthetic" or kind.endswith(".txt") or kind.endswith(".tsv") or Path(kind).is_dir():
        missing = [n for n in names.values() if n not in fv]
        if missing or len(fv) != 3:
            raise UsageError(
                f"the plan's feeds are {sorted(fv)}; CTR data has sparse, dense and label "
                f"columns: map them with --feeds sparse=NAME,dense=NAME,label=NAME"
            )
        if vocab is None:
            raise UsageError("the plan has no sparse table to take the id range from: pass --vocab N")
    if kind == "synthetic":
        kw = dict(p.split("=", 1) for p in filter(None, opts.split(",")))
        sparse, dense = fv[names["sparse"]].shape, fv[names["dense"]].shape
        return SyntheticCTR(
            vocab=vocab,
            num_slots=sparse[1],
            num_dense=dense[1],
            seed=int(kw.get("seed", 0)),
            sparse_name=names["sparse"],
            dense_name=names["dense"],
            label_name=names["label"],
        ), batch_size
    path = Path(kind)
    if path.suffix == ".npz" and path.is_file():
        with np.load(path, allow_pickle=False) as z:
            arrays = {feeds.get(k, k): z[k] for k in z.files}
        return ArrayReader(arrays, batch_size), None
    files = sorted(path.glob("*")) if path.is_dir() else [Path(p) for p in spec.split(",")]
    if not files or not all(f.is_file() for f in files):
        raise UsageError(
            f"--data {spec!r}: expected 'synthetic', a .npz file, Criteo text files "
            "(comma-separated) or a directory of them"
        )
    columns = (names["sparse"], names["dense"], names["label"])
    return CriteoReader(files, vocab, batch_size, names=columns), None


def describe(history) -> str:
    """What a run did, for the terminal: steps, loss, AUC, throughput, per-trainer time use."""
    window = max(1, min(10, history.steps // 4))
    loss = float(np.mean(history.loss[-window:])) if history.steps else float("nan")
    return (
        f"{history.steps} steps in {history.wall_s:.1f} s (+{history.startup_s:.1f} s start-up); "
        f"loss {loss:.4f}, AUC {history.auc_over(window):.4f} (last {window} steps, training batches); "
        f"{history.examples_per_s():,.0f} examples/s (steps 2-{history.steps}, start-up and the first "
        f"step excluded)\n{history.time_use()}"
    )


def check_engine(args: argparse.Namespace) -> None:
    if args.address is not None and args.engine != "ray":
        raise UsageError(f"--address {args.address} names a Ray cluster: add --engine ray")


@dataclass(frozen=True)
class RunDefaults:
    """A command's defaults of the run options (None: decided later, from the plan)."""

    trainers: str | None
    mode: str | None = "sync"
    micro_batches: int | None = None  # None: train's (transpiler.config.default_micro_batches)
    batch_size: int = 512


def load_settings(path: str) -> tuple[Settings, Workload]:
    """The settings records of a run.yaml (written by `hetps tune`: the groups `scale:`, `run:` and
    `workload:`, what the prediction assumed; or flat `train` keywords), and the cost model's
    workload; a bad file is a usage error naming it."""
    import yaml

    from runtime.driver.settings import Settings
    from transpiler.cost.model import Workload

    if not Path(path).is_file():
        raise UsageError(f"--settings {path}: no such file (hetps tune ... --out DIR writes DIR/run.yaml)")
    try:
        data = yaml.safe_load(Path(path).read_text())
        workload: dict[str, Any] = {}
        if isinstance(data, dict):
            data = dict(data)
            if "workload" in data or Settings.grouped(data):
                workload = data.pop("workload", None) or {}
            else:  # flat: the cost model's keys beside train's
                workload = {k: data.pop(k) for k in ("cores", "unique_fraction") if k in data}
        settings = Settings.from_dict(data)
        w = Workload.from_dict(workload)
        if settings.run.batch_size is not None:
            w = Workload.from_dict({**workload, "batch_size": settings.run.batch_size})
    except (yaml.YAMLError, ValueError, TypeError) as e:
        raise UsageError(f"--settings {path}: not the run.yaml of hetps tune: {e}") from None
    return settings, w


def _option_text(value: Any) -> Any:
    """A record's value as the command line gives it (counts as TYPE=N,...)."""
    if isinstance(value, dict):
        return ",".join(f"{t}={n}" for t, n in value.items())
    return value


def resolve_run_options(args: argparse.Namespace) -> None:
    """Fill each run option not given as a flag (None): from --settings FILE (its records, by train's
    flat names: `runtime.driver.settings.FLAT`), else the command's default."""
    fallback = asdict(args.run_defaults)
    if getattr(args, "settings", None):
        settings, workload = load_settings(args.settings)
        given = {k: _option_text(v) for k, v in settings.flat().items() if v is not None and v != {}}
        fallback.update(given, cores=workload.cores)
    for name, value in fallback.items():
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, value)


def settings_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--settings",
        metavar="RUN_YAML",
        help=f"{what}trainers, servers, mode, micro-batches and batch size from this run.yaml "
        "(written by hetps tune); flags given override it",
    )
