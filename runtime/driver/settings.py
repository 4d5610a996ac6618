"""The records a run is made of: what `train` is asked, in groups, and what one trainer process is
told.

The user's settings come in five typed records, each checking its own fields once (`__post_init__`,
errors naming `Record.field`): `ScaleConfig` (what runs where: transpiler/settings.py, the record the
tuner returns), `RunConfig` (how long and how), `CheckpointConfig`, `EvalConfig` and
`TelemetryConfig`. `Settings` holds the five; `Settings.of` maps `train`'s flat keyword arguments
(`steps=`, `trainers=`, `checkpoint_every=`, ...: `FLAT`) onto them, the one place that knows which
record holds which flat name, and `Settings.from_dict` reads a settings file (grouped, or flat as
`hetps tune` wrote it before the groups). `ResolvedRun.make` checks the records against the plan and
the data before any process starts; the driver reads nothing else.

A `TrainerSpec` is built by the driver for each trainer from the resolved records and crosses the
process boundary as plain data (`to_dict` / `from_dict`): the engine hands it to the child with the
rest of the entry point's arguments (the local engine through a file only the driver's user can
read in its private run directory, Ray through its own object store between processes of one
cluster) — never over the run's ZeroMQ channels, which carry no pickles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ops_registry.errors import ConfigError
from runtime.data import sources
from runtime.exec.device import array_module
from runtime.exec.executor import check_feed
from runtime.transport.channels import Links
from transpiler.passes.held import held_dense
from transpiler.plan import Plan
from transpiler.settings import DEFAULT_COUNTS, ScaleConfig, check_bool, check_positive, record_from_dict
from transpiler.tables import TableSpec, tables_from_dicts, tables_to_dicts

__all__ = [
    "DEFAULT_COUNTS",
    "FLAT",
    "CheckpointConfig",
    "EvalConfig",
    "FailureConfig",
    "OnlineConfig",
    "ResolvedRun",
    "RunConfig",
    "ScaleConfig",
    "Settings",
    "TelemetryConfig",
    "TrainerSpec",
    "check_first_batch",
]


def _check_path(value: Any, what: str) -> None:
    if value is not None and not isinstance(value, (str, Path)):
        raise ConfigError(f"{what} must be a path (str or Path) or None, got {value!r}")


def _check_number(value: Any, what: str, *, positive: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (positive and not value > 0):
        raise ConfigError(f"{what} must be a {'positive ' if positive else ''}number, got {value!r}")


@dataclass(frozen=True)
class RunConfig:
    """How long and how a run trains (see `train`). End conditions, whichever comes first: `steps`,
    `epochs` of a finite data source, `until_loss` (the mean loss of the last 10 steps). `ends_pass`:
    the run is one pass of online training (the online loop sets it): at its end, before the final
    save, the servers apply the sparse tables' feature lifecycle (`PSClient.shrink`: decay, TTL,
    score threshold; runtime/ps/lifecycle.py) and `History.removed_rows` counts the rows removed."""

    steps: int | None = None
    epochs: int | None = None
    until_loss: float | None = None
    batch_size: int | None = None  # generated data (`batch(i, n)`): the global batch size
    stall_timeout: float = 60.0  # seconds a process waits for a peer before it gives up
    allow_emulation: bool = False  # a gpu type without CUDA runs CPU kernels (else refused)
    return_params: bool = False  # History.params: the final table values
    device_graphs: bool = True  # a gpu trainer replays its segments' kernels as CUDA graphs (docs/gpu.md)
    ends_pass: bool = False  # a pass end of the feature lifecycle before the final save

    def __post_init__(self) -> None:
        check_positive(self.steps, "RunConfig.steps", optional=True)
        check_positive(self.epochs, "RunConfig.epochs", optional=True)
        _check_number(self.until_loss, "RunConfig.until_loss", optional=True)
        check_positive(self.batch_size, "RunConfig.batch_size", optional=True)
        _check_number(self.stall_timeout, "RunConfig.stall_timeout", positive=True)
        check_bool(self.allow_emulation, "RunConfig.allow_emulation")
        check_bool(self.return_params, "RunConfig.return_params")
        check_bool(self.device_graphs, "RunConfig.device_graphs")
        check_bool(self.ends_pass, "RunConfig.ends_pass")

    def check_end(self) -> None:
        if self.steps is None and self.epochs is None and self.until_loss is None:
            raise ConfigError("train needs an end condition: steps=, epochs= or until_loss= (RunConfig)")


@dataclass(frozen=True)
class CheckpointConfig:
    """`dir`: save a checkpoint `step-NNNNNNNN` there every `every` steps, whenever `every_s`
    seconds have passed since the last save (at the next step the readers have not started yet), and
    at the end, the `keep` newest kept; `resume`: continue from the newest complete checkpoint in this
    directory (or this checkpoint)."""

    dir: str | Path | None = None
    every: int | None = None
    keep: int = 2
    resume: str | Path | None = None
    every_s: float | None = None

    def __post_init__(self) -> None:
        _check_path(self.dir, "CheckpointConfig.dir")
        check_positive(self.every, "CheckpointConfig.every", optional=True)
        check_positive(self.keep, "CheckpointConfig.keep")
        _check_path(self.resume, "CheckpointConfig.resume")
        _check_number(self.every_s, "CheckpointConfig.every_s", positive=True, optional=True)
        for what, flat in (("every", "checkpoint_every=N"), ("every_s", "checkpoint_every_s=S")):
            if getattr(self, what) is not None and self.dir is None:
                raise ConfigError(f"CheckpointConfig.{what} ({flat}) needs a dir (checkpoint=DIR) to save to")


@dataclass(frozen=True)
class EvalConfig:
    """The held-out loss and AUC of `data` (finite: feed dicts) every `every` steps and at the end;
    `output`: the prediction scored (default: the plan's one forward result no op reads); `group`:
    a categorical column (or feed) for "gauc", `slice_by`: one for "slices" (as `evaluate`'s)."""

    data: Any = None
    every: int | None = None
    output: str | None = None
    group: str | None = None
    slice_by: str | None = None

    def __post_init__(self) -> None:
        check_positive(self.every, "EvalConfig.every", optional=True)
        for what, flat in (("group", "eval_group"), ("slice_by", "eval_slice_by")):
            value = getattr(self, what)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"EvalConfig.{what} ({flat}=) must be a column name, got {value!r}")
            if value is not None and self.data is None:
                raise ConfigError(f"EvalConfig.{what} ({flat}=) needs data (eval_data=, the held-out set)")
        if self.every is not None and self.data is None:
            raise ConfigError("EvalConfig.every (eval_every=N) needs data (eval_data=, the held-out set)")


@dataclass(frozen=True)
class TelemetryConfig:
    """What a run reports (runtime.telemetry.outputs): `metrics` (a JSONL file), `trace` (a Chrome
    trace file), `progress` (a tqdm bar; None: when stderr is a terminal), `tensorboard` (a directory
    of event files), `callback(record)` per step."""

    metrics: str | Path | None = None
    trace: str | Path | None = None
    progress: bool | None = None
    tensorboard: str | Path | None = None
    callback: Callable[[dict[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        for what in ("metrics", "trace", "tensorboard"):
            _check_path(getattr(self, what), f"TelemetryConfig.{what}")
        if self.progress is not None:
            check_bool(self.progress, "TelemetryConfig.progress")
        if self.callback is not None and not callable(self.callback):
            raise ConfigError(f"TelemetryConfig.callback must be callable, got {self.callback!r}")


@dataclass(frozen=True)
class OnlineConfig:
    """Training on a stream source (`train(plan, stream, online=...)`, runtime/driver/online.py):
    pass after pass, test-then-train, a checkpoint per pass, then a publish.

    `publish`: the publish directory (None: nothing published; runtime/driver/publish.py has its
    format), a full ONNX model every `full_every` publishes and deltas between, `rows` "all" |
    "existing" as for `export`. The guard before each publish compares the pass's online AUC and
    loss (measured before training on it) with the mean of the `trailing` last accepted passes: an
    AUC lower by more than `auc_drop`, or a loss higher by more than the fraction `loss_rise`, is a
    regression, and `on_regression` says what then happens: "hold" (train on, publish nothing for
    this pass), "rollback" (also drop the pass's training: the next pass starts from the last good
    checkpoint) or "ignore". Changed rows that are NaN / Inf are never published. `max_passes`: stop
    after that many passes (None: when the source ends). `on_stall`: a stalled source ("raise":
    raise `StreamStalled` after reporting it; "wait": report it and keep waiting)."""

    publish: str | Path | None = None
    full_every: int = 4
    rows: str = "all"
    on_regression: str = "hold"
    auc_drop: float = 0.05
    loss_rise: float = 0.25
    trailing: int = 3
    max_passes: int | None = None
    on_stall: str = "raise"

    def __post_init__(self) -> None:
        _check_path(self.publish, "OnlineConfig.publish")
        check_positive(self.full_every, "OnlineConfig.full_every")
        check_positive(self.trailing, "OnlineConfig.trailing")
        check_positive(self.max_passes, "OnlineConfig.max_passes", optional=True)
        _check_number(self.auc_drop, "OnlineConfig.auc_drop")
        _check_number(self.loss_rise, "OnlineConfig.loss_rise")
        for name, allowed in (
            ("rows", ("all", "existing")),
            ("on_regression", ("hold", "rollback", "ignore")),
            ("on_stall", ("raise", "wait")),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"OnlineConfig.{name}={getattr(self, name)!r}: expected one of {allowed}")


@dataclass(frozen=True)
class FailureConfig:
    """What `train` does when a process of the run is lost (runtime/driver/restart.py): up to
    `max_restarts` times it tears the run down, restarts it from its last complete checkpoint (the
    start without one) and goes on to the same end; `min_trainers`: per trainer type, the fewest
    trainers a restart may go on with when the engine cannot place them all again (a lost Ray node;
    None or a type left out: that type's full count, never fewer)."""

    max_restarts: int = 0
    min_trainers: dict[str, int] | None = None

    def __post_init__(self) -> None:
        n = self.max_restarts
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"FailureConfig.max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if self.min_trainers is not None:
            if not isinstance(self.min_trainers, dict):
                raise ConfigError(
                    f"FailureConfig.min_trainers must map trainer types to counts, got {self.min_trainers!r}"
                )
            for t, n in self.min_trainers.items():
                check_positive(n, f"FailureConfig.min_trainers[{t!r}]")


GROUPS: dict[str, type] = {
    "scale": ScaleConfig,
    "run": RunConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "telemetry": TelemetryConfig,
    "failure": FailureConfig,
}

# train()'s flat keyword arguments: name -> (group, field of the group's record)
FLAT: dict[str, tuple[str, str]] = {
    **{n: ("scale", n) for n in ("trainers", "micro_batches", "servers", "mode", "dense_on_trainer")},
    **{n: ("scale", n) for n in ("kernel_threads", "device_map")},
    **{n: ("run", n) for n in ("steps", "epochs", "until_loss", "batch_size", "stall_timeout")},
    **{n: ("run", n) for n in ("allow_emulation", "return_params", "device_graphs")},
    "checkpoint": ("checkpoint", "dir"),
    "checkpoint_every": ("checkpoint", "every"),
    "checkpoint_every_s": ("checkpoint", "every_s"),
    "keep": ("checkpoint", "keep"),
    "resume": ("checkpoint", "resume"),
    "eval_data": ("eval", "data"),
    "eval_every": ("eval", "every"),
    "eval_output": ("eval", "output"),
    "eval_group": ("eval", "group"),
    "eval_slice_by": ("eval", "slice_by"),
    **{n: ("telemetry", n) for n in ("metrics", "trace", "progress", "tensorboard", "callback")},
    **{n: ("failure", n) for n in ("max_restarts", "min_trainers")},
}


@dataclass(frozen=True)
class Settings:
    """A run's settings records (`train`'s `scale=`, `run=`, `checkpoint=`, `eval=`, `telemetry=`,
    `failure=`)."""

    scale: ScaleConfig = field(default_factory=ScaleConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name}= must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")

    @classmethod
    def of(cls, flat: dict[str, Any], **groups: Any) -> Settings:
        """The records of `train(**groups, **flat)`: each flat keyword goes to its record (`FLAT`);
        a flat keyword beside the record that holds it is refused (TypeError), as is an unknown one."""
        unknown = sorted(set(flat) - set(FLAT))
        if unknown:
            raise TypeError(f"train() got unexpected keyword argument(s) {unknown}; known: {sorted(FLAT)}")
        flat = {n: v for n, v in flat.items() if v is not None}  # None: the record's default
        by_group: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            group, attr = FLAT[name]
            by_group.setdefault(group, {})[attr] = value
        records = {}
        for group, cls_ in GROUPS.items():
            given, loose = groups.get(group), by_group.get(group, {})
            if given is not None and loose:
                names = sorted(n for n in flat if FLAT[n][0] == group)
                raise TypeError(
                    f"train() got {group}= and {names}, which {cls_.__name__} holds: give them in the "
                    f"record ({cls_.__name__}(..., {FLAT[names[0]][1]}=...)) or drop {group}="
                )
            records[group] = given if given is not None else cls_(**loose)
        return cls(**records)

    def flat(self) -> dict[str, Any]:
        """`train`'s flat keyword arguments of these records (the inverse of `of`)."""
        return {n: getattr(getattr(self, g), a) for n, (g, a) in FLAT.items()}

    @staticmethod
    def grouped(data: dict[str, Any]) -> bool:
        """Whether a settings mapping is in groups (`scale:`, ...; a flat `checkpoint:` is a path)."""
        return any(k in GROUPS and (k != "checkpoint" or isinstance(v, dict)) for k, v in data.items())

    @classmethod
    def from_dict(cls, data: Any) -> Settings:
        """The records of a settings file: groups (`scale:`, `run:`, ... each a record's fields) or
        flat `train` keywords (`trainers:`, `steps:`, ...); ValueError names what is wrong."""
        if not isinstance(data, dict):
            raise ConfigError(
                "expected a mapping with 'trainers' (e.g. {cpu: 2, gpu: 1}) or the groups "
                f"{sorted(GROUPS)}, got {data!r}"
            )
        if cls.grouped(data):
            unknown = sorted(set(data) - set(GROUPS))
            if unknown:
                raise ConfigError(f"unknown setting group(s) {unknown}: expected any of {sorted(GROUPS)}")
            return cls(**{g: record_from_dict(GROUPS[g], v or {}) for g, v in data.items()})
        unknown = sorted(set(data) - set(FLAT))
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {unknown}: expected any of {sorted(FLAT)} or the groups {sorted(GROUPS)}"
            )
        return cls.of(data)


@dataclass(frozen=True)
class ResolvedRun:
    """A run as the driver runs it: the data, the records (the scale resolved for the plan: every
    count, shard, mode and micro-batch count filled in), and what follows from the plan."""

    data: Any
    scale: ScaleConfig
    run: RunConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    telemetry: TelemetryConfig
    reader: str  # the trainer type that owns the data ops (Plan.reader)
    loss_reduction: str  # "mean" or "sum": how the loss of a global batch is made of its items'
    pushes: dict[str, int]  # per table: trainers that push it each step (Plan.pushes)
    held: dict[str, str] = field(default_factory=dict)  # dense table -> the trainer type holding it
    tasks: tuple[str, ...] = ()  # a multi-task plan's task names (Plan.tasks), each with its own AUC

    @classmethod
    def make(cls, plan: Plan, data: Any, settings: Settings) -> ResolvedRun:
        """Check `settings` against `plan` and `data` (ValueError / TypeError saying what to change)."""
        run = settings.run
        run.check_end()
        sources.check_source(data, run.batch_size, run.epochs)
        if not plan.loss_name:
            raise ConfigError("the plan has no loss: train needs a program with a loss (minimize(loss))")
        reader = plan.reader
        scale = settings.scale.resolved(plan)
        for t in scale.trainers:  # refuses a gpu type without CUDA (unless emulated) before anything starts
            array_module(t, scale.device_map, run.allow_emulation)
        return cls(
            data,
            scale,
            run,
            settings.checkpoint,
            settings.eval,
            settings.telemetry,
            reader,
            plan.loss_reduction,
            plan.pushes(scale.trainers),
            held_dense(plan.programs, plan.tables, scale.trainers) if scale.dense_on_trainer else {},
            tuple(plan.tasks),
        )

    @property
    def counts(self) -> dict[str, int]:
        """Trainers per type."""
        return self.scale.trainers

    @property
    def until_loss(self) -> float | None:
        return self.run.until_loss

    @property
    def stall_timeout(self) -> float:
        return self.run.stall_timeout

    def trainer_names(self) -> list[str]:
        """Every trainer process of the run: "cpu:0", "cpu:1", "gpu:0", ..."""
        return self.scale.trainer_names()

    def checkpoint_settings(self) -> dict[str, Any]:
        """The settings a checkpoint records (runtime/driver/checkpoints.py)."""
        return {
            "mode": self.scale.mode,
            "batch_size": self.run.batch_size,
            "micro_batches": self.scale.micro_batches,
            "trainers": self.scale.trainers,
            "servers": self.scale.servers,
        }


def check_first_batch(plan: Plan, settings: ResolvedRun) -> None:
    """Check the data's first global batch against the feeds of the plan, before any process
    starts: a wrong feed is named with the shape the user made (a trainer sees micro-batches).
    Sharded file sources are checked by `sources.prepare` (each reader reads only its share)."""
    if sources.is_sharded(settings.data):
        return
    batches = sources.global_batches(settings.data, settings.run.batch_size, settings.run.epochs)
    try:
        batch = next(batches, None)
    finally:
        batches.close()
    if batch is None:
        return
    if not isinstance(batch, dict):
        raise TypeError(
            f"the data's first batch is a {type(batch).__name__}; a batch is a dict "
            "{feed name: array with a leading example axis}"
        )
    program = plan.programs[settings.reader]
    feeds = program.attrs.get("feeds", [])
    missing = [n for n in feeds if n not in batch]
    if missing:
        raise ConfigError(
            f"the data's first batch lacks the feeds {missing} the plan reads; it has {sorted(batch)}"
        )
    try:
        sources.batch_size_of({n: batch[n] for n in feeds})
        for n in feeds:
            if n in program.vars:
                check_feed(n, batch[n], program.var(n))
    except (ValueError, TypeError) as e:
        raise type(e)(f"the data's first batch: {e}") from None


@dataclass(frozen=True)
class TrainerSpec:
    """Everything one trainer process needs; built by the driver (`train`) from the resolved
    records, read by `Trainer`."""

    name: str  # "cpu:0"
    type: str
    index: int
    scale: ScaleConfig  # the run's, resolved
    run: RunConfig
    program: str  # the trainer type's sub-program, as JSON
    reader: str
    tables: list[TableSpec]
    loss: str
    loss_reduction: str
    held: list[str]  # the dense tables this trainer holds (ps/hold.py)
    endpoints: dict[str, str]  # trainer name -> its inbox
    driver: str  # the driver's inbox
    ps: list[str]  # the servers' addresses, by shard
    links: Links | None  # its inbox's and outbox's link keys (channels.Links; None: unsigned)
    data: Any  # the data source (readers only; None for the others)
    trace: bool = False
    start: int = 0  # the run's first step (a resumed run starts later)
    grant: int | None = None  # readers may start steps < grant (None: no limit from the driver)
    report_s: float = (
        0.0  # how long it may keep its step reports to the driver (runtime/transport/reports.py)
    )
    ps_key: bytes | None = None  # its own key to the shards (wire.client_key)

    @property
    def is_reader(self) -> bool:
        return self.type == self.reader

    @property
    def counts(self) -> dict[str, int]:
        return self.scale.trainers

    @property
    def mode(self) -> str:
        return self.scale.mode

    @property
    def micro_batches(self) -> int:
        return self.scale.micro_batches

    @property
    def kernel_threads(self) -> int:
        """Threads for its large matrix products (ops_registry.parallel)."""
        return self.scale.kernel_threads.get(self.type, 1)

    @property
    def device_map(self) -> dict[str, str] | None:
        return self.scale.device_map

    @property
    def allow_emulation(self) -> bool:
        return self.run.allow_emulation

    @property
    def device_graphs(self) -> bool:
        return self.run.device_graphs

    @property
    def stall_timeout(self) -> float:
        return self.run.stall_timeout

    @property
    def batch_size(self) -> int | None:
        return self.run.batch_size

    @property
    def steps(self) -> int | None:
        return self.run.steps

    @property
    def epochs(self) -> int | None:
        return self.run.epochs

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data (records and tables as dicts; the data source as it is)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {
            **d,
            "scale": asdict(self.scale),
            "run": asdict(self.run),
            "tables": tables_to_dicts(self.tables),
            "links": None if self.links is None else self.links.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainerSpec:
        """The spec of `to_dict`; a TypeError names missing or unknown keys."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise TypeError(f"a trainer spec with unknown keys {unknown}; known: {sorted(names)}")
        try:
            spec = cls(**d)
        except TypeError as e:
            raise TypeError(f"an incomplete trainer spec: {e}") from None
        return replace(
            spec,
            scale=ScaleConfig(**spec.scale),
            run=RunConfig(**spec.run),
            tables=tables_from_dicts(spec.tables),
            links=Links.of(spec.links),
        )
