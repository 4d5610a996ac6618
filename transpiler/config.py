"""TranspileConfig: what the user decides about a transpile (a dataclass, loadable from YAML or JSON).

# plan.yaml
trainer_types: [cpu, gpu]
category_map: {io: cpu, sparse: cpu, dense: gpu, loss: gpu}
op_type_devices: {sigmoid_cross_entropy_with_logits: cpu}   # by op type
name_devices: {"gemm_2*": cpu}                                 # by output var name (glob)
sparse_tables: null                                            # null = every embedding table
mode: sync
optimizer: {type: adam, lr: 0.01}                              # for programs without optimize ops
num_servers: 1
"""

from __future__ import annotations

import json
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ops_registry.errors import ConfigError
from ops_registry.optimizer import STATE, check_schedule

MODES = ("sync", "async")  # parameter-server modes, read by the runtime
KINDS = ("cpu", "gpu")  # device kinds of trainer types


def check_mode(mode: Any, what: str = "mode") -> str:
    """`mode` if it is a parameter-server mode (MODES), else a ValueError naming `what`."""
    if mode not in MODES:
        raise ConfigError(f"{what} {mode!r}: expected 'sync' or 'async' (the parameter-server modes)")
    return mode


def items_in_flight(mode: str, micro_batches: int) -> int:
    """The most items (micro-batches) a reader trainer has in flight: its step's `micro_batches`; in
    async mode also the next step's, so it looks up step t+1 while the other types compute step t
    (the next step cannot start before the previous one is applied in sync mode). The runtime's
    scheduler and the cost model both read it here."""
    return micro_batches * (2 if mode == "async" else 1)


def default_micro_batches(counts: dict[str, int], reader: str) -> int:
    """`train`'s micro-batches per reader and step when none are given: the fewest that give every
    trainer of the other types an item each step (items go round robin over them): 1 unless another
    type has more trainers than there are readers. More only add messages and smaller kernels: on
    the CTR benchmark 1 was the fastest in every setting measured (benchmarks/README.md, tune.py)."""
    readers = counts[reader]
    return max([1, *(-(-n // readers) for t, n in counts.items() if t != reader)])


OPTIMIZERS = tuple(STATE)  # the update ops ops_registry.optimizer defines


_OMITTED_AT_DEFAULT = {"unbounded": False, "checkpoint_delta_every": None, "lifecycle": None}


@dataclass
class TranspileConfig:
    """Placement and parameter-server choices.

    - `trainer_types`: the kinds of trainer processes (sub-programs are made for those that get ops).
    - `category_map`: registry category -> trainer type. Categories absent from it (by default
      `light`: activations, reshape/concat, gathers, reductions, `sum`) are placed where fewer
      bytes cross. The old name of `light`, `elementwise`, is still read (with a DeprecationWarning).
    - `op_type_devices` / `name_devices`: overrides by op type, or by an fnmatch pattern on any of a
      forward op's output var names (names win over types). An explicit `op_device` on the op
      (e.g. Paddle's `device_guard`) wins over both.
    - `sparse_tables`: parameter names served as sparse tables (pull/push of rows); None = every
      parameter marked `is_sparse` (the builder's embedding tables) whose every use is a lookup.
    - `mode`: parameter-server mode, `sync` | `async` (read by the runtime). GEO-SGD is not offered
      to training: the trainers do not run it (only the PS-level `runtime.ps.GeoTable` exists).
    - `optimizer`: the table optimizer for programs that carry no optimize ops (e.g. ONNX imports).
    - `num_servers`: parameter-server shards the plan's sharding info is computed for.
    - `sparse_entry`, `evict_after`: feature admission ({"type": "count", "threshold": k} or
      {"type": "probability", "p": p, "seed": s}) and eviction of rows untouched for T pushes, for
      every sparse table (runtime/ps/entry.py; checked when the servers start).
    - `unbounded`: True (every sparse table) or a list of sparse table names whose vocabulary is
      unbounded: their spec's shape is [-1, dim] (the program's vocab sizes nothing), any 64-bit id
      is a row, created on first use from the deterministic per-id initializer (for a data schema's
      `hash64` ids; `docs/tables.md`).
    - `checkpoint_delta_every`: K > 1: each sparse table's checkpoints are a full save every K saves
      and, between, saves of only the rows changed since the save before (runtime/ps/delta.py).
    - `lifecycle`: every sparse table's feature lifecycle ({"ttl_passes": N, "decay": 0.98,
      "delete_threshold": 0.8, ...}: runtime/ps/lifecycle.py; checked when the servers start).
    """

    trainer_types: list[str] = field(default_factory=lambda: ["cpu", "gpu"])
    category_map: dict[str, str] = field(
        default_factory=lambda: {"io": "cpu", "sparse": "cpu", "dense": "gpu", "loss": "gpu"}
    )
    op_type_devices: dict[str, str] = field(default_factory=dict)
    name_devices: dict[str, str] = field(default_factory=dict)
    sparse_tables: list[str] | None = None
    mode: str = "sync"
    optimizer: dict[str, Any] = field(default_factory=lambda: {"type": "adam", "lr": 0.01})  # see docs/cli.md
    num_servers: int = 1
    sparse_entry: dict[str, Any] | None = None
    evict_after: int | None = None
    unbounded: bool | list[str] = False
    checkpoint_delta_every: int | None = None
    lifecycle: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.trainer_types = list(self.trainer_types)
        if "elementwise" in self.category_map:
            warnings.warn(
                "TranspileConfig.category_map: the category 'elementwise' is now called "
                "'light' (it covers reshape, concat, gather and reductions too); rename the key",
                DeprecationWarning,
                stacklevel=3,
            )
            self.category_map = {
                ("light" if k == "elementwise" else k): v for k, v in self.category_map.items()
            }
        if not self.trainer_types:
            raise ConfigError("TranspileConfig.trainer_types is empty; name at least one trainer type")
        if "ps" in self.trainer_types:
            raise ConfigError("'ps' is reserved for the parameter server; pick another trainer type name")
        for what, mapping in (
            ("category_map", self.category_map),
            ("op_type_devices", self.op_type_devices),
            ("name_devices", self.name_devices),
        ):
            for key, dev in mapping.items():
                if dev not in self.trainer_types:
                    raise ConfigError(
                        f"TranspileConfig.{what}[{key!r}] = {dev!r} is not a trainer type; "
                        f"trainer_types = {self.trainer_types}"
                    )
        if self.mode == "geo":
            raise ConfigError(
                "TranspileConfig.mode 'geo' is not supported: hetps's trainers do not run "
                "GEO-SGD (local steps + delta pushes); use mode 'sync' (single-process "
                "results) or 'async'"
            )
        check_mode(self.mode, "TranspileConfig.mode")
        if self.optimizer.get("type") not in OPTIMIZERS:
            raise ConfigError(
                f"TranspileConfig.optimizer type {self.optimizer.get('type')!r} is not one of {OPTIMIZERS}"
            )
        try:
            check_schedule(self.optimizer.get("lr_schedule"))
        except ValueError as e:
            raise ConfigError(f"TranspileConfig.optimizer: {e}") from None
        if self.num_servers < 1:
            raise ConfigError(f"TranspileConfig.num_servers must be >= 1, got {self.num_servers}")
        if not isinstance(self.unbounded, bool) and not (
            isinstance(self.unbounded, (list, tuple)) and all(isinstance(n, str) for n in self.unbounded)
        ):
            raise ConfigError(
                "TranspileConfig.unbounded must be True/False or a list of table names, got "
                f"{self.unbounded!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data; the table-scale fields only when set (plan files saved before
        they existed save back byte for byte)."""
        d = asdict(self)
        for key, default in _OMITTED_AT_DEFAULT.items():
            if d[key] == default:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TranspileConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown TranspileConfig keys {unknown}; valid keys: {sorted(known)}")
        for f in fields(cls):  # a value of the wrong type is named by its key, not by a later comparison
            default = f.default_factory() if callable(f.default_factory) else f.default
            v = d.get(f.name)
            if v is None or default is None or default is MISSING:
                continue
            if isinstance(v, bool) != isinstance(default, bool) or not isinstance(v, type(default)):
                raise ConfigError(
                    f"TranspileConfig key {f.name!r}: expected {type(default).__name__} "
                    f"(like {default!r}), got {type(v).__name__} {v!r}"
                )
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> TranspileConfig:
        """From a .yaml/.yml or .json file."""
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path}: expected a mapping of TranspileConfig keys, got {type(data).__name__}"
            )
        return cls.from_dict(data)


def kind_of(trainer_type: str, device_map: dict[str, str] | None = None) -> str:
    """ "cpu" | "gpu": the device kind of a trainer type (default: a type named "gpu*" is a GPU type)."""
    kind = (device_map or {}).get(trainer_type, "gpu" if trainer_type.startswith("gpu") else "cpu")
    if kind not in KINDS:
        raise ConfigError(f"device_map[{trainer_type!r}] = {kind!r}; expected 'cpu' or 'gpu'")
    return kind
