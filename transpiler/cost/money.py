"""What a setting costs and what the tuner optimizes (`hetps tune --prices`; the throughput it is paid
for comes from transpiler/cost/model.py, so both figures have one source).

A setting uses `cpu` cores (a core per cpu trainer and per PS shard, as `Budget` counts them) and
`gpu` devices (one per gpu trainer). Priced per core-hour and per device-hour (`Prices(cpu=, gpu=)`),
or by machine types (`MachineType`: cores, GPUs, $ per hour): the setting then rents the cheapest
count of one type that holds it.

Objectives (`Objective.kind`): "speed" (most examples/s), "per_dollar" (most examples per $),
"target" (the cheapest $ per hour reaching `target` examples/s; equal prices: the faster),
"budget" (most examples/s at most `max_hourly` $ per hour).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transpiler.config import kind_of
from transpiler.settings import ScaleConfig

OBJECTIVES = ("speed", "per_dollar", "target", "budget")


@dataclass(frozen=True)
class MachineType:
    """A machine one can rent: `cpu` cores, `gpu` GPUs, `hourly` $ per hour."""

    name: str
    cpu: int
    gpu: int = 0
    hourly: float = 0.0

    def __post_init__(self) -> None:
        if self.cpu < 1 or self.gpu < 0 or not self.hourly > 0:
            raise ValueError(
                f"machine type {self.name!r}: expected cpu >= 1 cores, gpu >= 0 and hourly > 0 $, got "
                f"cpu={self.cpu!r}, gpu={self.gpu!r}, hourly={self.hourly!r}"
            )


@dataclass(frozen=True)
class Prices:
    """$ per core-hour (`cpu`) and per device-hour (`gpu`), or a list of `machines` to rent."""

    cpu: float = 0.0
    gpu: float = 0.0
    machines: tuple[MachineType, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.cpu < 0 or self.gpu < 0:
            raise ValueError(f"prices must be >= 0 $ per hour, got cpu={self.cpu!r}, gpu={self.gpu!r}")
        if not self.machines and self.cpu == 0 and self.gpu == 0:
            raise ValueError("no prices: give cpu=$/core-hour and/or gpu=$/device-hour, or machine types")

    @classmethod
    def parse(cls, text: str) -> Prices:
        """'cpu=0.048,gpu=2.50' ($ per core-hour, per device-hour), or a YAML file's path."""
        if Path(text).is_file():
            return cls.load(text)
        got: dict[str, float] = {}
        for part in filter(None, text.split(",")):
            name, eq, value = part.partition("=")
            try:
                if not eq or name.strip() not in ("cpu", "gpu"):
                    raise ValueError
                got[name.strip()] = float(value)
            except ValueError:
                raise ValueError(
                    f"prices {text!r}: expected cpu=$,gpu=$ (per core-hour, per device-hour), e.g. "
                    "cpu=0.048,gpu=2.50, or a YAML file of machine types"
                ) from None
        return cls(**got)

    @classmethod
    def load(cls, path: str | Path) -> Prices:
        """A YAML price list: `cpu:` / `gpu:` per hour, and/or `machines: {name: {cpu, gpu, hourly}}`."""
        import yaml

        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict) or not set(data) <= {"cpu", "gpu", "machines"}:
            raise ValueError(
                f"{path}: expected a mapping with cpu: / gpu: ($ per hour) and/or machines: "
                "{name: {cpu: cores, gpu: devices, hourly: $}}"
            )
        machines = data.get("machines") or {}
        try:
            types = tuple(MachineType(str(n), **m) for n, m in machines.items())
        except TypeError as e:
            raise ValueError(f"{path}: a machine type takes cpu, gpu and hourly ({e})") from None
        return cls(float(data.get("cpu", 0.0)), float(data.get("gpu", 0.0)), types)

    def hourly(self, cpu: int, gpu: int) -> tuple[float, str]:
        """$ per hour of `cpu` cores and `gpu` GPUs, and what is rented for it."""
        if not self.machines:
            rented = f"{cpu} core(s) x ${self.cpu:g} + {gpu} GPU(s) x ${self.gpu:g}"
            return cpu * self.cpu + gpu * self.gpu, rented
        best: tuple[float, str] | None = None
        for m in self.machines:
            if gpu and not m.gpu:
                continue
            n = max(math.ceil(cpu / m.cpu), math.ceil(gpu / m.gpu) if gpu else 0, 1)
            if best is None or n * m.hourly < best[0]:
                best = (n * m.hourly, f"{n} x {m.name} ({m.cpu} cores, {m.gpu} GPU(s), ${m.hourly:g}/h)")
        if best is None:
            raise ValueError(f"no machine type of {[m.name for m in self.machines]} has a GPU; {gpu} needed")
        return best


def dollars(x: float) -> str:
    """An amount of $ to 3 significant digits (cents from $1 up)."""
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}" if x >= 1e-4 else f"{x:.2e}"


def resources(scale: ScaleConfig, device_map: dict[str, str] | None = None) -> tuple[int, int]:
    """(cores, GPUs) a resolved setting uses: a core per cpu trainer and per shard, a GPU per gpu
    trainer."""
    trainers = scale.trainers or {}
    gpu = sum(n for t, n in trainers.items() if kind_of(t, device_map or scale.device_map) == "gpu")
    return sum(trainers.values()) - gpu + (scale.servers or 0), gpu


@dataclass(frozen=True)
class Costing:
    """A prediction's money: $ per hour, $ per million examples, $ per epoch of `epoch` examples."""

    hourly: float
    rented: str
    examples_per_s: float
    epoch: int

    @property
    def per_million(self) -> float:
        return self.hourly / 3600 / self.examples_per_s * 1e6

    @property
    def per_epoch(self) -> float:
        return self.hourly / 3600 * self.epoch / self.examples_per_s

    @property
    def epoch_hours(self) -> float:
        return self.epoch / self.examples_per_s / 3600


@dataclass(frozen=True)
class Objective:
    """What the tuner maximizes: `kind` of OBJECTIVES; `target` examples/s, `max_hourly` $ per hour;
    `epoch`: examples per epoch, for the $ per epoch printed."""

    kind: str = "speed"
    prices: Prices | None = None
    target: float | None = None
    max_hourly: float | None = None
    epoch: int = 100_000_000

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise ValueError(f"objective {self.kind!r}: expected one of {OBJECTIVES}")
        if self.kind != "speed" and self.prices is None:
            raise ValueError(f"the {self.kind!r} objective needs prices (--prices cpu=$,gpu=$)")
        if self.kind == "target" and not (self.target and self.target > 0):
            raise ValueError(f"the 'target' objective needs target > 0 examples/s, got {self.target!r}")
        if self.kind == "budget" and not (self.max_hourly and self.max_hourly > 0):
            raise ValueError(f"the 'budget' objective needs max_hourly > 0 $, got {self.max_hourly!r}")

    def costing(self, pred: Any) -> Costing | None:
        """The money of a prediction (None without prices)."""
        if self.prices is None:
            return None
        hourly, rented = self.prices.hourly(*resources(pred.scale))
        return Costing(hourly, rented, pred.examples_per_s, self.epoch)

    def feasible(self, pred: Any) -> bool:
        if self.kind == "target":
            return pred.examples_per_s >= self.target
        if self.kind == "budget":
            return self.costing(pred).hourly <= self.max_hourly * (1 + 1e-12)
        return True

    def score(self, pred: Any) -> float:
        """Higher is better (among feasible settings)."""
        if self.kind == "per_dollar":
            hourly = self.costing(pred).hourly
            return math.inf if hourly == 0 else pred.examples_per_s * 3600 / hourly
        if self.kind == "target":
            return -self.costing(pred).hourly
        return pred.examples_per_s

    def better(self, new: Any, old: Any, margin: float = 0.01) -> bool:
        """`new` beats `old` by more than `margin` (equal cost for "target": by examples/s)."""
        if self.feasible(new) != self.feasible(old):
            return self.feasible(new)
        a, b = self.score(new), self.score(old)
        if self.kind == "target" and math.isclose(a, b, rel_tol=1e-9):
            a, b = new.examples_per_s, old.examples_per_s
        return a > b + margin * abs(b)

    def describe(self) -> str:
        if self.kind == "target":
            return f"the cheapest setting reaching {self.target:,.0f} examples/s"
        if self.kind == "budget":
            return f"the most examples/s at most ${self.max_hourly:g} per hour"
        return "the most examples per $" if self.kind == "per_dollar" else "the most examples/s"
