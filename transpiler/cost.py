"""The cost model: predict a plan's throughput from a measured profile, and search for the best setting.

A `Profile` holds what was measured on one machine (runtime/profile.py measures it and caches it):
each op's kernel time on each trainer kind as `fixed_s + per_example_s * examples` (keyed by the op's
signature: type, input shapes, attrs, so it serves any plan with the same ops), the link between
processes (`latency_s` per message + `per_byte_s`), and the parameter server (per request, per byte
of a dense table, per byte of sparse rows). Nothing here measures anything: given a profile, the
prediction is arithmetic, so it is tested against hand-computed expectations.

The throughput model, per step of a global batch of B examples, R reader trainers, M micro-batches:
an item (micro-batch) has m = B / (R M) examples; a trainer of type t runs R M / n_t items per step
(n_t trainers of type t; readers run M each), each costing its kernels at m examples plus its sends
and receives (one message per segment and peer, `latency_s + bytes * per_byte_s`). PS work per step:
each trainer pulls and pushes the dense tables it uses once per step (one request per shard it
touches), a reader pulls and pushes the unique rows of its step's ids (ids x `unique_fraction`).
Dense tables sit whole on a shard (largest first onto the least loaded), sparse rows spread evenly.
- async: the step takes as long as the busiest process (trainer or shard);
- sync: the busiest process, plus one item's way through the other trainer types (the pipeline
  fills and drains at each step boundary) plus the dense push + pull round trip that separates
  steps (a pull of step t+1 waits for step t's update);
- when every process shares `cores` CPU cores (one machine), the step takes at least the CPU work
  of all processes / cores (all but a real GPU's kernels; an emulated GPU's kernels count).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ops_registry import get_op

from .config import KINDS, TranspileConfig, kind_of
from .ir import Op, Program
from .passes.assign_devices import bytes_per_example
from .schedule import segments

COMM_TYPES = frozenset({"send", "recv", "pull_dense", "push_dense", "pull_sparse", "push_sparse", "data"})
MICRO_BATCHES = (1, 2, 4, 8, 16)
MOVABLE = frozenset({"dense", "light", "loss"})


def op_signature(op: Op, program: Program) -> str:
    """What an op's kernel time depends on: type, input shapes and dtypes, attrs (a short hash)."""
    block = program.global_block()
    ins = {}
    for slot, names in sorted(op.inputs.items()):
        vs = [block.vars.get(n) for n in names if n]
        ins[slot] = [(list(v.shape) if v.shape is not None else None, v.dtype) if v else None for v in vs]
    attrs = {k: v for k, v in op.attrs.items() if k not in ("op_role", "op_device", "fwd_id")}
    text = json.dumps([op.type, ins, attrs], sort_keys=True, default=str)
    return f"{op.type}:{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def kernel_ops(program: Program) -> list[Op]:
    """The ops of a (sub-)program that run a registry kernel (not comm, PS or data ops)."""
    return [op for op in program.ops if op.type not in COMM_TYPES and get_op(op.type).kernel is not None]


# -- the measured profile -------------------------------------------------------------------------
@dataclass
class KernelCost:
    """Seconds for one call of an op's kernel on `examples` examples: fixed_s + per_example_s * n."""

    fixed_s: float
    per_example_s: float

    def at(self, examples: float) -> float:
        return self.fixed_s + self.per_example_s * examples


@dataclass
class LinkCost:
    """One message between two processes: latency_s + per_byte_s * bytes, for each of the sender and
    the receiver (each pays half of a measured send + receive)."""

    latency_s: float
    per_byte_s: float

    def message(self, nbytes: float) -> float:
        return self.latency_s + self.per_byte_s * nbytes


@dataclass
class PSCost:
    """A parameter-server round trip: request_s each, table_s per table in it, plus per byte of dense
    tables, plus per sparse row (id handling) and per byte of sparse rows."""

    request_s: float
    dense_byte_s: float
    sparse_byte_s: float
    sparse_row_s: float = 0.0
    lookup_s: float = 0.0  # a reader's own work per id looked up (gather of pulled rows, merge of grads)
    table_s: float = 0.0  # per table in a request (a pull or push of many tables is one request)


@dataclass
class Overhead:
    """The runtime's own CPU work beyond kernels, messages and PS calls (trainer loop, scheduling,
    reports), calibrated from short real runs: per item and per step of a reader trainer and of
    another trainer, per step and trainer a shard serves, and the driver's per item and step."""

    reader_item_s: float = 0.0
    reader_step_s: float = 0.0
    item_s: float = 0.0
    step_s: float = 0.0
    serve_trainer_s: float = 0.0
    driver_item_s: float = 0.0  # the driver (the process calling train): per item reported
    driver_step_s: float = 0.0  # and per step; it shares the cores, off the critical path


@dataclass
class Profile:
    """What was measured on one machine. `kernels[kind][signature]`; `emulated`: kinds whose kernels
    ran on the CPU (a GPU type emulated with numpy), so they use CPU cores."""

    kernels: dict[str, dict[str, KernelCost]]
    link: LinkCost
    ps: PSCost
    cores: int = 1
    emulated: list[str] = field(default_factory=list)
    machine: str = ""
    overhead: dict[str, Overhead] = field(default_factory=dict)  # by PS mode (sync, async)

    def overhead_for(self, mode: str) -> Overhead:
        return self.overhead.get(mode) or Overhead()

    def kernel(self, kind: str, sig: str, op: Op | None = None) -> KernelCost:
        try:
            return self.kernels[kind][sig]
        except KeyError:
            what = f"op {op.type!r} (id {op.id})" if op is not None else sig
            raise KeyError(
                f"the profile has no {kind} time for {what}; profile the plan's ops first "
                "(runtime.profile.profile_plan, or `hetps tune`, which profiles what is "
                "missing)"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        kernels = {k: {s: KernelCost(**c) for s, c in table.items()} for k, table in d["kernels"].items()}
        return cls(
            kernels,
            LinkCost(**d["link"]),
            PSCost(**d["ps"]),
            d.get("cores", 1),
            list(d.get("emulated", [])),
            d.get("machine", ""),
            {mode: Overhead(**o) for mode, o in d.get("overhead", {}).items()},
        )

    def missing(self, programs: dict[str, Program], kinds: Iterable[str] = KINDS) -> dict[str, list[Op]]:
        """{kind: ops of `programs` without a kernel time for that kind}."""
        out: dict[str, list[Op]] = {}
        for kind in kinds:
            have = self.kernels.get(kind, {})
            for prog in programs.values():
                for op in kernel_ops(prog):
                    if op_signature(op, prog) not in have:
                        out.setdefault(kind, []).append(op)
        return out


# -- settings and predictions -----------------------------------------------------------------------
@dataclass
class RunSettings:
    """What `runtime.train` is given besides the plan; `cores`: CPU cores all processes share when
    they run on one machine (None: each process has a core of its own); `unique_fraction`: unique
    ids / ids in a reader's step (the data's skew: 1.0 = every id distinct)."""

    trainers: dict[str, int]
    micro_batches: int = 4
    servers: int = 1
    mode: str = "sync"
    batch_size: int = 512
    cores: int | None = None
    unique_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"RunSettings.mode {self.mode!r}: expected 'sync' or 'async'")
        for what, v in (
            ("micro_batches", self.micro_batches),
            ("servers", self.servers),
            ("batch_size", self.batch_size),
            *((f"trainers[{t!r}]", n) for t, n in self.trainers.items()),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"RunSettings.{what} must be a positive int, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        counts = ",".join(f"{t}={n}" for t, n in self.trainers.items())
        return f"trainers {counts}, {self.micro_batches} micro-batches, {self.servers} server(s), {self.mode}"


@dataclass
class RoleLoad:
    """Seconds per step of one process of a role: computing, sending, in PS calls (client side for a
    trainer, serving for a shard)."""

    role: str
    count: int
    compute_s: float = 0.0
    send_s: float = 0.0
    ps_s: float = 0.0
    server: bool = False
    device_s: float = 0.0  # the part of compute_s on a GPU (not on a CPU core)

    @property
    def busy_s(self) -> float:
        """Time on the role's critical path (a trainer's PS calls run on a background thread)."""
        return self.compute_s + self.send_s + (self.ps_s if self.server else 0.0)

    @property
    def cpu_s(self) -> float:
        """CPU time per step (kernels on a real GPU excluded)."""
        return self.compute_s - self.device_s + self.send_s + self.ps_s


@dataclass
class Prediction:
    """The predicted run: examples/s, step time, the bottleneck and each role's load per step."""

    examples_per_s: float
    step_s: float
    bottleneck: str
    limit: str
    roles: list[RoleLoad]
    settings: RunSettings

    def describe(self) -> str:
        lines = [
            f"predicted {self.examples_per_s:,.0f} examples/s ({1e3 * self.step_s:.1f} ms per step) "
            f"with {self.settings.describe()}; bottleneck: {self.bottleneck} ({self.limit})"
        ]
        for r in self.roles:
            pct = 100 * r.busy_s / self.step_s if self.step_s else 0.0
            lines.append(
                f"  {r.role:>6} x{r.count}: busy {1e3 * r.busy_s:7.2f} ms/step ({pct:3.0f}%): "
                f"compute {1e3 * r.compute_s:.2f}, send {1e3 * r.send_s:.2f}, "
                f"ps {1e3 * r.ps_s:.2f}"
            )
        return "\n".join(lines)


@dataclass
class _TypeCost:
    """Per-item and per-step coefficients of one trainer type (precomputed once per plan)."""

    kind: str
    fixed_s: float = 0.0  # kernels, per item
    per_example_s: float = 0.0  # kernels, per example of an item
    messages: int = 0  # messages sent or received per item
    send_bytes: int = 0  # bytes sent or received per example
    dense_tables: list[str] = field(default_factory=list)
    pushes_dense: bool = False
    sparse_ids: dict[str, int] = field(default_factory=dict)  # sparse table -> ids per example


class PlanCost:
    """A plan's costs under a profile; `predict(settings)` is then arithmetic (fast enough to search)."""

    def __init__(self, plan: Any, profile: Profile, device_map: dict[str, str] | None = None) -> None:
        self.plan, self.profile = plan, profile
        self.tables = {t["name"]: t for t in plan.tables}
        self.reader = next((t for t, p in plan.programs.items() if p.attrs.get("feeds")), None)
        if self.reader is None:
            raise ValueError("the plan has no trainer type that reads data (no data ops): nothing to predict")
        self.types: dict[str, _TypeCost] = {}
        groups: dict[str, int] = {}  # messages per item received by each trainer type
        for t, prog in plan.programs.items():
            tc = self.types[t] = _TypeCost(kind_of(t, device_map))
            for op in kernel_ops(prog):
                k = profile.kernel(tc.kind, op_signature(op, prog), op)
                tc.fixed_s += k.fixed_s
                tc.per_example_s += k.per_example_s
            for seg in segments(prog):  # a segment's sends go out as one message per destination
                sends = [op for op in seg if op.type == "send"]
                for dst in {op.attrs["dst"] for op in sends}:
                    groups[dst] = groups.get(dst, 0) + 1
                    tc.messages += 1
                tc.send_bytes += sum(
                    bytes_per_example(prog.global_block().vars.get(op.inputs["X"][0])) for op in sends
                )
                recvs = [op for op in seg if op.type == "recv"]
                tc.send_bytes += sum(
                    bytes_per_example(prog.global_block().vars.get(op.outputs["Out"][0])) for op in recvs
                )
            tc.dense_tables = sorted({op.attrs["table"] for op in prog.ops if op.type == "pull_dense"})
            tc.pushes_dense = any(op.type == "push_dense" for op in prog.ops)
            # a sparse pull reads the unique ids of a lookup's ids (a unique_ids op's input)
            raw = {
                op.outputs["Unique"][0]: _elements_per_example(
                    prog.global_block().vars.get(op.inputs["Ids"][0])
                )
                for op in prog.ops
                if op.type == "unique_ids"
            }
            for op in prog.ops:
                if op.type == "pull_sparse":
                    tc.sparse_ids[op.attrs["table"]] = raw.get(op.inputs["Ids"][0], 1)

        for t, n in groups.items():
            self.types[t].messages += n

    def _nbytes(self, table: str) -> int:
        t = self.tables[table]
        n = 1
        for d in t["shape"]:
            n *= d
        return n * _itemsize(t["dtype"])

    def _row_bytes(self, table: str) -> int:
        t = self.tables[table]
        n = 1
        for d in t["shape"][1:]:
            n *= d
        return n * _itemsize(t["dtype"])

    def predict(self, s: RunSettings) -> Prediction:
        if set(s.trainers) != set(self.types):
            raise ValueError(
                f"RunSettings.trainers {s.trainers} must give a count for exactly the plan's "
                f"trainer types {sorted(self.types)}"
            )
        p, ps = self.profile, self.profile.ps
        readers = s.trainers[self.reader]
        items = readers * s.micro_batches
        m = s.batch_size / items
        roles: list[RoleLoad] = []
        item_s: dict[str, float] = {}
        shard_s = [0.0] * s.servers
        dense_home = _dense_shards(
            [(n, self._nbytes(n)) for n in self.tables if self.tables[n]["kind"] == "dense"], s.servers
        )
        rtt_s = 0.0
        for t, tc in self.types.items():
            n = s.trainers[t]
            per_trainer = math.ceil(items / n)  # items go round robin: the busiest trainer's share
            kern = tc.fixed_s + tc.per_example_s * m
            if t == self.reader:  # per id and sparse table: gather the pulled rows, merge the gradients
                kern += m * sum(tc.sparse_ids.values()) * ps.lookup_s
            send = 0.5 * (tc.messages * p.link.latency_s + tc.send_bytes * m * p.link.per_byte_s)
            item_s[t] = kern + send
            # PS work of one trainer of this type per step, and what each shard serves for it
            client, serve = 0.0, [0.0] * s.servers
            rounds = 2 if tc.pushes_dense else 1
            touched: set[int] = set()
            for name in tc.dense_tables:
                k = dense_home[name]
                touched.add(k)
                cost = rounds * (self._nbytes(name) * ps.dense_byte_s + ps.table_s)
                serve[k] += cost
                client += cost
            sparse = 0.0
            if t == self.reader and tc.sparse_ids:
                # the step's unique ids, pulled and pushed (2 round trips) for every sparse table
                rows = s.batch_size / readers * s.unique_fraction
                sparse = 2 * sum(
                    rows * ids * (ps.sparse_row_s + self._row_bytes(x) * ps.sparse_byte_s) + ps.table_s
                    for x, ids in tc.sparse_ids.items()
                )
                touched.update(range(s.servers))
                for k in range(s.servers):
                    serve[k] += sparse / s.servers
                client += sparse
            requests = (rounds if tc.dense_tables else 0) + (2 if sparse else 0)
            for k in touched:
                serve[k] += requests * ps.request_s
            client += requests * ps.request_s * (len(touched) > 0)
            for k in range(s.servers):
                shard_s[k] += n * serve[k]
            if tc.dense_tables:
                rtt_s = max(rtt_s, client)
            ov = p.overhead_for(s.mode)
            own = (
                per_trainer * ov.reader_item_s + ov.reader_step_s
                if t == self.reader
                else per_trainer * ov.item_s + ov.step_s
            )
            item_s[t] += own / per_trainer
            for k in touched:
                shard_s[k] += n * ov.serve_trainer_s
            on_device = tc.kind == "gpu" and "gpu" not in p.emulated
            roles.append(
                RoleLoad(
                    t,
                    n,
                    per_trainer * kern + own,
                    per_trainer * send,
                    client,
                    device_s=per_trainer * kern if on_device else 0.0,
                )
            )
        roles.append(RoleLoad("ps", s.servers, ps_s=max(shard_s), server=True))
        busiest = max(roles, key=lambda r: r.busy_s)
        step, limit = busiest.busy_s, "the busiest process"
        if s.mode == "sync":
            fill = sum(item_s.values()) - max(item_s.values())
            step += fill + rtt_s
            limit = "the busiest process + the pipeline's fill and the PS round trip at each step boundary"
        if s.cores is not None:
            cpu_work = sum(r.count * r.cpu_s for r in roles if not r.server)
            ov = p.overhead_for(s.mode)
            cpu_work += sum(shard_s) + ov.driver_step_s + items * ov.driver_item_s
            if cpu_work / s.cores > step:
                step, limit = cpu_work / s.cores, f"all processes share {s.cores} CPU core(s)"
        step = max(step, 1e-12)
        return Prediction(s.batch_size / step, step, busiest.role, limit, roles, s)


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def _elements_per_example(var: Any) -> int:
    if var is None or var.shape is None:
        return 1
    n = 1
    for d in var.shape:
        n *= d if d > 0 else 1
    return n


def _dense_shards(tables: list[tuple[str, int]], servers: int) -> dict[str, int]:
    """Dense tables to shards, largest first onto the least loaded shard."""
    load = [0] * servers
    home = {}
    for name, nbytes in sorted(tables, key=lambda x: (-x[1], x[0])):
        k = min(range(servers), key=lambda i: (load[i], i))
        home[name] = k
        load[k] += nbytes
    return home


def predict(
    plan: Any, profile: Profile, settings: RunSettings, device_map: dict[str, str] | None = None
) -> Prediction:
    """The predicted examples/s, bottleneck and per-role load of `plan` run with `settings`."""
    return PlanCost(plan, profile, device_map).predict(settings)


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
        bad = [m for m in self.modes if m not in ("sync", "async")]
        if bad or not self.modes:
            raise ValueError(f"modes {self.modes}: choose from 'sync', 'async'")


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
    config: TranspileConfig
    settings: RunSettings
    prediction: Prediction
    baseline: Prediction
    moves: list[Move]
    runner_up: Prediction | None
    evaluated: int

    def explain(self) -> str:
        p, b = self.prediction, self.baseline
        lines = [
            f"winner: {p.settings.describe()}: {p.examples_per_s:,.0f} examples/s predicted "
            f"({self.evaluated} settings evaluated)",
            f"  bottleneck {p.bottleneck}: {p.limit}",
            f"  the default placement's best setting ({b.settings.describe()}): "
            f"{b.examples_per_s:,.0f} examples/s",
        ]
        if self.runner_up is not None:
            r = self.runner_up
            lines.append(
                f"  runner-up: {r.settings.describe()}: {r.examples_per_s:,.0f} examples/s "
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
        return "\n".join(lines)


def resource_grid(
    types: dict[str, str], budget: Budget, batch_size: int, cores: int | None, unique_fraction: float
) -> list[RunSettings]:
    """Every RunSettings within `budget` for trainer types {type: kind}."""
    cpu_types = [t for t, k in types.items() if k == "cpu"]
    gpu_types = [t for t, k in types.items() if k == "gpu"]
    if gpu_types and budget.gpu < len(gpu_types):
        raise ValueError(f"the plan has GPU trainer types {gpu_types}; the budget gives gpu={budget.gpu}")
    out = []
    max_servers = min(budget.max_servers or budget.cpu, budget.cpu - len(cpu_types))
    cpu_choices = [range(1, budget.cpu) for _ in cpu_types]
    gpu_choices = [range(1, budget.gpu + 1) for _ in gpu_types]
    for cpu_n in itertools.product(*cpu_choices):
        for servers in range(1, max_servers + 1):
            if sum(cpu_n) + servers > budget.cpu:
                continue
            for gpu_n in itertools.product(*gpu_choices):
                if sum(gpu_n) > budget.gpu:
                    continue
                counts = {
                    **dict(zip(cpu_types, cpu_n, strict=True)),
                    **dict(zip(gpu_types, gpu_n, strict=True)),
                }
                for mb, mode in itertools.product(budget.micro_batches, budget.modes):
                    out.append(RunSettings(counts, mb, servers, mode, batch_size, cores, unique_fraction))
    return out


def _processes(s: RunSettings) -> int:
    return sum(s.trainers.values()) + s.servers


def best_setting(cost: PlanCost, grid: list[RunSettings]) -> tuple[Prediction, Prediction | None]:
    """The fastest predicted setting (ties, within 0.5%: fewer processes, then fewer micro-batches),
    and the runner-up."""
    preds = sorted((cost.predict(s) for s in grid), key=lambda p: -p.examples_per_s)
    top = preds[0].examples_per_s
    near = [p for p in preds if p.examples_per_s >= 0.995 * top]
    win = min(near, key=lambda p: (_processes(p.settings), p.settings.micro_batches))
    rest = [p for p in preds if p is not win]
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
) -> TuneResult:
    """Search placement of light and dense ops (one op at a time, greedily, while the prediction
    improves), trainer counts, micro-batches, shards and modes within `budget`; return the winner."""
    from .plan import transpile

    transpile_fn = transpile_fn or transpile
    config = config or TranspileConfig()
    types = {t: kind_of(t, device_map) for t in config.trainer_types}

    def evaluate(cfg: TranspileConfig) -> tuple[Any, Prediction, Prediction | None, int]:
        plan = transpile_fn(program, cfg)
        used = {t: types[t] for t in plan.programs}
        grid = resource_grid(used, budget, batch_size, cores, unique_fraction)
        win, second = best_setting(PlanCost(plan, profile, device_map), grid)
        return plan, win, second, len(grid)

    plan, best, runner_up, evaluated = evaluate(config)
    baseline, moves = best, []
    current = config
    tried: set[tuple[int, str]] = set()
    while placement:  # best improvement: each round applies the single move predicted fastest
        found = None
        for op in _movable_ops(plan):
            for dst in [t for t in current.trainer_types if t != op.device and (op.id, t) not in tried]:
                tried.add((op.id, dst))
                var = op.output_names()[0]
                cfg = replace(current, name_devices={**current.name_devices, _glob_escape(var): dst})
                try:
                    cand, pred, second, n = evaluate(cfg)
                except Exception:  # a placement the transpiler or the profile cannot serve: skip it
                    continue
                evaluated += n
                if pred.examples_per_s > 1.01 * (found[2] if found else best).examples_per_s:
                    move = Move(op.id, op.type, var, op.device, dst, best.examples_per_s, pred.examples_per_s)
                    found = (move, cand, pred, second, cfg)
        if found is None:
            break
        move, plan, best, runner_up, current = found
        moves.append(move)
    cfg = replace(current, num_servers=best.settings.servers, mode=best.settings.mode)
    return TuneResult(cfg, best.settings, best, baseline, moves, runner_up, evaluated)


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
