"""`TableSpec`: one parameter-server table, as the transpiler records it in its Plan.

`insert_ps` makes the specs, `Plan` keeps them (`plan.tables`) and writes them into `plan.json`
(`to_dict`: the same keys, in the same order, as the plain dicts of plans saved before this record
existed, so old plan files load and new ones read the same), and the runtime reads them: the
parameter-server tables (`runtime.ps.make_table`, which checks the values), the trainers, the cost
model. A spec crosses a process boundary (a trainer's spec, a server's start-up, a server's reply
to a client) as `to_dict()` and comes back with `from_dict`.

Fields:
- `name`; `kind`: "dense" | "sparse"; `shape`: the parameter's shape, [vocab or -1, dim] for a
  sparse table; `dtype`: a float dtype name.
- `initializer`: a spec dict of `ops_registry.initializers`, None when the value comes from
  elsewhere (imported weights: the plan's `params.npz`).
- `optimizer`: None (a frozen table) or an `OptimizerSpec` (made by `transpiler.passes.insert_ps.
  optimizer_spec`): `type` ("sgd" | "adagrad" | "adam" | "adamw"), `hyper` (lr and the other
  hyper-parameters and rules, as the update op's attrs) and `state` ({slot: `StateSpec`(out, shape,
  init)}; None in a spec made by hand: the server starts the slots at the registry's values). Its
  plain form is {"type", hyper-parameters..., "state": {slot: {"out", "shape", "init"}}}; a dict
  given as `optimizer` is read with `OptimizerSpec.from_dict`. Slots and rules:
  `ops_registry.optimizer`.
- `sharding`: a `Sharding`: by "table" (dense: the whole table on shard `shard`, balanced by
  bytes) or by "id_hash" (sparse: rows spread by id, `shard` None), for `num_shards` servers;
  plain form {"by", "shard", "num_shards"} ("shard" only by table; a dict is read with
  `Sharding.from_dict`). None for a spec made by hand (the servers then balance dense tables
  themselves, `runtime.ps.sharding.place_dense`).
- `entry`, `evict_after`: feature admission and eviction of a streaming sparse table
  (`runtime.ps.entry`); None: every id is admitted, nothing is evicted.
- `storage`: where a sparse table's rows live: None / "memory" (numpy arrays in RAM) or "disk"
  (RocksDB under a RAM tier of hot rows, `runtime.ps.tiered`), with `memory_budget` (bytes, or a
  string such as "4GiB") bounding the RAM tier; `tier_policy` ("lfu", the default: LFU with aging,
  or "lru") and `tier_age_every` (requests between halvings of the hit counts, default 256) choose
  which resident rows the RAM tier evicts (docs/tables.md).
- `delta_every`: K > 1: a sparse table's checkpoints form chains of a full save and K - 1 saves of
  only the rows changed since the save before (`runtime.ps.delta`); None / 1: every save is full.
- `lifecycle`: a sparse table's feature lifecycle by passes unseen and by show/click (`ttl_passes`,
  `decay`, `nonclk_coeff`, `click_coeff`, `delete_threshold`: `runtime.ps.lifecycle`, Paddle's
  CtrCommonAccessor); None: rows live until admission / eviction (`entry`, `evict_after`) drop them.
- `clip_norm`: the table's gradient is clipped by the global norm of the step's gradients of every
  table with a `clip_norm` (Paddle's ClipGradByGlobalNorm; sync servers, `runtime.ps.clip`);
  None: not clipped.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ops_registry.errors import ConfigError

# Left out of `to_dict` when None (plan files before TableSpec had these keys only when set).
STORAGES = (None, "memory", "disk")  # None: "memory"
_OMITTED_WHEN_NONE = (
    "sharding",
    "entry",
    "evict_after",
    "clip_norm",
    "storage",
    "memory_budget",
    "tier_policy",
    "tier_age_every",
    "delta_every",
    "lifecycle",
)


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state slot of a table: updated into the op's `out` slot, of `shape` ([1] for
    scalar state), starting at `init`."""

    out: str
    shape: list[int]
    init: float


@dataclass(frozen=True)
class OptimizerSpec:
    """A table's server-side optimizer (see the module docstring)."""

    type: str
    hyper: dict[str, Any] = field(default_factory=dict)
    state: dict[str, StateSpec] | None = None

    def to_dict(self) -> dict[str, Any]:
        """{"type", hyper-parameters..., "state"} ("state" only when set), as plan files hold it."""
        d = {"type": self.type, **self.hyper}
        if self.state is not None:
            d["state"] = {k: {"out": s.out, "shape": s.shape, "init": s.init} for k, s in self.state.items()}
        return d

    @classmethod
    def from_dict(cls, d: Any) -> OptimizerSpec:
        """The spec of `to_dict`; a ValueError names what is missing or malformed."""
        if not isinstance(d, dict) or not isinstance(d.get("type"), str):
            raise ConfigError(
                f"an optimizer spec must be a mapping with a 'type' (e.g. {{'type': 'sgd', "
                f"'lr': 0.1}}), got {d!r}"
            )
        state = d.get("state")
        if state is not None:
            if not isinstance(state, dict):
                raise ConfigError(
                    f"optimizer {d['type']!r}: 'state' must map slot -> {{out, shape, init}}, got {state!r}"
                )
            state = {k: _state_spec(d["type"], k, v) for k, v in state.items()}
        return cls(d["type"], {k: v for k, v in d.items() if k not in ("type", "state")}, state)


def _state_spec(type: str, slot: str, d: Any) -> StateSpec:
    want = [f.name for f in fields(StateSpec)]
    if not isinstance(d, dict) or sorted(d) != sorted(want):
        raise ConfigError(
            f"optimizer {type!r}: state slot {slot!r} must have exactly the keys {want}, got {d!r}"
        )
    return StateSpec(**d)


@dataclass(frozen=True)
class Sharding:
    """Where a table's rows live (see the module docstring)."""

    by: str
    num_shards: int
    shard: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """{"by", "shard", "num_shards"} ("shard" only when set), as plan files hold it."""
        shard = {} if self.shard is None else {"shard": self.shard}
        return {"by": self.by, **shard, "num_shards": self.num_shards}

    @classmethod
    def from_dict(cls, d: Any) -> Sharding:
        """The sharding of `to_dict`; a ValueError names what is missing or unknown."""
        keys = {"by", "shard", "num_shards"}
        if not isinstance(d, dict) or not {"by", "num_shards"} <= set(d) or not set(d) <= keys:
            raise ConfigError(
                f"a sharding must be a mapping with 'by', 'num_shards' and optionally 'shard', got {d!r}"
            )
        return cls(d["by"], d["num_shards"], d.get("shard"))


@dataclass(frozen=True)
class TableSpec:
    """One parameter-server table (see the module docstring for each field)."""

    name: str
    kind: str
    shape: list[int]
    dtype: str = "float32"
    initializer: dict[str, Any] | None = None
    optimizer: OptimizerSpec | None = None
    sharding: Sharding | None = None
    entry: dict[str, Any] | None = None
    evict_after: int | None = None
    clip_norm: float | None = None
    storage: str | None = None
    memory_budget: int | str | None = None
    tier_policy: str | None = None
    tier_age_every: int | None = None
    delta_every: int | None = None
    lifecycle: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise ConfigError(f"table spec {self.name!r}: storage {self.storage!r} must be one of {STORAGES}")
        for name, record in (("optimizer", OptimizerSpec), ("sharding", Sharding)):
            if isinstance(getattr(self, name), dict):
                try:
                    object.__setattr__(self, name, record.from_dict(getattr(self, name)))
                except ValueError as e:
                    raise ConfigError(f"table spec {self.name!r}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain JSON data, keys in field order; `sharding`, `entry`, `evict_after`,
        `clip_norm`, `storage`, `memory_budget`, the tier's, `delta_every` and `lifecycle` only
        when set."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("optimizer", "sharding"):
            if d[name] is not None:
                d[name] = d[name].to_dict()
        return {k: v for k, v in d.items() if v is not None or k not in _OMITTED_WHEN_NONE}

    @classmethod
    def from_dict(cls, d: Any) -> TableSpec:
        """The spec of `to_dict`; a ValueError names the table and its missing or unknown keys."""
        if not isinstance(d, dict):
            raise ConfigError(
                f"a table spec must be a mapping of TableSpec keys, got {type(d).__name__} {d!r}"
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in d]
        if unknown or missing:
            what = "; ".join(
                p
                for p in (
                    f"unknown keys {unknown}" if unknown else "",
                    f"missing keys {missing}" if missing else "",
                )
                if p
            )
            raise ConfigError(
                f"table spec {d.get('name', '?')!r}: {what}; a table spec has the keys {known} "
                f"(required: {[f.name for f in fields(cls) if f.default is MISSING]})"
            )
        return cls(**d)


def tables_from_dicts(specs: list[Any]) -> list[TableSpec]:
    """`TableSpec.from_dict` of each entry (a plan file's or a process message's "tables")."""
    if not isinstance(specs, list):
        raise ConfigError(f"'tables' must be a list of table specs, got {type(specs).__name__}")
    return [TableSpec.from_dict(s) for s in specs]


def tables_to_dicts(specs: list[TableSpec]) -> list[dict[str, Any]]:
    """`to_dict` of each spec, for a file or another process."""
    return [s.to_dict() for s in specs]
