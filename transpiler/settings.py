"""`ScaleConfig`: what a run puts where (trainer processes per type, shards, micro-batches, mode), the
record the tuner returns (`transpiler.cost.tune`) and `runtime.train(scale=...)` takes as it
is; and the checks every settings record shares (`runtime/driver/settings.py` holds the others).

A record checks its own values in `__post_init__` (types and ranges, each named as
`Record.field`); what depends on a plan (the trainer types, the plan's default servers and mode)
is checked and filled in by `ScaleConfig.resolved(plan)`, the one place train and the cost model
share.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ops_registry.errors import ConfigError
from transpiler.config import check_mode, default_micro_batches, kind_of

DEFAULT_COUNTS = {"cpu": 2, "gpu": 1}  # trainers per type when none are given (1 for other types)


def check_positive(value: Any, what: str, *, optional: bool = False) -> None:
    """A ValueError naming `what` unless `value` is a positive int (or None, if `optional`)."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")


def check_counts(counts: Any, what: str) -> None:
    """A ValueError naming `what` unless `counts` maps names to positive ints."""
    if not isinstance(counts, dict):
        raise ConfigError(f"{what} must map trainer types to counts, e.g. {{'cpu': 2}}, got {counts!r}")
    for t, n in counts.items():
        check_positive(n, f"{what}[{t!r}]")


def check_bool(value: Any, what: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{what} must be True or False, got {value!r}")


def record_from_dict(cls: type, data: Any) -> Any:
    """`cls(**data)` for a settings record read from a file; ValueError names unknown keys."""
    known = [f.name for f in fields(cls)]
    if not isinstance(data, dict):
        raise ConfigError(f"{cls.__name__}: expected a mapping of any of {known}, got {data!r}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown} of {cls.__name__}: expected any of {known}")
    return cls(**data)


@dataclass(frozen=True)
class ScaleConfig:
    """What runs where. None: decided from the plan by `resolved`.

    - `trainers`: processes per trainer type (None: {"cpu": 2, "gpu": 1}, 1 for other types).
    - `micro_batches`: micro-batches per reader and step (None: the fewest that give every trainer
      an item each step, `transpiler.config.default_micro_batches`).
    - `servers`: parameter-server shards (None: the plan's `config.num_servers`).
    - `mode`: "sync" or "async" (None: the plan's `config.mode`).
    - `dense_on_trainer`: a dense table one trainer process alone uses stays on it
      (`transpiler.passes.held`).
    - `kernel_threads`: threads per trainer process of a type for its large matrix products
      (ops_registry.parallel; types not named: 1).
    - `device_map`: trainer type -> device kind ("cpu" / "gpu"; default: the type's name).
    """

    trainers: dict[str, int] | None = None
    micro_batches: int | None = None
    servers: int | None = None
    mode: str | None = None
    dense_on_trainer: bool = True
    kernel_threads: dict[str, int] = field(default_factory=dict)
    device_map: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.trainers is not None:
            check_counts(self.trainers, "ScaleConfig.trainers")
        check_positive(self.micro_batches, "ScaleConfig.micro_batches", optional=True)
        check_positive(self.servers, "ScaleConfig.servers", optional=True)
        if self.mode is not None:
            check_mode(self.mode, "ScaleConfig.mode")
        check_bool(self.dense_on_trainer, "ScaleConfig.dense_on_trainer")
        check_counts(self.kernel_threads, "ScaleConfig.kernel_threads")
        for t in self.device_map or {}:
            kind_of(t, self.device_map)  # a kind other than "cpu" / "gpu" is named there

    def resolved(self, plan: Any) -> ScaleConfig:
        """This scale with every None filled in for `plan` (a `transpiler.plan.Plan`), checked
        against it: counts for exactly its trainer types, kernel threads of its types only, and a
        plan that clips gradients by global norm trains in sync mode only."""
        types = list(plan.programs)
        if self.trainers is None:
            counts = {t: DEFAULT_COUNTS.get(t, 1) for t in types}
        elif set(self.trainers) != set(types):
            raise ConfigError(
                f"ScaleConfig.trainers {self.trainers} must give a count for exactly the plan's "
                f"trainer types {types}"
            )
        else:
            counts = dict(self.trainers)
        for t in self.kernel_threads:
            if t not in counts:
                raise ConfigError(
                    f"ScaleConfig.kernel_threads names trainer type {t!r}; "
                    f"the run's types are {sorted(counts)}"
                )
        mode = self.mode or plan.config.mode
        clipped = plan.clipped_tables
        if clipped and mode != "sync":
            raise ConfigError(
                f"the plan clips gradients by global norm (tables {clipped}), which needs every gradient "
                f"of a step, and {mode} mode has no such step (each push is applied on arrival): "
                "train with mode='sync', or drop grad_clip_norm (ClipGradByGlobalNorm)"
            )
        readers = plan.reader_types
        mb = self.micro_batches
        if mb is None:
            mb = default_micro_batches(counts, readers[0]) if len(readers) == 1 else 1
        return replace(
            self,
            trainers=counts,
            micro_batches=mb,
            servers=self.servers or plan.config.num_servers,
            mode=mode,
            kernel_threads=dict(self.kernel_threads),
        )

    def trainer_names(self) -> list[str]:
        """Every trainer process: "cpu:0", "cpu:1", "gpu:0", ... (of a resolved scale)."""
        return [f"{t}:{i}" for t, n in (self.trainers or {}).items() for i in range(n)]

    def describe(self) -> str:
        counts = ",".join(f"{t}={n}" for t, n in (self.trainers or {}).items())
        return f"trainers {counts}, {self.micro_batches} micro-batches, {self.servers} server(s), {self.mode}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ScaleConfig:
        """The inverse of `to_dict` (e.g. the `scale:` group of a run.yaml); ValueError names what is
        wrong."""
        return record_from_dict(cls, data)
