"""The records a run is made of: `RunSettings` (what `train` was asked, checked once) and
`TrainerSpec` (what one trainer process is told).

`RunSettings.make` turns `train`'s keyword arguments and the plan into one checked record before any
process starts; the driver reads nothing else. A `TrainerSpec` is built by the driver for each
trainer and crosses the process boundary as plain data (`to_dict` / `from_dict`): the engine hands
it to the child with the rest of the entry point's arguments (the local engine through a file only
the driver's user can read in its private run directory, Ray through its own object store between
processes of one cluster) — never over the run's ZeroMQ channels, which carry no pickles.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from runtime.data import sources
from runtime.exec.device import array_module
from runtime.exec.executor import check_feed
from transpiler.config import default_micro_batches
from transpiler.passes.held import held_dense
from transpiler.plan import Plan
from transpiler.tables import TableSpec, tables_from_dicts, tables_to_dicts

DEFAULT_COUNTS = {"cpu": 2, "gpu": 1}  # trainers per type when `trainers=` is not given (1 for others)


@dataclass(frozen=True)
class RunSettings:
    """What a run trains and how, checked (see `train` for each argument's meaning)."""

    data: Any
    counts: dict[str, int]  # trainers per type
    reader: str  # the trainer type that owns the data ops
    mode: str
    servers: int
    micro_batches: int
    steps: int | None
    epochs: int | None
    until_loss: float | None
    batch_size: int | None
    device_map: dict[str, str] | None
    allow_emulation: bool
    stall_timeout: float
    loss_reduction: str  # "mean" or "sum": how the loss of a global batch is made of its items'
    pushes: dict[str, int]  # per table: trainers that push it each step
    return_params: bool = False
    held: dict[str, str] = field(default_factory=dict)  # dense table -> the trainer type holding it
    kernel_threads: dict[str, int] = field(default_factory=dict)  # per type, if not 1 (ops_registry.parallel)

    @classmethod
    def make(
        cls,
        plan: Plan,
        data: Any,
        *,
        steps: int | None = None,
        epochs: int | None = None,
        until_loss: float | None = None,
        batch_size: int | None = None,
        trainers: dict[str, int] | None = None,
        servers: int | None = None,
        mode: str | None = None,
        micro_batches: int | None = None,
        device_map: dict[str, str] | None = None,
        allow_emulation: bool = False,
        stall_timeout: float = 60.0,
        return_params: bool = False,
        dense_on_trainer: bool = True,
        kernel_threads: dict[str, int] | None = None,
    ) -> RunSettings:
        """Check `train`'s arguments against `plan` (ValueError / TypeError saying what to change)."""
        _check_ends(steps, epochs, until_loss, micro_batches)
        sources.check_source(data, batch_size, epochs)
        if not plan.loss_name:
            raise ValueError("the plan has no loss: train needs a program with a loss (minimize(loss))")
        reader = plan.reader
        counts = _trainer_counts(plan.trainer_types, trainers)
        micro_batches = micro_batches or default_micro_batches(counts, reader)
        for t in counts:  # refuses a gpu type without CUDA (unless emulated) before anything starts
            array_module(t, device_map, allow_emulation)
        mode = mode or plan.config.mode
        if mode not in ("sync", "async"):
            raise ValueError(f"mode {mode!r}: the runtime trains in 'sync' or 'async' mode")
        clipped = sorted(t.name for t in plan.tables if t.clip_norm is not None)
        if clipped and mode != "sync":
            raise ValueError(
                f"the plan clips gradients by global norm (tables {clipped}), which needs every gradient "
                f"of a step, and {mode} mode has no such step (each push is applied on arrival): "
                "train with mode='sync', or drop grad_clip_norm (ClipGradByGlobalNorm)"
            )
        return cls(
            data,
            counts,
            reader,
            mode,
            servers or plan.config.num_servers,
            micro_batches,
            steps,
            epochs,
            until_loss,
            batch_size,
            device_map,
            allow_emulation,
            stall_timeout,
            plan.loss_reduction,
            plan.pushes(counts),
            return_params,
            held_dense(plan.programs, plan.tables, counts) if dense_on_trainer else {},
            _kernel_threads(kernel_threads or {}, counts),
        )

    def trainer_names(self) -> list[str]:
        """Every trainer process of the run: "cpu:0", "cpu:1", "gpu:0", ..."""
        return [f"{t}:{i}" for t, n in self.counts.items() for i in range(n)]

    def checkpoint_settings(self) -> dict[str, Any]:
        """The settings a checkpoint records (runtime/lifecycle.py)."""
        return {
            "mode": self.mode,
            "batch_size": self.batch_size,
            "micro_batches": self.micro_batches,
            "trainers": self.counts,
            "servers": self.servers,
        }


def _check_ends(steps: Any, epochs: Any, until_loss: Any, micro_batches: Any) -> None:
    if steps is None and epochs is None and until_loss is None:
        raise ValueError("train needs an end condition: steps=, epochs= or until_loss=")
    for what, v in (("steps", steps), ("epochs", epochs), ("micro_batches", micro_batches)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{what} must be a positive int, got {v!r}")


def _kernel_threads(threads: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    """`train`'s kernel_threads, checked against the run's trainer types."""
    for t, n in threads.items():
        if t not in counts:
            raise ValueError(f"kernel_threads names trainer type {t!r}; the run's types are {sorted(counts)}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"kernel_threads[{t!r}] must be a positive int, got {n!r}")
    return dict(threads)


def _trainer_counts(types: list[str], trainers: dict[str, int] | None) -> dict[str, int]:
    if trainers is None:
        return {t: DEFAULT_COUNTS.get(t, 1) for t in types}
    counts = dict(trainers)
    if set(counts) != set(types):
        raise ValueError(
            f"trainers={trainers} must give a count for exactly the plan's trainer types {types}"
        )
    bad = {t: n for t, n in counts.items() if not isinstance(n, int) or n < 1}
    if bad:
        raise ValueError(f"trainer counts must be positive ints, got {bad}")
    return counts


def check_first_batch(plan: Plan, settings: RunSettings) -> None:
    """Check the data's first global batch against the feeds of the plan, before any process
    starts: a wrong feed is named with the shape the user made (a trainer sees micro-batches).
    Sharded file sources are checked by `sources.prepare` (each reader reads only its share)."""
    if sources.is_sharded(settings.data):
        return
    batches = sources.global_batches(settings.data, settings.batch_size, settings.epochs)
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
        raise ValueError(
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
    """Everything one trainer process needs; built by the driver (`train`), read by `Trainer`."""

    name: str  # "cpu:0"
    type: str
    index: int
    program: str  # the trainer type's sub-program, as JSON
    reader: str
    counts: dict[str, int]
    endpoints: dict[str, str]  # trainer name -> its inbox
    driver: str  # the driver's inbox
    ps: list[str]  # the servers' addresses, by shard
    mode: str
    micro_batches: int
    tables: list[TableSpec]
    loss: str
    loss_reduction: str
    secret: bytes | None
    device_map: dict[str, str] | None
    allow_emulation: bool
    stall_timeout: float
    data: Any  # the data source (readers only; None for the others)
    batch_size: int | None
    steps: int | None
    epochs: int | None
    trace: bool = False
    start: int = 0  # the run's first step (a resumed run starts later)
    grant: int | None = None  # readers may start steps < grant (None: no limit from the driver)
    held: list[str] = field(default_factory=list)  # the dense tables this trainer holds (ps/hold.py)
    report_s: float = 0.0  # how long it may keep its step reports to the driver (runtime/reports.py)
    kernel_threads: int = 1  # threads for its large matrix products (ops_registry.parallel)

    @property
    def is_reader(self) -> bool:
        return self.type == self.reader

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data (the tables as `TableSpec.to_dict`s; the data source as it is)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**d, "tables": tables_to_dicts(self.tables)}

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
        return replace(spec, tables=tables_from_dicts(spec.tables))
