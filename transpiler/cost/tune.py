"""The tuner: the best resource setting within a budget, and op moves the cost model predicts faster
(`hetps tune`; the cost model itself is transpiler/cost/model.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ops_registry import get_op
from transpiler.config import TranspileConfig, check_mode, kind_of
from transpiler.cost.model import MICRO_BATCHES, MOVABLE, PlanCost, Prediction, Workload
from transpiler.cost.money import Objective, dollars
from transpiler.cost.profile import Profile
from transpiler.ir import Op, Program
from transpiler.settings import ScaleConfig


# -- the tuner ------------------------------------------------------------------------------------
@dataclass
class Budget:
    """What a run may use: `cpu` CPU processes (cpu-kind trainers and PS shards), `gpu` GPUs (gpu-kind
    trainers); `modes` the PS modes allowed; `micro_batches` the choices tried; `max_servers`."""

    cpu: int
    gpu: int = 0
    modes: tuple[str, ...] = ("sync",)
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    max_servers: int | None = None

    def __post_init__(self) -> None:
        if self.cpu < 2:
            raise ValueError(
                f"a budget of cpu={self.cpu}: a run needs at least 2 CPU processes "
                "(one trainer, one parameter-server shard)"
            )
        if self.gpu < 0:
            raise ValueError(f"gpu={self.gpu}: expected >= 0")
        if not self.modes:
            raise ValueError("Budget.modes is empty: choose from 'sync', 'async'")
        for m in self.modes:
            check_mode(m, "Budget.modes: mode")


@dataclass
class Move:
    """An op the tuner moved off its category's trainer type, and the predicted gain."""

    op_id: int
    op_type: str
    var: str
    src: str
    dst: str
    before: float
    after: float


@dataclass
class TuneResult:
    """The winner: `config` (placement, shards, mode) for `transpile`, `scale` for `train(scale=...)`
    as it is, and the prediction for them on `workload`."""

    config: TranspileConfig
    scale: ScaleConfig
    workload: Workload
    prediction: Prediction
    baseline: Prediction
    moves: list[Move]
    runner_up: Prediction | None
    evaluated: int
    objective: Objective = field(default_factory=Objective)

    def explain(self) -> str:
        p, b = self.prediction, self.baseline
        lines = [
            f"winner: {p.scale.describe()}: {p.examples_per_s:,.0f} examples/s predicted "
            f"({self.evaluated} settings evaluated)",
            f"  bottleneck {p.bottleneck}: {p.limit}",
            f"  the default placement's best setting ({b.scale.describe()}): "
            f"{b.examples_per_s:,.0f} examples/s",
        ]
        if self.runner_up is not None:
            r = self.runner_up
            lines.append(
                f"  runner-up: {r.scale.describe()}: {r.examples_per_s:,.0f} examples/s "
                f"(bottleneck {r.bottleneck})"
            )
        for mv in self.moves:
            lines.append(
                f"  moved op id {mv.op_id} {mv.op_type!r} (makes {mv.var!r}) {mv.src} -> {mv.dst}: "
                f"{mv.before:,.0f} -> {mv.after:,.0f} examples/s predicted"
            )
        if not self.moves:
            lines.append(
                "  placement: the category map's placement kept (no single op move predicted faster)"
            )
        lines.append(p.describe())
        return "\n".join(lines + self.money())

    def money(self) -> list[str]:
        """The winner's and the runner-up's $ per hour, per million examples and per epoch, and what
        bounds the winner (empty without prices)."""
        obj = self.objective
        if obj.prices is None:
            return []
        lines = [f"objective: {obj.describe()}"]
        for what, p in (("chosen", self.prediction), ("runner-up", self.runner_up)):
            if p is None:
                continue
            c = obj.costing(p)
            lines.append(
                f"  {what:>9}: {p.scale.describe()}: {p.examples_per_s:,.0f} examples/s for "
                f"${c.hourly:.3f}/h ({c.rented}): ${dollars(c.per_million)} per million examples, "
                f"${dollars(c.per_epoch)} per epoch of {obj.epoch:,} examples ({60 * c.epoch_hours:.1f} min)"
            )
        lines.append(f"  why: {self.bound()}")
        return lines

    def bound(self) -> str:
        """Which resource bounds the winner under the objective."""
        obj, p = self.objective, self.prediction
        c = obj.costing(p)
        cpu, gpu = resources_of(p)
        share = ""
        if obj.prices is not None and not obj.prices.machines and c.hourly > 0:
            share = f"; GPUs are {100 * gpu * obj.prices.gpu / c.hourly:.0f}% of its $/h, cores the rest"
        why = f"{obj.describe()} of all settings predicted"
        return (
            f"{why}, with {cpu} core(s) and {gpu} GPU(s); its step is bounded by {p.bottleneck} "
            f"({p.limit}){share}"
        )


LARGE_GRID = 2000  # settings: above this many, op moves are tried on the SHORTLIST best ones only
SHORTLIST = 64


def resources_of(p: Prediction) -> tuple[int, int]:
    """(cores, GPUs) of a prediction's setting (`transpiler.cost.money.resources`)."""
    from transpiler.cost.money import resources

    return resources(p.scale)


def resource_grid(
    types: dict[str, str], budget: Budget, modes: tuple[str, ...] | None = None
) -> list[ScaleConfig]:
    """Every ScaleConfig within `budget` for trainer types {type: kind} (`modes`: those of the budget
    to try, default all)."""
    cpu_types = [t for t, k in types.items() if k == "cpu"]
    gpu_types = [t for t, k in types.items() if k == "gpu"]
    if gpu_types and budget.gpu < len(gpu_types):
        raise ValueError(f"the plan has GPU trainer types {gpu_types}; the budget gives gpu={budget.gpu}")
    out = []
    max_servers = min(budget.max_servers or budget.cpu, budget.cpu - len(cpu_types))
    cpu_choices = [tried_counts(budget.cpu - 1) for _ in cpu_types]
    gpu_choices = [tried_counts(budget.gpu) for _ in gpu_types]
    for cpu_n in itertools.product(*cpu_choices):
        for servers in tried_counts(max_servers):
            if sum(cpu_n) + servers > budget.cpu:
                continue
            for gpu_n in itertools.product(*gpu_choices):
                if sum(gpu_n) > budget.gpu:
                    continue
                counts = {
                    **dict(zip(cpu_types, cpu_n, strict=True)),
                    **dict(zip(gpu_types, gpu_n, strict=True)),
                }
                for mb, mode in itertools.product(budget.micro_batches, modes or budget.modes):
                    out.append(ScaleConfig(counts, mb, servers, mode))
    return out


def tried_counts(n: int) -> list[int]:
    """Process counts tried up to `n`: every count to 8, then about 1.5x apart, and `n` itself."""
    out = list(range(1, min(n, 8) + 1))
    while out and out[-1] < n:
        out.append(min(n, max(out[-1] + 1, round(out[-1] * 1.5))))
    return out


def _processes(s: ScaleConfig) -> int:
    return sum((s.trainers or {}).values()) + (s.servers or 0)


def best_setting(
    cost: PlanCost,
    grid: list[ScaleConfig],
    workload: Workload | None = None,
    objective: Objective | None = None,
) -> tuple[Prediction, Prediction | None]:
    """The best predicted setting by `objective` (default: the fastest; ties, within 0.5%: fewer
    processes, then fewer micro-batches), and the runner-up (the next best feasible one)."""
    obj = objective or Objective()
    preds = [cost.predict(s, workload) for s in grid]
    ok = [p for p in preds if obj.feasible(p)]
    if not ok:
        fastest = max(preds, key=lambda p: p.examples_per_s)
        money = obj.costing(fastest)
        raise ValueError(
            f"no setting within the budget meets {obj.describe()}: the fastest predicted is "
            f"{fastest.scale.describe()} at {fastest.examples_per_s:,.0f} examples/s"
            + (f" for ${money.hourly:.3f}/h" if money else "")
            + "; raise the budget (cpu, gpu), lower --target or raise --max-hourly"
        )
    ok.sort(key=lambda p: (-obj.score(p), -p.examples_per_s))
    top = obj.score(ok[0])
    near = [p for p in ok if obj.score(p) == top or obj.score(p) >= top - 0.005 * abs(top)]
    if obj.kind == "target":  # equal cost: the faster first
        near = [p for p in near if p.examples_per_s >= 0.995 * near[0].examples_per_s]
    win = min(near, key=lambda p: (_processes(p.scale), p.scale.micro_batches))
    rest = [p for p in ok if p is not win]
    return win, (rest[0] if rest else None)


def tune(
    program: Program,
    profile: Profile,
    budget: Budget,
    config: TranspileConfig | None = None,
    batch_size: int = 512,
    cores: int | None = None,
    unique_fraction: float = 1.0,
    device_map: dict[str, str] | None = None,
    transpile_fn: Callable[[Program, TranspileConfig], Any] | None = None,
    placement: bool = True,
    objective: Objective | None = None,
    workload: Workload | None = None,
) -> TuneResult:
    """Search placement of light and dense ops (one op at a time, greedily, while the prediction
    improves; on a grid of over LARGE_GRID settings each move is tried on the SHORTLIST settings best
    for the category map's placement, and the final placement on the whole grid), trainer counts,
    micro-batches, shards and modes within `budget`; return the best by
    `objective` (default: the fastest). `workload` replaces batch_size, cores and unique_fraction."""
    from transpiler.plan import transpile

    transpile_fn = transpile_fn or transpile
    config = config or TranspileConfig()
    objective = objective or Objective()
    types = {t: kind_of(t, device_map) for t in config.trainer_types}
    workload = workload or Workload(batch_size, cores, unique_fraction)

    def evaluate(cfg: TranspileConfig, only: list[ScaleConfig] | None = None) -> tuple:
        plan = transpile_fn(program, cfg)
        used = {t: types[t] for t in plan.programs}
        modes = ("sync",) if plan.clipped_tables else budget.modes  # clipping: sync only
        if plan.clipped_tables and "sync" not in budget.modes:
            raise ValueError(
                f"the plan clips gradients by global norm (tables {plan.clipped_tables}), which trains "
                f"in sync mode only, and the budget's modes are {budget.modes}: allow 'sync'"
            )
        grid = only or [replace(g, device_map=device_map) for g in resource_grid(used, budget, modes)]
        win, second = best_setting(cost := PlanCost(plan, profile, device_map), grid, workload, objective)
        short = None
        if len(grid) > LARGE_GRID:  # op moves are tried on the best settings of this placement only
            preds = [cost.predict(g, workload) for g in grid]
            preds.sort(key=lambda p: (objective.feasible(p), objective.score(p)), reverse=True)
            short = [p.scale for p in preds[:SHORTLIST]]
        return plan, win, second, len(grid), short

    plan, best, runner_up, evaluated, short = evaluate(config)
    baseline = best
    found = _place(evaluate, plan, best, runner_up, config, objective, short) if placement else None
    current, moves = config, []
    if found is not None:
        plan, best, runner_up, current, moves, n = found
        evaluated += n
    scale = replace(best.scale, device_map=device_map)
    cfg = replace(current, num_servers=scale.servers, mode=scale.mode)
    return TuneResult(cfg, scale, workload, best, baseline, moves, runner_up, evaluated, objective)


def _place(
    evaluate: Callable,
    plan: Any,
    best: Prediction,
    runner_up: Prediction | None,
    current: TranspileConfig,
    objective: Objective,
    short: list[ScaleConfig] | None,
) -> tuple:
    """Best improvement: each round applies the single op move predicted best by `objective`, until
    none gains; (plan, best, runner-up, config, moves, settings evaluated)."""
    moves: list[Move] = []
    evaluated = 0
    tried: set[tuple[int, str]] = set()
    while True:
        found = None
        for op in _movable_ops(plan):
            for dst in [t for t in current.trainer_types if t != op.device and (op.id, t) not in tried]:
                tried.add((op.id, dst))
                var = op.output_names()[0]
                cfg = replace(current, name_devices={**current.name_devices, _glob_escape(var): dst})
                try:
                    cand, pred, second, n, _ = evaluate(cfg, short)
                except Exception:  # a placement the transpiler or the profile cannot serve: skip it
                    continue
                evaluated += n
                if objective.better(pred, found[2] if found else best):
                    move = Move(op.id, op.type, var, op.device, dst, best.examples_per_s, pred.examples_per_s)
                    found = (move, cand, pred, second, cfg)
        if found is None:
            break
        move, plan, best, runner_up, current = found
        moves.append(move)
    if short is not None and moves:  # the placement moved: its best over the whole grid
        plan, best, runner_up, n, _ = evaluate(current)
        evaluated += n
    return plan, best, runner_up, current, moves, evaluated


def _movable_ops(plan: Any) -> list[Op]:
    """Forward ops of light, dense or loss categories, in program order (candidates to move)."""
    out = []
    for prog in plan.programs.values():
        for op in prog.ops:
            if op.role in ("forward", "loss") and get_op(op.type).category in MOVABLE and op.output_names():
                out.append(op)
    return sorted(out, key=lambda op: op.id)


def _glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)
