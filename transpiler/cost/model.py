"""The cost model: predict a plan's throughput from a measured profile (the search: transpiler/cost/tune.py).

A `Profile` holds what was measured on one machine (runtime/profile/machine.py measures it and caches it):
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
touches; a table it holds, `transpiler.passes.held`: one optimizer step of its own instead), a reader
pulls and pushes the unique rows of its step's ids (ids x `unique_fraction`).
Dense tables sit whole on a shard (largest first onto the least loaded), sparse rows spread evenly.
- async: the step takes as long as the busiest process (trainer or shard), and at least half of one
  item's way through every trainer type (its kernels, messages and own overhead on each): a reader
  keeps at most 2 M items in flight (`config.items_in_flight`: this step's and the next one's), so
  M items come back per half an item's way at best;
- sync: a chain per step. A pull of step t+1 waits until the shard applied step t, i.e. every
  trainer's push of step t: the reader pulls its rows, runs its items' forward and sends them, the
  other types compute (their dense tables pulled), the gradients come back, the reader pushes its
  rows and the dense gradients are pushed, and only once the shard applied them does step t+1's
  pull return. So the step is the busiest process, plus one item's way through the other trainer
  types (the pipeline fills and drains at each step boundary), plus the PS round trips (pull +
  push) of one trainer of each type in turn (a reader's sparse rows, the dense tables): each is
  its client time, which includes the shard's serving of it — less what the busiest (non-reader)
  type computes after its last sends of the step: its weight gradients, half of each `gemm_grad`
  (transpiler/passes/segment_order.py runs them after the input gradients are sent), overlap that chain;
- a reader's own work per id: gathering the pulled rows and merging the gradients (per id and
  sparse table), and the union of a step's ids for the rows' prefetch (per id of each id column);
- a process's background thread (its PS calls) and its main thread take turns on one core (the
  interpreter lock), so the step takes at least the CPU work of the busiest process;
- when every process shares `cores` CPU cores (one machine), the step takes at least the CPU work
  of all processes / cores (all but a real GPU's kernels; an emulated GPU's kernels count).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from transpiler.config import items_in_flight, kind_of
from transpiler.cost.balance import balance
from transpiler.cost.profile import Profile, check_groups, kernel_ops, op_signature
from transpiler.passes.assign_devices import bytes_per_example
from transpiler.passes.held import held_dense
from transpiler.passes.schedule import segments
from transpiler.settings import ScaleConfig, check_positive, record_from_dict

MICRO_BATCHES = (1, 2, 4, 8, 16)
MOVABLE = frozenset({"dense", "light", "loss"})
# the model's own error beside the load's: half the width of a prediction interval, relative (the
# median |error| of benchmarks/tune.py's grid on a quiet machine is 4-7%, its max ~20%)
MODEL_BAND = 0.10


@dataclass(frozen=True)
class Workload:
    """What the cost model assumes besides the scale: the global `batch_size`; `cores`: CPU cores all
    processes share when they run on one machine (None: each process has a core of its own);
    `unique_fraction`: unique ids / ids in a reader's step (the data's skew: 1.0 = every id
    distinct); `share_alone`, `share_all` (+- `share_spread`, relative): the share of a core a
    busy thread got beside other processes, one alone and one on every core at once, and
    `share_chain` of two waking each other, `competing`: the other processes' runnable threads in
    the run's scheduling group and `groups`: those of other sessions' groups
    (`transpiler.cost.profile.Load`; 1, 1, 1, 0, (): an idle machine; used only with `cores`)."""

    batch_size: int = 512
    cores: int | None = None
    unique_fraction: float = 1.0
    share_alone: float = 1.0
    share_all: float = 1.0
    share_spread: float = 0.0
    share_chain: float = 1.0
    competing: float = 0.0  # other processes' runnable threads, weighted by nice (Load.competing)
    groups: tuple[tuple[float, float], ...] = ()  # other sessions' scheduling groups (Load.groups)

    def __post_init__(self) -> None:
        check_positive(self.batch_size, "Workload.batch_size")
        check_positive(self.cores, "Workload.cores", optional=True)
        for name in ("share_alone", "share_all", "share_spread", "share_chain"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
                raise ValueError(f"Workload.{name} must be a share in [0, 1], got {v!r}")
        if min(self.share_alone, self.share_all, self.share_chain) <= 0:
            raise ValueError(
                f"Workload.share_alone / share_all must be > 0 (a thread's share of a core), got "
                f"{self.share_alone!r} / {self.share_all!r}"
            )
        if not isinstance(self.competing, (int, float)) or not self.competing >= 0:
            raise ValueError(f"Workload.competing must be >= 0 (runnable threads), got {self.competing!r}")
        object.__setattr__(self, "groups", check_groups(self.groups, "Workload.groups"))
        f = self.unique_fraction
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1:
            raise ValueError(f"Workload.unique_fraction must be in (0, 1], got {f!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Workload:
        return record_from_dict(cls, data)


@dataclass
class RoleLoad:
    """Seconds per step of one process of a role: computing, sending, in PS calls (client side for a
    trainer, serving for a shard; `ps_cpu`: the share of a trainer's PS call time on its own CPU,
    `PSCost.client_cpu`)."""

    role: str
    count: int
    compute_s: float = 0.0
    send_s: float = 0.0
    ps_s: float = 0.0
    server: bool = False
    device_s: float = 0.0  # the part of compute_s on a GPU (not on a CPU core)
    ps_cpu: float = 1.0

    @property
    def busy_s(self) -> float:
        """Time on the role's critical path (a trainer's PS calls run on a background thread)."""
        return self.compute_s + self.send_s + (self.ps_s if self.server else 0.0)

    @property
    def cpu_s(self) -> float:
        """CPU time per step (kernels on a real GPU excluded; of a trainer's PS calls, the client's
        own share: the shard's serving is counted on the shard)."""
        return (
            self.compute_s - self.device_s + self.send_s + self.ps_s * (1.0 if self.server else self.ps_cpu)
        )


@dataclass
class Prediction:
    """The predicted run: examples/s, step time, the bottleneck and each role's load per step."""

    examples_per_s: float
    step_s: float
    bottleneck: str
    limit: str
    roles: list[RoleLoad]
    scale: ScaleConfig  # resolved for the plan
    workload: Workload
    low: float = 0.0  # the prediction interval, examples/s: the load's spread and the model's band
    high: float = 0.0

    def describe(self) -> str:
        lines = [
            f"predicted {self.examples_per_s:,.0f} examples/s ({1e3 * self.step_s:.1f} ms per step) "
            f"(interval {self.low:,.0f} .. {self.high:,.0f}) "
            f"with {self.scale.describe()}; bottleneck: {self.bottleneck} ({self.limit})"
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
    feed_ids: int = 0  # ids per example of the distinct fed id columns that sparse lookups read
    after_sends_fixed_s: float = 0.0  # kernels after an item's last sends (weight gradients), per item
    after_sends_per_example_s: float = 0.0
    ops: int = 0  # kernel ops per item (the calibrated overhead per item scales with them)


class PlanCost:
    """A plan's costs under a profile; `predict(scale, workload)` is then arithmetic (fast enough to
    search)."""

    def __init__(self, plan: Any, profile: Profile, device_map: dict[str, str] | None = None) -> None:
        self.plan, self.profile = plan, profile
        self.tables = {t.name: t for t in plan.tables}
        self.reader = next(iter(plan.reader_types), None)
        if self.reader is None:
            raise ValueError("the plan has no trainer type that reads data (no data ops): nothing to predict")
        self.types: dict[str, _TypeCost] = {}
        groups: dict[str, int] = {}  # messages per item received by each trainer type
        for t, prog in plan.programs.items():
            tc = self.types[t] = _TypeCost(kind_of(t, device_map))
            for op in kernel_ops(prog):
                tc.ops += 1
                k = profile.kernel(tc.kind, op_signature(op, prog), op)
                tc.fixed_s += k.fixed_s
                tc.per_example_s += k.per_example_s
                if op.type == "gemm_grad" and t != self.reader:  # its weight half runs after the sends
                    tc.after_sends_fixed_s += k.fixed_s / 2
                    tc.after_sends_per_example_s += k.per_example_s / 2
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
            fed = {op.inputs["Ids"][0] for op in prog.ops if op.type == "unique_ids"}
            tc.feed_ids = sum(_elements_per_example(prog.global_block().vars.get(x)) for x in fed)

        for t, n in groups.items():
            self.types[t].messages += n
        self._held: dict[tuple, set[str]] = {}  # (trainer counts, on?) -> the dense tables held

    def talking(self, s: ScaleConfig) -> int:
        """How many trainer types send requests to the shards under `s` (not holding all they use)."""
        held = self.held(s)
        return sum(1 for tc in self.types.values() if set(tc.dense_tables) - held or tc.sparse_ids)

    def held(self, s: ScaleConfig) -> set[str]:
        """The dense tables a trainer holds under scale `s` (`transpiler.passes.held`)."""
        key = (tuple(sorted(s.trainers.items())), s.dense_on_trainer)
        if key not in self._held:
            plan = self.plan
            self._held[key] = set(held_dense(plan.programs, plan.tables, s.trainers)) if key[1] else set()
        return self._held[key]

    def _nbytes(self, table: str) -> int:
        t = self.tables[table]
        return math.prod(t.shape) * _itemsize(t.dtype)

    def _row_bytes(self, table: str) -> int:
        t = self.tables[table]
        return math.prod(t.shape[1:]) * _itemsize(t.dtype)

    def predict(self, scale: ScaleConfig, workload: Workload | None = None) -> Prediction:
        """The prediction for `scale` (its None fields as `train` fills them for the plan)."""
        s, w = scale.resolved(self.plan), workload or Workload()
        p, ps = self.profile, self.profile.ps
        readers = s.trainers[self.reader]
        items = readers * s.micro_batches
        m = w.batch_size / items
        roles: list[RoleLoad] = []
        item_s: dict[str, float] = {}
        shard_s = [0.0] * s.servers
        dense_home = balance(
            {n: self._nbytes(n) for n in self.tables if self.tables[n].kind == "dense"}, s.servers
        )
        boundary_s = 0.0  # sync: one trainer of each type's PS round trips, one after another
        for t, tc in self.types.items():
            n = s.trainers[t]
            per_trainer = math.ceil(items / n)  # items go round robin: the busiest trainer's share
            kern = tc.fixed_s + tc.per_example_s * m
            if t == self.reader and tc.sparse_ids:
                # per id and sparse table: gather the pulled rows, merge the gradients; per id of
                # each fed id column: its share of the union of the step's ids (the rows' prefetch)
                kern += m * (sum(tc.sparse_ids.values()) * ps.lookup_s + tc.feed_ids * ps.union_s)
            send = 0.5 * (tc.messages * p.link.latency_s + tc.send_bytes * m * p.link.per_byte_s)
            item_s[t] = kern + send
            client, serve, touched = self._ps_work(t, tc, s, w, readers, dense_home)
            for k in range(s.servers):
                shard_s[k] += n * serve[k]
            boundary_s += client
            ov = p.overhead_for(s.mode)
            own = per_trainer * ov.per_item_s(t == self.reader, tc.ops)
            own += ov.reader_step_s if t == self.reader else ov.step_s
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
                    ps_cpu=ps.client_cpu,
                )
            )
        roles.append(RoleLoad("ps", s.servers, ps_s=max(shard_s), server=True))
        busiest = max(roles, key=lambda r: r.busy_s)
        tc = self.types.get(busiest.role)
        boundary_s -= 0.0 if tc is None else tc.after_sends_fixed_s + tc.after_sends_per_example_s * m
        step, limit, cpu_work = self._step_s(s, w, busiest, roles, item_s, sum(shard_s), boundary_s, items)
        loaded, low, high, limit = _under_load(step, cpu_work, w, limit)
        return Prediction(w.batch_size / loaded, loaded, busiest.role, limit, roles, s, w, low, high)

    def _ps_work(
        self,
        t: str,
        tc: _TypeCost,
        s: ScaleConfig,
        w: Workload,
        readers: int,
        dense_home: dict[str, int],
    ) -> tuple[float, list[float], set[int]]:
        """PS work of one trainer of type `t` per step: (its own seconds, what each shard serves for
        it, the shards it touches)."""
        ps = self.profile.ps
        client, serve = 0.0, [0.0] * s.servers
        rounds = 2 if tc.pushes_dense else 1
        touched: set[int] = set()
        held = self.held(s)
        for name in tc.dense_tables:
            if name in held:  # its optimizer step on the trainer: about one pass of a transfer
                client += self._nbytes(name) * ps.dense_byte_s
                continue
            k = dense_home[name]
            touched.add(k)
            cost = rounds * (self._nbytes(name) * ps.dense_byte_s + ps.table_s)
            serve[k] += cost
            client += cost
        sparse = 0.0
        if t == self.reader and tc.sparse_ids:
            # the step's unique ids, pulled and pushed (2 round trips) for every sparse table
            rows = w.batch_size / readers * w.unique_fraction
            sparse = 2 * sum(
                rows * ids * (ps.sparse_row_s + self._row_bytes(x) * ps.sparse_byte_s) + ps.table_s
                for x, ids in tc.sparse_ids.items()
            )
            touched.update(range(s.servers))
            for k in range(s.servers):
                serve[k] += sparse / s.servers
            client += sparse
        requests = (rounds if set(tc.dense_tables) - held else 0) + (2 if sparse else 0)
        for k in touched:
            serve[k] += requests * ps.request_s
        client += requests * ps.request_s * (len(touched) > 0)
        return client, serve, touched

    def _step_s(
        self,
        s: ScaleConfig,
        w: Workload,
        busiest: RoleLoad,
        roles: list[RoleLoad],
        item_s: dict[str, float],
        shards_s: float,
        boundary_s: float,
        items: int,
    ) -> tuple[float, str, float]:
        """(seconds per step on an otherwise idle machine, what limits it, CPU seconds of all processes
        per step) given each role's load; `boundary_s`: what a sync step boundary waits for (PS round
        trips of one trainer per type) less the busiest's after-sends work."""
        p = self.profile
        step, limit = busiest.busy_s, "the busiest process"
        if s.mode == "sync":
            fill = sum(item_s.values()) - max(item_s.values())
            step += max(fill + boundary_s, 0.0)
            limit = "the busiest process + the pipeline's fill and the PS round trips at each step boundary"
        else:  # async: each of a reader's items in flight comes back once per item's way at most
            way = sum(item_s.values()) * s.micro_batches / items_in_flight(s.mode, s.micro_batches)
            if way > step:
                step, limit = way, "the items a reader has in flight (each takes a micro-batch's way)"
        one = max(roles, key=lambda r: r.cpu_s)  # a process's threads share its interpreter: one core
        if one.cpu_s > step:
            step, limit = one.cpu_s, f"{one.role}'s CPU work (its threads take turns on one core)"
        ov = p.overhead_for(s.mode)
        cpu_work = sum(r.count * r.cpu_s for r in roles if not r.server)
        cpu_work += shards_s + ov.driver_step_s + items * ov.driver_item_s
        if w.cores is not None and cpu_work / w.cores > step:
            step, limit = cpu_work / w.cores, f"all processes share {w.cores} CPU core(s)"
        return max(step, 1e-12), limit, cpu_work


def _under_load(step: float, cpu_work: float, w: Workload, limit: str) -> tuple[float, float, float, str]:
    """(step under the other processes' load, interval low / high in examples/s, limit)."""
    shares = (w.share_alone, w.share_all, w.share_chain)
    f = share_of_cores(cpu_work, step, w.cores, *shares, w.competing, w.groups)
    if f < 0.995:
        limit += (
            f"; other processes take a share of the cores (a busy thread of the run gets {100 * f:.0f}% "
            "of a core)"
        )
    lo, hi = 1 - w.share_spread, 1 + w.share_spread
    more, fewer = (tuple((d * k, g) for d, g in w.groups) for k in (hi, lo))
    low = share_of_cores(cpu_work, step, w.cores, *(lo * x for x in shares), w.competing * hi, more)
    high = share_of_cores(
        cpu_work, step, w.cores, *(min(hi * x, 1.0) for x in shares), w.competing * lo, fewer
    )
    n = w.batch_size / step
    return step / f, n * low * (1 - MODEL_BAND), n * high * (1 + MODEL_BAND), limit


def share_of_cores(
    cpu_work: float,
    step: float,
    cores: int | None,
    alone: float,
    every: float,
    chain: float = 1.0,
    competing: float = 0.0,
    groups: tuple[tuple[float, float], ...] = (),
) -> float:
    """The share of a core each busy thread of a run gets while other processes run beside it, from
    the shares a calibration thread got (`alone`: one thread; `every`: each of one per core at
    once; 1, 1: an idle machine), for a run that keeps u = cpu_work / step cores busy when idle.

    The cores the run gets are alone * u for u <= 1, and in between the two measured points for
    1 < u <= cores: alone + (cores * every - alone) (u - 1) / (cores - 1). Linux shares a core
    among its runnable threads, and with autogroups (a session's processes share one group) among
    the groups first, so a run's capacity grows with its threads anywhere from linearly (threads
    shared, `every` == `alone`) to not at all (groups shared, `every` == `alone` / cores): the two
    points measure which. At most `chain`: the share of the wall time two processes that compute
    in turn and wake each other progress (every wake waits for a core), as a run's trainers do.

    And at most the share of each of the u busy threads of a run among `competing` other runnable
    threads (weighted by nice) that are always there: cores / (competing + max(u, 1)) when they
    share the run's scheduling group (or the kernel does not group by session); a probe of one or
    two threads for a moment gets more than that beside busy loops (measured: 0.86 and 0.55 of a
    core beside two, where a run's busiest thread got ~0.5). Other sessions' `groups` (runnable
    threads, weight) take their part of the cores first (`group_cores`)."""
    if cores is None or step <= 0:
        return 1.0
    u = cpu_work / step
    own = competing + max(u, 1.0)
    queue = min(group_cores(cores, own, groups) / own, 1.0) if competing > 0 or groups else 1.0
    if alone >= 1 and every >= 1 and chain >= 1:
        return queue
    if u <= 1 or cores == 1:
        return min(alone, chain, queue, 1.0)
    cap = alone + (cores * every - alone) * (min(u, cores) - 1) / (cores - 1)
    return max(min(cap / u, chain, queue, 1.0), 1e-3)


def group_cores(cores: float, own: float, groups: tuple[tuple[float, float], ...] = ()) -> float:
    """The cores a scheduling group of `own` runnable threads gets beside other `groups` (runnable
    threads, weight against this group's): Linux's group scheduler shares the cores among the
    groups in proportion to their weights, a group never getting more than a core per runnable
    thread, what one leaves going to the others (water-filling: each group gets min(threads,
    level * weight), the level such that all together get `cores`)."""
    every = [(own, 1.0), *groups]
    if sum(d for d, _ in every) <= cores:
        return own
    left, weight = float(cores), sum(g for _, g in every)
    for d, g in sorted(every, key=lambda x: x[0] / x[1]):  # the least demanding per weight first
        if d > left / weight * g:
            break
        left, weight = left - d, weight - g
    return min(own, left / weight)


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


def predict(
    plan: Any,
    profile: Profile,
    scale: ScaleConfig,
    workload: Workload | None = None,
    device_map: dict[str, str] | None = None,
) -> Prediction:
    """The predicted examples/s, bottleneck and per-role load of `plan` run at `scale` on `workload`
    (`device_map`: as train's; default `scale.device_map`)."""
    return PlanCost(plan, profile, device_map or scale.device_map).predict(scale, workload)
